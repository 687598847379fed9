"""GPUs that XLA compiles eejax's programs for on a machine without one.

XLA:GPU compiles without a device from a target description (its `GpuTargetConfig`: the SM
count, shared memory, compute capability, bandwidth that its fusion cost model reads; no
autotuning). `compile_only_device` makes a JAX device of such a target, and
`ProgramCache.compile_for` compiles a model's programs for it: the optimised HLO then says what a
GPU would launch (`decode.control_flow.kernel_launches`) and whether a quantized product reads the
blocks or a float copy of them, with no GPU.

It needs jax's CUDA plugin (jax-cuda13-plugin and jax-cuda13-pjrt of jax's version: no CUDA
libraries or driver) importable, and the plugin's check for CUDA libraries skipped before JAX
starts (JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1). `scripts/gpu_compiler.sh COMMAND` installs the
plugin into .cache/gpu-compiler and runs COMMAND so; in a process without it the plugin is not
loaded (the rest of eejax never needs it).
"""

from __future__ import annotations

from eejax.errors import EejaxError

# An H100 SXM as XLA describes one (its GpuTargetConfig's device info, as quoted in jax-ml/jax
# issue 28376), and an H200 (the same SMs with 141 GB of HBM3e at 4.8 TB/s): the two GPUs eejax
# was measured on (docs/gpu.md). The bandwidth sways XLA's fusion cost model: compiled for the
# H200, a bf16 step writes its products out in more places than for the H100.
_SM90 = """
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
"""
_RUNTIME = """
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 12 }
runtime_version { major: 13 minor: 0 }
"""
TARGETS = {
    "h100": "gpu_device_info {"
    + _SM90
    + "  memory_bandwidth: 3352320000000\n  device_memory_size: 84929347584\n}"
    + _RUNTIME
    + 'device_description_str: "NVIDIA H100 80GB HBM3"\n',
    "h200": "gpu_device_info {"
    + _SM90
    + "  memory_bandwidth: 4800000000000\n  device_memory_size: 150110011392\n}"
    + _RUNTIME
    + 'device_description_str: "NVIDIA H200"\n',
}


def compile_only_device(target: str = "h100"):
    """A JAX device of `target` (TARGETS) that programs compile for but never run on."""
    if target not in TARGETS:
        raise EejaxError(f"unknown GPU target {target!r}; known: {', '.join(TARGETS)}")
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=TARGETS[target], topology="1x1x1")
    except (NotImplementedError, RuntimeError) as e:
        raise EejaxError(
            "compiling for a GPU without one needs jax's CUDA plugin, loaded with its library check "
            f"skipped: run the command through scripts/gpu_compiler.sh ({e})"
        ) from e
    return topology.devices[0]
