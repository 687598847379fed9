"""Quantized weight matrices kept as their blocks (`QuantizedMatrix`, a pytree that stands in a
params tree where a float matrix would): making them, dequantising them, saving them. Products by
them are `kernels.cpu_matmul.rows_product`'s (eejax's CPU kernel for a few rows, XLA's product of
the dequantised weights otherwise).

A matrix is stored as GGUF stores it: `rows` output rows of `cols` weights each, every row cut into
blocks along `cols`, each block its quantized values, its scale (and, Q4_1, its minimum):

    format  block  qs                          scales            mins         w[r, c]
    q4_0    32     uint8 [..., R, C/32, 16]    f16 [..., R, C/32]    -        d * (q - 8)
    q4_1    32     uint8 [..., R, C/32, 16]    f16 [..., R, C/32]    f16 (m)  d * q + m
    q8_0    32     int8  [..., R, C/32, 32]    f16 [..., R, C/32]    -        d * q
    int8    C      int8  [..., R, 1, C]        f32 [..., R, 1]       -        s * q   (per output channel)

(a q4 byte j of a block holds value j in its low nibble and value j + 16 in its high one). Leading
axes are a stack's layers. `dequantize` gives the float32 weights that a dequantising conversion
(gguf-py's, transformers') makes, bit for bit, so the model converted to float32 today is the
exact reference of its blocks: a product over the blocks equals the float32 product up to
summation order.

Where the CPU kernel's tiled loop runs, a q4_0, q4_1 or q8_0 matrix whose products take integer x
(a Linear weight, or a table and the head tied to it) is kept in tiles of 16 rows (`tile`,
`QuantizedMatrix.tiled`): the same arrays and shapes, its values permuted within each tile so that
one vector holds a byte of each row. Whatever reads the values as rows untiles first (`untile`),
or gathers the rows it needs from their tiles (`rows_at`: a table's tokens).

How a product treats x (`activations`, static, so it keys the compiled programs): "float32"
multiplies float x by the dequantised blocks (equal to the float32 model's product up to
summation order); "int8" is llama.cpp's method: x is quantized to int8 per block of 32 values (its
own scale, max |x| / 127), each block's products are summed in integers and scaled once, and a
Q4_1 minimum multiplies the float sum of x's block; "int16" is the same with x rounded to 16 bits
(max |x| / 32767), 256x finer (`integer_activation_product` is their jnp equal). On a CPU integer
products take 2-3x fewer instructions per block than float ones. `prompt_activations` (static,
None: the same) is how a prefill's products take x (`for_prompts`): a prompt's many rows are a
GEMM, where int16 runs ~2x float32's multiply-adds per cycle on a CPU with AVX-512 VNNI, while
decode steps and verify passes keep `activations` (float32: speculation exact).

Which matrix it stands for. A Linear's weight is [D_in, features] in eejax's x @ W layout; kept
quantized it is its transpose's blocks (`transposed=True`: rows are the outputs, blocks run along
D_in), as in GGUF. The token embedding [V, D] is kept as it is (`transposed=False`): its rows are
tokens, and the tied LM head multiplies by the same rows. Either way a product is x against the
rows: `rows_product(x, w)` = x @ dequantize(w).T.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

FORMATS = ("q4_0", "q4_1", "q8_0", "int8")
BLOCK = 32  # the GGUF formats' block length
SCALE_DTYPES = {"q4_0": np.float16, "q4_1": np.float16, "q8_0": np.float16, "int8": np.float32}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedMatrix:
    """A weight matrix kept as quantized blocks (see the module docstring): `qs`, `scales`, `mins`
    (Q4_1 only, else None); `format` and `transposed` are static. `shape` is the matrix it stands
    for (a Linear's [D_in, features], an embedding's [V, D]), with any stacked axes first."""

    qs: jax.Array
    scales: jax.Array
    mins: jax.Array | None = None
    format: str = dataclasses.field(default="q8_0", metadata=dict(static=True))
    transposed: bool = dataclasses.field(default=False, metadata=dict(static=True))
    activations: str = dataclasses.field(default="float32", metadata=dict(static=True))
    prompt_activations: str | None = dataclasses.field(default=None, metadata=dict(static=True))
    prompt: bool = dataclasses.field(default=False, metadata=dict(static=True))  # a prefill's (`for_prompts`)
    tiled: bool = dataclasses.field(default=False, metadata=dict(static=True))  # rows in tiles of 16 (`tile`)

    @property
    def rows(self) -> int:
        return self.qs.shape[-3]

    @property
    def cols(self) -> int:
        blocks, width = self.qs.shape[-2:]
        return blocks * width * (2 if self.format.startswith("q4") else 1)

    @property
    def shape(self) -> tuple[int, ...]:
        lead = tuple(self.qs.shape[:-3])
        return (*lead, self.cols, self.rows) if self.transposed else (*lead, self.rows, self.cols)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """The bytes a product reads: values, scales and minimums."""
        return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in self.arrays())

    def arrays(self) -> tuple:
        return (self.qs, self.scales) if self.mins is None else (self.qs, self.scales, self.mins)


def is_quantized(x) -> bool:
    return isinstance(x, QuantizedMatrix)


def float_dtype(params):
    """The dtype of params' first float array outside quantized matrices (the model's activations'
    and its KV cache's: a quantized model's norms), float32 if there is none."""
    for x in jax.tree.leaves(params, is_leaf=is_quantized):
        if not is_quantized(x) and jnp.issubdtype(x.dtype, jnp.floating):  # bfloat16 included
            return jnp.dtype(x.dtype)
    return jnp.dtype(jnp.float32)


def formats(params) -> set[str]:
    """The block formats of params' quantized matrices (empty for a float model)."""
    return {x.format for x in jax.tree.leaves(params, is_leaf=is_quantized) if is_quantized(x)}


