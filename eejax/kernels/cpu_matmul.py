"""Few-row products on a CPU, streamed by every core: eejax's own kernel
(`cpu_matmul.cc`, an XLA FFI custom call) in place of XLA:CPU's.

Why. A decode step of a small batch is a chain of products of a few rows by a weight matrix, and
its time is the time to read the weights. XLA:CPU computes a one-row product mostly on one core,
which streams ~22 GB/s on this 2-core EPYC while both cores read 30-43 GB/s; the kernel splits
each weight between the threads of XLA's own intra-op pool (docs/benchmarks.md, the decode profile).

When. `matmul` / `matmul_t` use it at trace time when all of these hold: the process's backend is
the CPU, no mesh is in context (a custom call is not partitioned), x and w are float32 or
bfloat16, x has at most `MAX_CALLED_ROWS` rows (`MAX_ROWS` a call: a batch's verify pass runs
several), $EEJAX_CPU_MATMUL is not off, and the library builds.
Otherwise they are `jnp.matmul` / `einsum`, as before. x is widened to float32; bf16 weights are
widened as they are read, so a bf16 step reads half the bytes (XLA:CPU's one-row bf16 product
converts the whole weight to an fp32 copy first). The library is built at first use with the
machine's C++ compiler against jaxlib's FFI headers (`g++ -O3 -march=native`, ~15 s on 2 cores;
`build_soon` starts it while a model is read) into `$EEJAX_CACHE/kernels/`, named by a hash of
the source, jaxlib's version and the CPU's flags; without a compiler it is logged once and XLA's
product is used. Each output row is computed the same way whatever the number of rows, so a
verify pass and a decode step agree bit for bit. Gradients (training) go through jnp (`jax.custom_vjp`).

Quantized weights (`quantized.QuantizedMatrix`: GGUF's Q4_0 / Q4_1 / Q8_0 blocks, int8 per
channel) are multiplied by `rows_product` (`rows_products`: several matrices that share x in one
call): the kernel reads the blocks' bytes (0.56-1.06 per weight) instead of a float copy, taking x
as float32 (each block dequantised in registers exactly as a dequantising conversion does) or
rounded to int16 / int8 per block (`quantized.ACTIVATIONS`). Above `MAX_QUANTIZED_ROWS` rows (a
prefill) integer activations take the kernel's GEMM where the CPU has AVX-512 VNNI
(`panel_products`: int16 multiply-adds, ~2x a float32 GEMM's per cycle); otherwise the library
dequantises the rows and XLA multiplies them. Off the CPU jnp dequantises them (on a GPU XLA fuses
the dequantisation into the dot's operand).

The library also copies rows of a bf16 table (`take_rows`, the token embedding of a bf16 model),
which XLA:CPU gathers by converting the whole table to float32 first.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eejax import quantized
from eejax.compile_cache import switched_on
from eejax.kernels.backend import backend
from eejax.quantized import QuantizedMatrix, dequantize_rows

MAX_ROWS = 8  # the kernel's limit (kMaxRows) for one call
MAX_CALLED_ROWS = 64  # up to here a product runs the kernel on each MAX_ROWS rows in turn; more is a GEMM, XLA's
SOURCE = Path(__file__).with_suffix(".cc")
SOURCES = tuple(
    SOURCE.with_name(n)
    for n in (
        "cpu_matmul.cc",
        "cpu_quantized.cc",
        "cpu_attention.cc",
        "cpu_elementwise.cc",
        "cpu_layer.cc",
        "cpu_parts.h",
        "cpu_kernels.h",
    )
)
# Their bits must not depend on the compiler's fusing.
SOURCE_FLAGS = {"cpu_elementwise.cc": ["-ffp-contract=off"], "cpu_layer.cc": ["-ffp-contract=off"]}
TARGETS = {  # XLA's name for a handler -> its symbol in the library
    "eejax_matmul_nn": "EejaxMatmulNN",
    "eejax_matmul_nt": "EejaxMatmulNT",
    "eejax_matmul_nn_bf16": "EejaxMatmulNNBf16",
    "eejax_matmul_nt_bf16": "EejaxMatmulNTBf16",
    "eejax_take_rows_bf16": "EejaxTakeRowsBf16",
    "eejax_paged_attention": "EejaxPagedAttention",  # cpu_attention.py
    "eejax_rms_norm": "EejaxRmsNorm",  # cpu_elementwise.py
    "eejax_rope": "EejaxRope",
    "eejax_rope_tables": "EejaxRopeTables",
    "eejax_silu_mul": "EejaxSiluMul",
    "eejax_argmax": "EejaxArgmax",
    "eejax_cpu_layer": "EejaxCpuLayer",  # cpu_layer.py
    **{
        f"eejax_quantized_{f}_{a}": f"EejaxQuantized{f.capitalize()}{suffix}"
        for f in quantized.FORMATS
        for a, suffix in (("float32", "F32"), ("int8", "Q8"), ("int16", "Q16"))
    },
    **{f"eejax_dequantize_{f}": f"EejaxDequantize{f.capitalize()}" for f in quantized.FORMATS},
}
MAX_QUANTIZED_ROWS = 64  # more rows (a prefill): the GEMM (integer x, AVX-512 VNNI) or XLA's of dequantised rows
MAX_FUSED = 8  # matrices one quantized call takes (cpu_quantized.cc's kMaxMatrices)
WEIGHT_DTYPES = (jnp.float32, jnp.bfloat16)
log = logging.getLogger(__name__)


def enabled(environ=os.environ) -> bool:
    """$EEJAX_CPU_MATMUL: on unless "off", "none", "0" or "false"."""
    return switched_on("EEJAX_CPU_MATMUL", environ)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RowsMatrix:
    """A float Linear weight w [..., K, N] held as its rows, `rows` = w^T [..., N, K] (any stacked
    axes first): the "rows" layer layout (`eejax.Model.layout`). For a few rows XLA:GPU turns a
    product into a multiply and a sum over K; summed along the rows' last axis the multiply fuses
    into the sum, summed down w's columns XLA writes the whole multiply out first (4 bytes a
    weight, then read back: `benchmarks/gpu_kernels.py`)."""

    rows: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the weight it stands for, [..., K, N]."""
        return (*self.rows.shape[:-2], self.rows.shape[-1], self.rows.shape[-2])

    @property
    def dtype(self):
        return self.rows.dtype


