"""The Triton kernels (attention, and the fused products of `triton_linear`: `LINEAR_LAUNCHES`)
compiled ahead of time for real GPUs, on a machine without one.

Every launch configuration eejax makes (`LAUNCHES`: decode at batch 1 and 32, speculative
verification, prefill chunks, T5's relative-position bias, head sizes 64 and 128, fp32 and
bf16) is compiled with Triton's own compiler for an explicit target (sm_80, sm_90: no device is
queried) down to a cubin, with the argument types and specialisations jax-triton gives the same
launch. ptxas reports the registers and spills of each build and Triton its shared memory, which
are checked against the target's limits (spills are reported; more than `SPILL_ALLOWED` fail).

    python -m eejax.kernels.aot [--targets 80,90] [--json]

exits 1 when a build fails or does not fit. It needs triton compiled, not interpreted: run it
in a process where TRITON_INTERPRET is unset (the CPU tests run it as a subprocess).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import re
import subprocess
import sys
import tempfile
import time

import jax.numpy as jnp
import numpy as np

from eejax.kernels.position_bias import RelativePositionBias
from eejax.kernels.triton_attention import (
    NUM_STAGES,
    NUM_WARPS,
    LaunchPlan,
    _kernel,
    _paged_attention_kernel,
    plan_launch,
)

MAX_REGISTERS = 255  # per thread, every architecture since sm_35
REGISTER_FILE = 65536  # 32-bit registers per SM (and per block) on sm_80 and sm_90
SPILL_ALLOWED = 64  # bytes stored plus loaded: ptxas spills a few bytes on a whim; more means too large a tile
SHARED_MEMORY = {80: 166912, 90: 232448}  # opt-in shared memory per block, bytes (A100: 163 KiB, H100: 227 KiB)
T5_BIAS = RelativePositionBias(32, 128, bidirectional=False)  # T5's decoder self-attention


@dataclasses.dataclass(frozen=True)
class Launch:
    """One configuration eejax launches: q [B, T, Hq, Dh] over a cache [L, Hkv, P, S, Dh]."""

    name: str
    q_shape: tuple[int, int, int, int]
    cache_shape: tuple[int, int, int, int, int]
    table_shape: tuple[int, int]
    dtype: str
    scale: float | None = None
    bias: RelativePositionBias | None = None

    def plan(self) -> LaunchPlan:
        return plan_launch(
            self.q_shape, self.cache_shape, self.table_shape, self.dtype, scale=self.scale, bias=self.bias
        )


def _llama(name, batch, tokens, heads, kv_heads, head_dim, dtype, pages=128, **kw):
    """A SmolLM2 / Llama launch over a 2k-token context (pages of 16)."""
    return Launch(
        name,
        (batch, tokens, heads, head_dim),
        (30, kv_heads, batch * pages + 1, 16, head_dim),
        (batch, pages),
        dtype,
        **kw,
    )


LAUNCHES = (
    # SmolLM2-135M: 9 query heads over 3 KV heads, head_dim 64
    _llama("decode b1, hd64 gqa3", 1, 1, 9, 3, 64, "bfloat16"),
    _llama("decode b1, hd64 gqa3, fp32", 1, 1, 9, 3, 64, "float32"),
    _llama("decode b32, hd64 gqa3", 32, 1, 9, 3, 64, "bfloat16"),
    _llama("verify d+1=4 b8, hd64 gqa3", 8, 4, 9, 3, 64, "bfloat16"),
    _llama("verify d+1=4 b8, hd64 gqa3, fp32", 8, 4, 9, 3, 64, "float32"),
    _llama("prefill 256 b1, hd64 gqa3", 1, 256, 9, 3, 64, "bfloat16"),
    # Llama 3 8B: 32 query heads over 8 KV heads, head_dim 128
    _llama("decode b1, hd128 gqa4", 1, 1, 32, 8, 128, "bfloat16"),
    _llama("decode b32, hd128 gqa4", 32, 1, 32, 8, 128, "bfloat16"),
    _llama("verify d+1=4 b8, hd128 gqa4", 8, 4, 32, 8, 128, "bfloat16"),
    # T5 decoder: multi-head (group 1), head_dim 64, unscaled scores plus the relative-position bias
    _llama("T5 decode b8 with bias", 8, 1, 8, 8, 64, "bfloat16", scale=1.0, bias=T5_BIAS),
    _llama("T5 verify d+1=4 b8 with bias, fp32", 8, 4, 8, 8, 64, "float32", scale=1.0, bias=T5_BIAS),
)


def triton_type(value) -> str:
    """The Triton type jax-triton gives a scalar argument (jax_triton.triton_lib.get_triton_type)."""
    if isinstance(value, bool):
        return "B"
    if isinstance(value, (int, np.integer)):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, np.float32):
        return "fp32"
    if isinstance(value, float):
        return "fp64"
    raise TypeError(f"no Triton type for {value!r}")


_TRITON_DTYPES = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}


def kernel_signature(plan: LaunchPlan, dtype) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) of `_paged_attention_kernel` as jax-triton compiles the
    launch: arrays are 16-byte aligned pointers, scalars typed by `triton_type`, integer scalars
    equal to 1 become constants, and the plan's constexprs are constants."""
    params = list(inspect.signature(_paged_attention_kernel).parameters)
    cache = "*" + _TRITON_DTYPES[jnp.dtype(dtype).name]
    arrays = dict(
        q_ptr=cache,
        k_ptr=cache,
        v_ptr=cache,
        layer_ptr="*i32",
        table_ptr="*i32",
        qpos_ptr="*i32",
        kvlen_ptr="*i32",
        bias_ptr="*fp32",
        out_ptr="*" + _TRITON_DTYPES[plan.out_dtype],
        m_ptr="*fp32",
        l_ptr="*fp32",
    )
    scalar_names = [p for p in params if p not in arrays and p not in plan.constexprs]
    if len(scalar_names) != len(plan.scalars):
        raise AssertionError(f"the plan has {len(plan.scalars)} scalars, the kernel takes {len(scalar_names)}")
    scalars = dict(zip(scalar_names, plan.scalars))
    constexprs = dict(plan.constexprs)
    constexprs.update({n: 1 for n, v in scalars.items() if triton_type(v).startswith("i") and v == 1})
    signature = {p: "constexpr" if p in constexprs else arrays.get(p) or triton_type(scalars[p]) for p in params}
    attrs = {(params.index(p),): [["tt.divisibility", 16]] for p in arrays}
    return signature, {(params.index(p),): v for p, v in constexprs.items()}, attrs