def dequantize_rows(w: QuantizedMatrix):
    """The rows [..., R, C] as float32 (jnp; numpy arrays work too)."""
    w = untile(w)
    qs = jnp.asarray(w.qs)
    scale = jnp.asarray(w.scales).astype(jnp.float32)[..., None]
    if w.format.startswith("q4"):
        q = jnp.concatenate([qs & 15, qs >> 4], axis=-1).astype(jnp.float32)  # [..., R, C/32, 32]
        if w.format == "q4_0":
            values = scale * (q - 8.0)
        else:
            values = scale * q + jnp.asarray(w.mins).astype(jnp.float32)[..., None]
    else:
        values = scale * qs.astype(jnp.float32)
    return values.reshape(*values.shape[:-2], -1)


def dequantize(w: QuantizedMatrix):
    """The matrix `w` stands for, float32 (a Linear's [..., D_in, features])."""
    rows = dequantize_rows(w)
    return jnp.swapaxes(rows, -1, -2) if w.transposed else rows


def take_rows(w: QuantizedMatrix, tokens):
    """Rows of a quantized table [V, D] (not transposed) at `tokens` -> float32 [*tokens.shape, D]:
    only the rows taken are dequantised."""
    return dequantize_rows(rows_at(w, tokens.reshape(-1))).reshape(*tokens.shape, w.cols)