def matmul(x, w):
    """x [..., K] @ w [K, N] -> float32 [..., N] (float32 products and sums). A quantized w is a
    Linear's (its rows are the N outputs), as is a `RowsMatrix`."""
    if isinstance(w, QuantizedMatrix):
        assert w.transposed, "a quantized Linear weight keeps its outputs as rows"
        return rows_product(x, w)
    if isinstance(w, RowsMatrix):
        return matmul_t(x, w.rows)
    if _applies(x, w):
        return _in_calls(_kernel_nn, _rows(x), w).reshape(*x.shape[:-1], w.shape[1])
    return jnp.matmul(x, w, preferred_element_type=jnp.float32)


def matmul_t(x, w):
    """x [..., K] against the rows of w [N, K] -> float32 [..., N] (a head tied to the embedding:
    `w.T` is never formed)."""
    if isinstance(w, QuantizedMatrix):
        assert not w.transposed, "a quantized table keeps its N rows"
        return rows_product(x, w)
    if _applies(x, w):
        return _in_calls(_kernel_nt, _rows(x), w).reshape(*x.shape[:-1], w.shape[0])
    return jnp.einsum("...d,vd->...v", x, w, preferred_element_type=jnp.float32)


def take_rows(table, tokens):
    """table [V, D][tokens] -> [*tokens.shape, D] (indices as jnp indexing reads them: from the
    end when negative, clamped in the forward pass, no gradient outside the table). A
    bf16 table on one CPU device is read by the library's row copy: XLA:CPU converts all of a
    bf16 table to float32 to gather from it (113 MB read and 226 MB written per SmolLM2 bf16
    decode step), and does so for a dynamic slice per row and through a uint16 view too. A
    quantized table dequantises the rows it gives (float32)."""
    if isinstance(table, QuantizedMatrix):
        return quantized.take_rows(table, tokens)
    if not _applies_to_table(table, tokens):
        return table[tokens]
    ids = tokens.reshape(-1).astype(jnp.int32)
    ids = jnp.where(ids < 0, ids + table.shape[0], ids)  # from the end, as jnp reads them
    return _take_rows(table, ids).reshape(*tokens.shape, table.shape[1])