@dataclasses.dataclass(frozen=True)
class KernelBuild:
    """One launch compiled for one target, with what ptxas reports about it."""

    launch: str
    arch: int
    grid: tuple[int, int, int]
    block_m: int
    block_n: int
    shared_bytes: int  # Triton's dynamic shared memory
    registers: int  # per thread
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    seconds: float
    error: str = ""

    def problems(self) -> list[str]:
        """What does not fit the target (empty when the build is fine)."""
        if self.error:
            return [self.error]
        found = []
        if self.shared_bytes > SHARED_MEMORY[self.arch]:
            found.append(f"shared memory {self.shared_bytes} B > {SHARED_MEMORY[self.arch]} B")
        if self.registers > MAX_REGISTERS or self.registers * NUM_WARPS * 32 > REGISTER_FILE:
            found.append(f"{self.registers} registers per thread do not fit {NUM_WARPS} warps")
        if self.spill_stores + self.spill_loads > SPILL_ALLOWED:
            found.append(f"register spills: {self.spill_stores} B stored, {self.spill_loads} B loaded")
        return found


def ptxas_report(ptx: str, arch: int) -> dict[str, int]:
    """Registers, spill bytes and static shared memory of `ptx`, from the ptxas Triton ships."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as src:
        src.write(ptx)
        src.flush()
        done = subprocess.run(
            [
                get_ptxas(arch).path,
                "-v",
                f"--gpu-name={sm_arch_from_capability(arch)}",
                src.name,
                "-o",
                src.name + ".cubin",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
    log = done.stderr + done.stdout

    def number(pattern):
        found = re.search(pattern, log)
        return int(found.group(1)) if found else 0

    return dict(
        registers=number(r"Used (\d+) registers"),
        spill_stores=number(r"(\d+) bytes spill stores"),
        spill_loads=number(r"(\d+) bytes spill loads"),
    )


def compile_launch(launch: Launch, arch: int) -> KernelBuild:
    """Compiles `launch` for sm_`arch` (80, 90) down to a cubin; a failure is recorded, not raised."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    plan = launch.plan()
    base = dict(
        launch=launch.name,
        arch=arch,
        grid=plan.grid,
        block_m=plan.constexprs["BLOCK_M"],
        block_n=plan.constexprs["BLOCK_N"],
    )
    start = time.perf_counter()
    try:
        signature, constexprs, attrs = kernel_signature(plan, launch.dtype)
        source = ASTSource(fn=_kernel(interpret=False), signature=signature, constexprs=constexprs, attrs=attrs)
        built = triton.compile(
            source, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=NUM_WARPS, num_stages=NUM_STAGES)
        )
        report = ptxas_report(built.asm["ptx"], arch)
    except Exception as e:  # noqa: BLE001 - every failure is reported, per launch
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return KernelBuild(
            **base,
            shared_bytes=0,
            registers=0,
            spill_stores=0,
            spill_loads=0,
            seconds=time.perf_counter() - start,
            error=f"{type(e).__name__}: {first_line}",
        )
    return KernelBuild(**base, shared_bytes=built.metadata.shared, seconds=time.perf_counter() - start, **report)