def rows_at(w: QuantizedMatrix, ids) -> QuantizedMatrix:
    """w's rows at `ids` [N] (one matrix, no stacked axes) as an untiled matrix of N rows: a tiled
    matrix's rows are gathered from their tiles (the whole matrix is not untiled)."""
    if not w.tiled:
        return dataclasses.replace(w, qs=w.qs[ids], scales=w.scales[ids], mins=None if w.mins is None else w.mins[ids])
    tile, lane = ids // TILE_ROWS, ids % TILE_ROWS
    nb, width = w.qs.shape[-2:]
    qs = w.qs.reshape(-1, nb, width // 4, TILE_ROWS, 4)[tile, :, :, lane]  # [N, NB, words, 4]

    def side_by_side(a):  # [T * 16, NB] as [T, NB, 16] -> [N, NB]
        return None if a is None else a.reshape(-1, nb, TILE_ROWS)[tile, :, lane]

    return dataclasses.replace(
        w, qs=qs.reshape(-1, nb, width), scales=side_by_side(w.scales), mins=side_by_side(w.mins), tiled=False
    )


ACTIVATIONS = ("float32", "int8", "int16")
LEVELS = {"int8": 127.0, "int16": 32767.0}  # the largest quantized |x| of a block


def with_activations(params, activations: str, prompt_activations: str | None = None):
    """params with every quantized matrix's products taking x as `activations` (ACTIVATIONS), and a
    prefill's as `prompt_activations` (None: as `activations`)."""
    for name, value in (("activations", activations), ("prompt_activations", prompt_activations)):
        if value is not None and value not in ACTIVATIONS:
            raise ValueError(f"{name} must be one of {', '.join(ACTIVATIONS)}, got {value!r}")
    if prompt_activations == activations:
        prompt_activations = None

    def take(x):
        x = dataclasses.replace(x, activations=activations, prompt_activations=prompt_activations)
        return x if tileable(x) else untile(x)

    return jax.tree.map(lambda x: take(x) if is_quantized(x) else x, params, is_leaf=is_quantized)


def for_prompts(params):
    """params as a prefill multiplies by them: each quantized matrix taking x as its
    `prompt_activations` where it has them, and marked `prompt` (a CPU multiplies a prompt's rows
    of integer x by its GEMM however few they are: `kernels.cpu_matmul.rows_products`)."""

    def prompt(x):
        activations = x.activations if x.prompt_activations is None else x.prompt_activations
        return dataclasses.replace(x, activations=activations, prompt_activations=None, prompt=True)

    return jax.tree.map(lambda x: prompt(x) if is_quantized(x) else x, params, is_leaf=is_quantized)


TILE_ROWS = 16  # weight rows a tile holds


def tileable(w: QuantizedMatrix) -> bool:
    """Whether w may be kept in tiles of 16 rows: a q4_0, q4_1 or q8_0 matrix of whole tiles whose
    products, prefills' included, take integer x (the CPU kernel's tiled loop and its GEMM)."""
    return (
        w.format in ("q4_0", "q4_1", "q8_0")
        and w.rows % TILE_ROWS == 0
        and w.activations in ("int8", "int16")
        and w.prompt_activations in (None, "int8", "int16")
    )


def tile(w: QuantizedMatrix) -> QuantizedMatrix:
    """w with its rows in tiles of 16 (`tileable`; else w as it is), for the CPU kernel's tiled loop:
    the same arrays and shapes, their values permuted within each tile. Per tile and block, `qs`
    holds a run of 16 four-byte words for each word of a row's block (4 for q4's 16 bytes, 8 for
    q8_0's 32), run k word n bytes 4k..4k+3 of row n's block (so that one vector holds a byte of
    each row); `scales` and `mins` hold the tile's 16 rows side by side. `untile` reverses it; a
    tiled matrix is untiled wherever its values are read as rows (`rows_at` gathers a few)."""
    if w.tiled or not tileable(w):
        return w
    lead, r, (nb, width) = w.qs.shape[:-3], w.rows, w.qs.shape[-2:]
    tiles = r // TILE_ROWS
    qs = w.qs.reshape(*lead, tiles, TILE_ROWS, nb, width // 4, 4)
    qs = _move(qs, (-4, -3, -2), (-2, -4, -3)).reshape(w.qs.shape)  # [.., T, NB, words, 16, 4]

    def side_by_side(a):  # [..., R, NB] -> [..., T, NB, 16]
        return None if a is None else _move(a.reshape(*lead, tiles, TILE_ROWS, nb), (-2,), (-1,)).reshape(a.shape)

    return dataclasses.replace(w, qs=qs, scales=side_by_side(w.scales), mins=side_by_side(w.mins), tiled=True)


def untile(w: QuantizedMatrix) -> QuantizedMatrix:
    """The inverse of `tile` (w as it is where it is not tiled)."""
    if not w.tiled:
        return w
    lead, r, (nb, width) = w.qs.shape[:-3], w.rows, w.qs.shape[-2:]
    tiles = r // TILE_ROWS
    qs = w.qs.reshape(*lead, tiles, nb, width // 4, TILE_ROWS, 4)
    qs = _move(qs, (-2, -4, -3), (-4, -3, -2)).reshape(w.qs.shape)

    def rows(a):
        return None if a is None else _move(a.reshape(*lead, tiles, nb, TILE_ROWS), (-1,), (-2,)).reshape(a.shape)

    return dataclasses.replace(w, qs=qs, scales=rows(w.scales), mins=rows(w.mins), tiled=False)


def _move(a, source, destination):
    """np.moveaxis for numpy arrays (a copy once reshaped), jnp's for jax arrays."""
    return (np if isinstance(a, np.ndarray) else jnp).moveaxis(a, source, destination)


def integer_activation_product(x, w: QuantizedMatrix, rows=None):
    """x [..., K] against w's rows as the kernel's integer activations (w.activations, "int8" or
    "int16") compute it (float32 [..., R]): x rounded per block of 32 (scale max |x| / LEVELS)
    times the dequantised weights, a Q4_1 minimum times x's exact block sums. `rows`: w's rows
    dequantised already (float32 [R, K]), else `dequantize_rows(w)`."""
    levels = LEVELS[w.activations]
    w = untile(w)  # the minimums are read as rows below
    x = x.astype(jnp.float32)
    blocks = x.reshape(*x.shape[:-1], -1, BLOCK)
    amax = jnp.abs(blocks).max(-1, keepdims=True)
    scale = amax / levels
    inverse = jnp.where(amax > 0, levels / jnp.where(amax > 0, amax, 1.0), 0.0)
    rounded = jnp.round(blocks * inverse) * scale
    rows = dequantize_rows(w) if rows is None else rows
    y = jnp.einsum("...k,rk->...r", rounded.reshape(x.shape), rows, preferred_element_type=jnp.float32)
    if w.format != "q4_1":
        return y
    # The rows hold the minimum m of each block: x's exact block sums take it, not the rounded ones.
    correction = blocks.sum(-1) - rounded.sum(-1)  # [..., K/32]
    return y + jnp.einsum("...b,rb->...r", correction, jnp.asarray(w.mins).astype(jnp.float32))


# --- making blocks --------------------------------------------------------------------------------


def quantize_int8(w, transposed: bool = True) -> QuantizedMatrix:
    """A float matrix (numpy) as int8 per output channel: s = max |w| / 127 per output, q =
    round(w / s). `transposed`: `w` is a Linear's [..., D_in, features] (outputs are its columns);
    otherwise its rows are the outputs (an embedding [V, D])."""
    w = np.asarray(w, np.float32)
    rows = np.swapaxes(w, -1, -2) if transposed else w
    scale = np.abs(rows).max(axis=-1, keepdims=True) / 127.0
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    q = np.clip(np.rint(rows / scale), -127, 127).astype(np.int8)
    return QuantizedMatrix(np.ascontiguousarray(q[..., None, :]), scale, None, "int8", transposed)


def quantize_q8_0(w, transposed: bool = True) -> QuantizedMatrix:
    """A float matrix (numpy) as Q8_0 blocks, as ggml's reference quantizer makes them: per block of
    32 along a row, d = max |w| / 127 (stored f16), q = w / d rounded half away from zero.
    `transposed` as in `quantize_int8`; a row's length must be whole blocks."""
    w = np.asarray(w, np.float32)
    rows = np.swapaxes(w, -1, -2) if transposed else w
    if rows.shape[-1] % BLOCK:
        raise ValueError(f"a q8_0 matrix's rows must be whole blocks of {BLOCK}, got {rows.shape[-1]}")
    blocks = rows.reshape(*rows.shape[:-1], -1, BLOCK)
    d = np.abs(blocks).max(axis=-1) / 127.0
    inverse = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)[..., None]
    scaled = blocks * inverse
    q = (np.sign(scaled) * np.floor(np.abs(scaled) + 0.5)).astype(np.int8)
    return QuantizedMatrix(np.ascontiguousarray(q), d.astype(np.float16), None, "q8_0", transposed)


def from_ggml_blocks(raw: np.ndarray, format: str, rows: int, cols: int, transposed: bool) -> QuantizedMatrix:
    """A GGUF tensor's raw bytes (uint8 [rows * cols / 32 * block bytes], GGML's block structs:
    f16 d, [f16 m,] then the values) -> its blocks, as numpy arrays (no float copy)."""
    if cols % BLOCK:
        raise ValueError(f"a {format} tensor's rows must be whole blocks of {BLOCK}, got {cols}")
    head = 4 if format == "q4_1" else 2
    width = 16 if format.startswith("q4") else 32
    blocks = np.asarray(raw, np.uint8).reshape(rows, cols // BLOCK, head + width)
    scales = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]
    mins = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0] if format == "q4_1" else None
    qs = np.ascontiguousarray(blocks[..., head:])
    if format == "q8_0":
        qs = qs.view(np.int8)
    return QuantizedMatrix(qs, scales, mins, format, transposed)


# --- checkpoints ------------------------------------------------------------------------------------


def to_tree(params):
    """params with each QuantizedMatrix as a plain dict {format or format + "_t": {qs, scales[, mins]}},
    which orbax saves as it saves any dict of arrays; `from_tree` reverses it."""

    def plain(x):
        if not is_quantized(x):
            return x
        x = untile(x)
        arrays = {"qs": x.qs, "scales": x.scales, **({"mins": x.mins} if x.mins is not None else {})}
        return {x.format + ("_t" if x.transposed else ""): arrays}

    return jax.tree.map(plain, params, is_leaf=is_quantized)


def from_tree(tree):
    """The inverse of `to_tree`."""
    if isinstance(tree, dict):
        if len(tree) == 1:
            ((key, value),) = tree.items()
            format = key.removesuffix("_t")
            if format in FORMATS and isinstance(value, dict) and "qs" in value:
                return QuantizedMatrix(value["qs"], value["scales"], value.get("mins"), format, key.endswith("_t"))
        return {k: from_tree(v) for k, v in tree.items()}
    return tree