def rows_product(x, w: QuantizedMatrix):
    """x [..., K] against the rows of a quantized matrix (R rows of K) -> float32 [..., R]:
    x @ dequantize_rows(w).T, up to summation order. Inference only (no gradient)."""
    return rows_products(x, [w])[0]


def rows_products(x, ws) -> list:
    """x [..., K] against each quantized matrix in `ws` (`rows_product` of each): on a CPU, for a
    few rows, one kernel call for matrices of one format and activations (x quantized once, all
    their rows split between the threads: a layer's q, k and v, or its gate and up)."""
    rows = 1
    for n in x.shape[:-1]:
        rows *= n
    first = ws[0]
    same = ("format", "activations", "cols", "tiled")
    fused = all(getattr(w, k) == getattr(first, k) for w in ws for k in same)
    # A prefill's rows of integer x go to the GEMM however few they are: a prompt's rows then get
    # the same bits alone, in a batch or in chunks (the few-row loops sum a row in another order).
    gemm = (rows > MAX_QUANTIZED_ROWS or first.prompt) and first.activations != "float32" and panel_products()
    kernel = (0 < rows <= MAX_QUANTIZED_ROWS or gemm) and first.cols % 32 == 0 and all(w.qs.ndim == 3 for w in ws)
    if fused and kernel and len(ws) <= MAX_FUSED and library_applies():
        outs = [jax.ShapeDtypeStruct((rows, w.rows), jnp.float32) for w in ws]
        buffers = []
        for w in ws:
            buffers += [w.qs, w.scales, w.mins if w.mins is not None else jnp.zeros((0,), jnp.float16)]
        target = f"eejax_quantized_{first.format}_{first.activations}"
        call = jax.ffi.ffi_call(target, outs, vmap_method="sequential")
        ys = call(_rows(x), *buffers, gemm=np.bool_(gemm), tiled=np.bool_(first.tiled))
        return [y.reshape(*x.shape[:-1], w.rows) for y, w in zip(ys, ws)]
    if len(ws) > 1:
        return [y for w in ws for y in rows_products(x, [w])]
    dequantized = _dequantize(first)
    if first.activations != "float32" and first.cols % 32 == 0:
        return [quantized.integer_activation_product(x, first, dequantized)]
    x = x.astype(jnp.float32)
    return [jnp.einsum("...k,rk->...r", x, dequantized, preferred_element_type=jnp.float32)]


def _dequantize(w: QuantizedMatrix):
    """w's rows [..., R, K] as float32, `quantized.dequantize_rows`'s values: on a CPU the
    library's loop (~7x faster than XLA's fusion of the same ops; a prefill's products run
    XLA's GEMM over them)."""
    w = quantized.untile(w)
    if w.qs.ndim != 3 or w.cols % 32 or not library_applies():
        return dequantize_rows(w)
    out = jax.ShapeDtypeStruct((w.rows, w.cols), jnp.float32)
    mins = w.mins if w.mins is not None else jnp.zeros((0,), jnp.float16)
    return jax.ffi.ffi_call(f"eejax_dequantize_{w.format}", out, vmap_method="sequential")(w.qs, w.scales, mins)


def matmuls(x, ws) -> list:
    """[matmul(x, w) for w in ws], quantized Linear weights in one call where `rows_products` can."""
    if all(isinstance(w, QuantizedMatrix) and w.transposed for w in ws):
        return rows_products(x, ws)
    return [matmul(x, w) for w in ws]


def _applies_to_table(table, tokens) -> bool:
    return table.dtype == jnp.bfloat16 and table.ndim == 2 and tokens.size > 0 and library_applies()