@dataclasses.dataclass(frozen=True)
class LinearLaunch:
    """One `triton_linear.fused_linear` configuration: rows of x [rows, k] against w [k, n] (or
    [n, k] `transposed`: a tied head) of `dtype`, with the norm, the gated pair or the residual
    fused in."""

    name: str
    rows: int
    k: int
    ns: tuple[int, ...]  # one to three matrices' columns
    dtype: str
    norm: bool = False
    gated: bool = False
    residual: bool = False
    transposed: bool = False
    head_dim: int = 0  # the rotation fused in (q and k), per head of this many columns
    cache_shape: tuple[int, ...] | None = None  # k and v written into this paged cache


def _linears(dtype: str) -> list[LinearLaunch]:
    """SmolLM2-135M's decode-layer products and its tied head (D 576, F 1536, vocabulary 49152) at
    1 and 64 rows."""
    short = "bf16" if dtype == "bfloat16" else "fp32"
    found = []
    for rows in (1, 64):
        found += [
            LinearLaunch(f"linear norm+qkv {short} x{rows}", rows, 576, (576, 192, 192), dtype, norm=True),
            LinearLaunch(
                f"linear norm+qkv+rope {short} x{rows}", rows, 576, (576, 192, 192), dtype, norm=True, head_dim=64
            ),
            LinearLaunch(
                f"linear norm+qkv+rope+cache {short} x{rows}",
                rows,
                576,
                (576, 192, 192),
                dtype,
                norm=True,
                head_dim=64,
                cache_shape=(30, 3, 1025, 16, 64),
            ),  # fmt: skip
            LinearLaunch(f"linear o+residual {short} x{rows}", rows, 576, (576,), dtype, residual=True),
            LinearLaunch(f"linear norm+gate/up {short} x{rows}", rows, 576, (1536,), dtype, norm=True, gated=True),
            LinearLaunch(f"linear down+residual {short} x{rows}", rows, 1536, (576,), dtype, residual=True),
            LinearLaunch(
                f"linear norm+tied head {short} x{rows}", rows, 576, (49152,), dtype, norm=True, transposed=True
            ),  # fmt: skip
        ]
    return found


LINEAR_LAUNCHES = _linears("float32") + _linears("bfloat16")


