"""The Triton kernels (attention, the fused products) compiled for real GPUs (sm_80, sm_90) on this
CPU machine, with the argument types jax-triton gives each launch (`eejax.kernels.aot`)."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton.backends.nvidia.compiler", reason="triton's CUDA backend is not installed")

from eejax.kernels.aot import LAUNCHES, LINEAR_LAUNCHES, kernel_signature, triton_type  # noqa: E402


def test_every_launch_compiles_for_sm80_and_sm90_and_fits():
    # A subprocess: triton runs compiled or interpreted per process, and the interpreter tests
    # (which may share this worker) set TRITON_INTERPRET.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "eejax.kernels.aot", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    builds = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(builds) == 2 * (len(LAUNCHES) + len(LINEAR_LAUNCHES)), done.stderr[-3000:]
    for build in builds:
        print(
            f"{build['launch']:40} sm_{build['arch']} regs {build['registers']} smem {build['shared_bytes']} "
            f"spills {build['spill_stores'] + build['spill_loads']} B"
        )
        assert build["problems"] == [], build
        assert 0 < build["registers"] <= 255 and build["shared_bytes"] > 0
    assert done.returncode == 0, done.stderr[-3000:]
    assert {b["arch"] for b in builds} == {80, 90}


def test_launches_cover_every_kind_eejax_makes():
    plans = [(launch, launch.plan()) for launch in LAUNCHES]
    assert any(launch.q_shape[1] == 1 for launch, _ in plans)  # decode
    assert any(1 < launch.q_shape[1] <= 8 for launch, _ in plans)  # speculative verification
    assert any(launch.q_shape[1] > 64 for launch, _ in plans)  # prefill chunks
    assert {p.constexprs["BLOCK_M"] for _, p in plans} == {16}  # one query block at any token count
    assert any(p.constexprs["HAS_BIAS"] for _, p in plans)  # T5
    assert {launch.q_shape[-1] for launch, _ in plans} == {64, 128}
    assert {launch.dtype for launch, _ in plans} == {"float32", "bfloat16"}
    assert {p.constexprs["BLOCK_N"] for _, p in plans} == {32, 64}


def test_float_scalars_reach_the_kernel_as_float32():
    # jax-triton types a Python float as fp64, and the kernel's loop-carried softmax state then
    # changes type (fp32 -> fp64): the build fails. The plan passes numpy float32 scalars.
    assert triton_type(0.125) == "fp64" and triton_type(1) == "i32"
    for launch in LAUNCHES:
        signature, constexprs, _ = kernel_signature(launch.plan(), launch.dtype)
        assert signature["scale"] == signature["bias_log_scale"] == "fp32"
        assert "fp64" not in signature.values()
        decode = launch.q_shape[1] == 1
        assert (signature["num_tokens"] == "constexpr") == decode  # jax-triton specialises ints equal to 1