@functools.cache
def panel_products() -> bool:
    """Whether the kernel multiplies a prefill's rows with integer activations itself: its GEMM is
    built where this CPU has AVX-512 VNNI (`-march=native` compiles for its flags)."""
    return {"avx512f", "avx512bw", "avx512_vnni"} <= set(_cpu_flags().split())


def tiled_loop_runs() -> bool:
    """Whether the kernel's tiled loop runs here: a CPU with AVX-512 VNNI, the library built and on."""
    return backend() == "cpu" and enabled() and available() and panel_products()


def tiled_for_kernel(params):
    """params with each 4-bit matrix that `quantized.tileable` allows kept in tiles of 16 rows, where
    the kernel's tiled loop runs (AVX-512 VNNI, the library built): its products then sum a row in
    the prefill GEMM's order at every number of rows, 1.4-2.2x faster than the few-row loops on the
    GGUF's rows. Elsewhere params as they are."""
    if not tiled_loop_runs():
        return params
    return jax.tree.map(
        lambda x: quantized.tile(x) if quantized.is_quantized(x) else x, params, is_leaf=quantized.is_quantized
    )


def library_applies() -> bool:
    """The conditions every use shares: one CPU device, the switch on, the library built."""
    return backend() == "cpu" and jax.sharding.get_abstract_mesh().empty and enabled() and available()


@jax.custom_vjp
def _take_rows(table, ids):
    out = jax.ShapeDtypeStruct((ids.shape[0], table.shape[1]), table.dtype)
    return jax.ffi.ffi_call("eejax_take_rows_bf16", out, vmap_method="sequential")(table, ids)


def _take_fwd(table, ids):
    return _take_rows(table, ids), (table, ids)


def _take_bwd(res, g):
    table, ids = res
    # as jnp's gather: an index outside the table reads a clamped row and gets no gradient
    outside = (ids < 0) | (ids >= table.shape[0])
    ids = jnp.where(outside, table.shape[0], ids)
    return jnp.zeros_like(table).at[ids].add(g.astype(table.dtype), mode="drop"), None


_take_rows.defvjp(_take_fwd, _take_bwd)


def _rows(x):
    """x [..., K] as float32 rows [M, K] (a bf16 value is exact in float32)."""
    return x.reshape(-1, x.shape[-1]).astype(jnp.float32)


def _in_calls(kernel, x, w):
    """kernel(x, w) for x [M, K] of up to `MAX_CALLED_ROWS` rows, MAX_ROWS rows a call: each row's
    sums run in the kernel's one order, so a verify pass of a batch (8 rows x 5 positions) gives
    each row the bits it gets alone."""
    calls = [kernel(x[i : i + MAX_ROWS], w) for i in range(0, x.shape[0], MAX_ROWS)]
    return calls[0] if len(calls) == 1 else jnp.concatenate(calls)


def _applies(x, w) -> bool:
    rows = 1
    for n in x.shape[:-1]:
        rows *= n
    return (
        0 < rows <= MAX_CALLED_ROWS
        and x.dtype in WEIGHT_DTYPES
        and w.dtype in WEIGHT_DTYPES
        and w.ndim == 2
        and library_applies()
    )


def _call(target: str, x, w, n: int):
    name = target + ("_bf16" if w.dtype == jnp.bfloat16 else "")
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    return jax.ffi.ffi_call(name, out, vmap_method="sequential")(x, w)


@jax.custom_vjp
def _kernel_nn(x, w):
    return _call("eejax_matmul_nn", x, w, w.shape[1])


@jax.custom_vjp
def _kernel_nt(x, w):
    return _call("eejax_matmul_nt", x, w, w.shape[0])


def _nn_fwd(x, w):
    return _kernel_nn(x, w), (x, w)


def _nn_bwd(res, g):
    x, w = res
    return g @ w.T.astype(g.dtype), (x.T @ g).astype(w.dtype)


def _nt_fwd(x, w):
    return _kernel_nt(x, w), (x, w)


def _nt_bwd(res, g):
    x, w = res
    return g @ w.astype(g.dtype), (g.T @ x).astype(w.dtype)


_kernel_nn.defvjp(_nn_fwd, _nn_bwd)
_kernel_nt.defvjp(_nt_fwd, _nt_bwd)