def compile_linear(launch: LinearLaunch, arch: int) -> KernelBuild:
    """`compile_launch` for a `LinearLaunch`: arrays 16-byte aligned pointers (x, the norm's
    weight, the residual, the rotary tables and y float32; w, w_up and the cache of the launch's
    dtype; pages, slots and the layer int32), M, K, N and the cache's strides as i32, eps fp32."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from eejax.kernels import triton_linear

    plan = triton_linear.plan_linear(
        launch.rows, launch.k, launch.ns, norm=launch.norm, gated=launch.gated, residual=launch.residual,
        upcast=False, eps=1e-5, weight_bytes=jnp.dtype(launch.dtype).itemsize, transposed=launch.transposed,
        head_dim=launch.head_dim, cache_shape=launch.cache_shape,
    )  # fmt: skip
    base = dict(
        launch=launch.name,
        arch=arch,
        grid=(*plan.grid, 1),
        block_m=triton_linear.BLOCK_M,
        block_n=plan.constexprs["BLOCK_N"],
    )
    start = time.perf_counter()
    try:
        params = list(inspect.signature(triton_linear._fused_linear_kernel).parameters)
        weights = "*" + _TRITON_DTYPES[launch.dtype]
        arrays = dict(x_ptr="*fp32", g_ptr="*fp32", w_ptr=weights, w2_ptr=weights, w3_ptr=weights, u_ptr=weights,
                      r_ptr="*fp32", cos_ptr="*fp32", sin_ptr="*fp32", kc_ptr=weights, vc_ptr=weights,
                      page_ptr="*i32", slot_ptr="*i32", layer_ptr="*i32", y_ptr="*fp32", y2_ptr="*fp32",
                      y3_ptr="*fp32", kc_out_ptr=weights, vc_out_ptr=weights)  # fmt: skip
        scalar_names = ("M", "K", "N", "N2", "N3", "eps", "stride_cl", "stride_ch", "stride_cp", "stride_cs")
        values = dict(zip(scalar_names, plan.scalars))
        known = dict(plan.constexprs)  # and, as jax-triton specialises them, integer scalars equal to 1
        known.update({n: 1 for n, v in values.items() if triton_type(v).startswith("i") and v == 1})
        signature = {p: "constexpr" if p in known else arrays.get(p) or triton_type(values[p]) for p in params}
        constexprs = {(params.index(p),): v for p, v in known.items()}
        attrs = {(params.index(p),): [["tt.divisibility", 16]] for p in arrays}
        source = ASTSource(
            fn=triton_linear._kernel(interpret=False), signature=signature, constexprs=constexprs, attrs=attrs
        )
        options = dict(num_warps=triton_linear.NUM_WARPS, num_stages=triton_linear.NUM_STAGES)
        built = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
        report = ptxas_report(built.asm["ptx"], arch)
    except Exception as e:  # noqa: BLE001 - every failure is reported, per launch
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return KernelBuild(**base, shared_bytes=0, registers=0, spill_stores=0, spill_loads=0,
                           seconds=time.perf_counter() - start, error=f"{type(e).__name__}: {first_line}")  # fmt: skip
    return KernelBuild(**base, shared_bytes=built.metadata.shared, seconds=time.perf_counter() - start, **report)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m eejax.kernels.aot",
        description="Compile every Triton attention and fused-product launch eejax makes for real GPUs (no GPU "
        "needed) and check that registers and shared memory fit.",
    )
    parser.add_argument("--targets", default="80,90", help="compute capabilities, comma-separated (default 80,90)")
    parser.add_argument("--json", action="store_true", help="one JSON object per build instead of a table")
    args = parser.parse_args(argv)
    try:
        targets = [int(t) for t in args.targets.split(",")]
    except ValueError:
        parser.error(f"--targets takes comma-separated compute capabilities such as 80,90, got {args.targets!r}")
    unknown = sorted(set(targets) - set(SHARED_MEMORY))
    if unknown:
        parser.error(f"no limits known for sm_{unknown[0]}; known: {', '.join(f'sm_{a}' for a in SHARED_MEMORY)}")
    if not args.json:
        print(f"{'launch':40} {'arch':>5} {'grid':>14} {'M x N':>7} {'smem B':>7} {'regs':>5} {'spill':>6} {'s':>5}")
    failed = 0
    for launch in [*LAUNCHES, *LINEAR_LAUNCHES]:
        for arch in targets:
            build = compile_launch(launch, arch) if isinstance(launch, Launch) else compile_linear(launch, arch)
            problems = build.problems()
            failed += bool(problems)
            if args.json:
                print(json.dumps(dict(dataclasses.asdict(build), problems=problems)), flush=True)
            else:
                print(
                    f"{build.launch:40} sm_{arch:<2} {str(build.grid):>14} {build.block_m:>3}x{build.block_n:<3} "
                    f"{build.shared_bytes:>7} {build.registers:>5} {build.spill_stores + build.spill_loads:>6} "
                    f"{build.seconds:>5.1f}  {'; '.join(problems) or 'ok'}",
                    flush=True,
                )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