@functools.cache
def available() -> bool:
    """Whether the kernel library is built (or builds now) and its targets are registered with
    XLA; False, said once in the log, where it cannot be (no compiler, a failed build)."""
    try:
        library = ctypes.cdll.LoadLibrary(str(build()))
    except (OSError, subprocess.CalledProcessError, FileNotFoundError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("eejax's CPU matmul kernel is not available, XLA's products are used: %s", str(detail)[-500:])
        return False
    for name, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    return True


_BUILDING = threading.Lock()  # one build at a time in this process (`build_soon`'s thread and a caller)


def build(directory: Path | None = None) -> Path:
    """The kernel library's path, compiled first if it is not there: each source in its own
    compiler process, side by side (on 2 cores ~15 s instead of ~30 s in one), then linked.
    Raises FileNotFoundError without a C++ compiler ($CXX, else g++ or c++) and
    CalledProcessError when compiling fails."""
    path = library_path(directory)
    if path.exists():
        return path
    directory = path.parent
    with _BUILDING:
        if path.exists():  # built by `build_soon` while this call waited
            return path
        compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
        if not compiler:
            raise FileNotFoundError("no C++ compiler (set $CXX, or install g++)")
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory) as tmp:  # built aside, then renamed: never half-written
            out = Path(tmp) / path.name
            sources = [s for s in SOURCES if s.suffix == ".cc"]
            objects = [Path(tmp) / f"{s.stem}.o" for s in sources]
            flags = [*_flags(), "-I", jax.ffi.include_dir(), "-c"]
            commands = [
                [compiler, *flags, *SOURCE_FLAGS.get(s.name, []), str(s), "-o", str(o)]
                for s, o in zip(sources, objects)
            ]
            _run_side_by_side(commands)
            subprocess.run([compiler, "-shared", *map(str, objects), "-o", str(out)], check=True, capture_output=True)
            os.replace(out, path)
    log.info("built eejax's CPU matmul kernel: %s", path)
    return path


def _run_side_by_side(commands: list[list[str]]) -> None:
    """Runs the commands at once; raises the first failure's CalledProcessError once all ended."""
    running = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in commands]
    failures = []
    for proc in running:
        stdout, stderr = proc.communicate()
        if proc.returncode:
            failures.append(subprocess.CalledProcessError(proc.returncode, proc.args, stdout, stderr))
    if failures:
        raise failures[0]


def build_soon() -> threading.Thread | None:
    """Starts building the kernel library in a background thread where this process would use it
    and it is not built yet (None otherwise), so a caller about to read and convert a model
    overlaps the compilation with that work; `build` (first use) then waits for it. A failure is
    left for that first use to log."""
    if not (enabled() and jax.default_backend() == "cpu") or library_path().exists():
        return None

    def quietly() -> None:
        try:
            build()
        except (OSError, subprocess.CalledProcessError):
            return  # not said here: the first use (`available`) builds again and logs why it cannot

    thread = threading.Thread(target=quietly, name="eejax-kernel-build", daemon=True)
    thread.start()
    return thread


def library_path(directory: Path | None = None) -> Path:
    """Where the kernel library for this source, jaxlib and CPU is (or will be) built."""
    directory = directory or Path(os.environ.get("EEJAX_CACHE") or Path.home() / ".cache" / "eejax") / "kernels"
    return directory / f"cpu_matmul-{_build_key()}.so"


def _flags() -> list[str]:
    return ["-O3", "-march=native", "-std=c++20", "-fPIC", "-w"]


def _build_key() -> str:
    import jaxlib

    digest = hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES))
    digest.update(
        " ".join([jaxlib.__version__, platform.machine(), *_flags(), _cpu_flags(), str(SOURCE_FLAGS)]).encode()
    )
    return digest.hexdigest()[:16]


def _cpu_flags() -> str:
    """The CPU's feature flags (-march=native compiles for them), so that a cache directory
    shared between machines never hands one a library built for another's instructions."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:  # not Linux: the processor's name is the best there is
        lines = []
    return next((line for line in lines if line.startswith(("flags", "Features"))), platform.processor())
