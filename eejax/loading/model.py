"""`Model`: a config, its params pytree and its tokenizer, plus the programs compiled for it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from eejax.cache import init_cache, page_bytes, pages_for_budget
from eejax.checkpoint import CONFIG_FILE, write_checkpoint
from eejax.compile_cache import background_compile
from eejax.config import LlamaConfig, T5Config
from eejax.decode.programs import ProgramCache
from eejax.errors import EejaxError, UnsupportedModelError
from eejax.kernels import cpu_matmul
from eejax.models import draft_head, exits
from eejax.models.registry import model_module
from eejax.quantized import (
    BLOCK,
    float_dtype,
    formats,
    is_quantized,
    quantize_int8,
    quantize_q8_0,
    with_activations,
)
from eejax.sharding import RULES, cache_sharding, check_fits, param_shardings

LAYER_BUFFERS = ("auto", "stacked", "split", "rows")


@dataclasses.dataclass(eq=False)
class Model:
    config: LlamaConfig | T5Config
    params: dict
    tokenizer: Any = None
    programs: ProgramCache = dataclasses.field(default_factory=ProgramCache, repr=False)
    # How the generation programs read the layer weights: "stacked" (the params as they are),
    # "split" (each layer's weights in their own buffers: see `run_params`), or "auto": split on
    # one CPU device, stacked on an accelerator or a mesh (`layout`).
    layer_buffers: str = "auto"
    # The device mesh the params are placed on (`shard`), or None: one device.
    mesh: Any = None
    _run: tuple | None = dataclasses.field(default=None, init=False, repr=False)
    _auto: tuple | None = dataclasses.field(default=None, init=False, repr=False)

    def __post_init__(self):
        if self.layer_buffers not in LAYER_BUFFERS:
            raise EejaxError(f"layer_buffers must be one of {', '.join(LAYER_BUFFERS)}, got {self.layer_buffers!r}")

    @property
    def layout(self) -> str:
        """The layer layout the programs use: `layer_buffers`, with "auto" resolved to "split" for
        params on one CPU device (where it decodes faster and costs no memory: the per-layer
        buffers are views of the stack) and "stacked" elsewhere (a GPU reads a dynamic slice in
        place; a traced layer's `lax.switch` would cost it a host round trip per layer). "rows"
        is stacked with the layers' float Linear weights held as their rows, a transposed copy
        beside `params` (`with_linear_rows`): XLA:GPU then multiplies a decode step's few rows in
        one fused pass each, where from the weights as stored it writes every product out first
        (docs/gpu.md, "Kernels a step"). Not yet timed on a GPU, so "auto" does not pick it."""
        if self.layer_buffers == "rows" and self.mesh is not None:
            raise EejaxError("layer_buffers 'rows' is for one device: a mesh shards the weights as they are stored")
        if self.layer_buffers != "auto":
            return self.layer_buffers
        if self._auto is None or self._auto[0] is not self.params or self._auto[1] is not self.mesh:
            if self.mesh is not None or not model_module(self.config).SPLITS_LAYERS:
                layout = "stacked"
            else:
                layout = "split" if _on_one_cpu(self.params) else "stacked"
            self._auto = (self.params, self.mesh, layout)  # resolved once per params: every dispatch asks
        return self._auto[2]

    @property
    def compiles_split_later(self) -> bool:
        """Whether decoding starts on the stacked programs while the split ones compile in the
        background (`ProgramCache.get_soon`): where "auto" chose "split", so that a first
        `generate` waits for the stacked loop's compile (~3x faster) only. An explicit
        `layer_buffers="split"`, or $EEJAX_BACKGROUND_COMPILE=off, compiles the split programs
        before their first step."""
        return self.layer_buffers == "auto" and self.layout == "split" and background_compile()

    def program(self, fn, args, options, now: bool = False, donate_argnums=(1,)):
        """(compiled `fn`, the args it takes) for a decode program over named `args` whose
        `params` are `run_params` (`decode.slot_args`); while its split version compiles in the
        background (`compiles_split_later`, unless `now`), the stacked one over `params`. It
        donates `donate_argnums`: the cache (args[1]) by default."""
        if self.compiles_split_later and not now:
            stacked = args._replace(params=self.params)
            return self.programs.get_soon(fn, args, stacked, self.config, options, donate_argnums=donate_argnums)
        return self.programs.get(fn, args, self.config, options, donate_argnums=donate_argnums), args

    @property
    def run_params(self) -> dict:
        """The params the decode programs read: `params`, or in the "split" layout the same weights
        with each decoder layer's in its own buffers, read in place by the layer loop instead of
        copied out of the stack (`eejax.models.stack`): on a CPU, decode runs 1.01-1.27x faster and
        the buffers share the stack's memory; unrolled layers cost compile time. In the "rows"
        layout, the float Linear weights of the layers as their rows (a copy). A float draft head
        drafts from Q8_0 blocks where `drafts_in_blocks`. Prefills read `params` in every layout.
        Built once per `params` object."""
        if self._run is None or self._run[0] is not self.params or self._run[1] != self.layer_buffers:
            layout, module = self.layout, model_module(self.config)  # resolved once: every dispatch reads run_params
            run = self.params
            if layout == "split":
                run = module.with_layer_buffers(self.params)
            elif layout == "rows":
                run = module.with_linear_rows(self.params)
            if self.drafts_in_blocks:
                run = draft_blocks(run, self.config)
            self._run = (self.params, self.layer_buffers, run)
        return self._run[2]

    @property
    def drafts_in_blocks(self) -> bool:
        """Whether the decode programs' draft head is Q8_0 blocks taking int16 x (`draft_blocks`)
        while `params` hold it float: a float32 model on one CPU device where the kernel's tiled
        loop runs. A round's drafts then cost half as much (SmolLM2 on float32 weights, 2-core EPYC,
        2026-12-02: `draft:2` 1.18 -> 1.10 full-depth steps, `draft:4` 1.38 -> 1.22; its drafts
        agree with the model as often: τ of `auto` 1.76 both ways on MT-bench), and the verify
        pass still decides every token. Quantized models quantize their draft head as they load."""
        if not draft_head.has_draft(self.params) or formats(self.params["draft"]) or self.mesh is not None:
            return False
        return _on_one_cpu(self.params) and self.dtype == jnp.float32 and cpu_matmul.tiled_loop_runs()

    def with_params(self, params: dict) -> Model:
        """The same model (config, tokenizer, layer layout, mesh) with other params and its own programs."""
        return Model(
            self.config,
            params,
            self.tokenizer,
            layer_buffers=self.layer_buffers,
            mesh=self.mesh,
            programs=ProgramCache(self.programs.mesh, self.programs.rules),
        )

    def new_cache(self, num_pages: int, page_size: int):
        """A zeroed paged KV cache for this model, on its mesh when it has one (split by KV heads)."""
        c = self.config
        cache = init_cache(self.cache_layers, num_pages, page_size, c.num_kv_heads, c.head_dim, self.dtype)
        if self.mesh is None:
            return cache
        return jax.device_put(cache, cache_sharding(c, self.mesh))

    def page_bytes(self, page_size: int) -> int:
        """Bytes of one page of this model's KV cache (`new_cache`), every layer's keys and values."""
        c = self.config
        return page_bytes(self.cache_layers, page_size, c.num_kv_heads, c.head_dim, self.dtype)

    def pages_for_budget(self, budget: int | str, page_size: int) -> int:
        """How many pages of this model's KV cache (the null page included) fit in `budget` bytes
        (or "512MiB"): the one place a memory budget becomes pages."""
        return pages_for_budget(budget, self.page_bytes(page_size))

    @property
    def cache_layers(self) -> int:
        """Layers of the paged KV cache: the model's, and one more for a draft head's K/V."""
        return self.config.num_layers + bool(self.params.get("draft"))

    def logical_axes(self) -> dict:
        """The logical axis names of every array in `params`, a tree of `PartitionSpec`s like it:
        the annotations of the architecture's Flax modules and of the exits. A mesh shards by
        these through Flax's rules (`flax.linen.logical_to_mesh_sharding`)."""
        specs = model_module(self.config).logical_axes(self.config)
        if self.params.get("exits"):
            specs["exits"] = exits.logical_axes(self.params["exits"], self.config.tie_embeddings)
        if self.params.get("draft"):
            specs["draft"] = draft_head.logical_axes(self.config)
        return specs

    @property
    def dtype(self):
        """The activations' and the KV cache's dtype: the float weights' (a quantized model's norms)."""
        return float_dtype(self.params)

    @property
    def quantization(self) -> str | None:
        """The block format of the quantized weights ("q4_1", "int8", ...; several joined by "+"),
        or None for a float model."""
        return "+".join(sorted(formats(self.params))) or None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids from the config and generation config, plus the tokenizer's own."""
        ids = list(self.config.eos_token_ids)
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if tok_eos is not None and tok_eos not in ids:
            ids.append(int(tok_eos))
        return tuple(ids)


def _on_one_cpu(params) -> bool:
    """Whether `params` lie on one CPU device."""
    devices = jax.tree.leaves(params)[0].devices()
    return len(devices) == 1 and next(iter(devices)).platform == "cpu"


def cast_floats(params, dtype):
    """params with every floating-point array cast to `dtype` (integer ids, such as the reduced
    head's vocabulary, stay integers; quantized matrices keep their blocks)."""

    def cast(x):
        if is_quantized(x) or not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return x.astype(dtype)

    return jax.tree.map(cast, params, is_leaf=is_quantized)


QUANTIZATIONS = ("gguf", "int8")


def quantize(model_params: dict, config, kind: str | None) -> dict:
    """params with their matrices quantized: "int8" per output channel (from float weights; an
    int8 model is returned as it is), None as they are. "gguf" blocks come from a GGUF file
    (`conversion.convert(..., quantization="gguf")`), not from float weights. Either way a draft
    head is quantized with it (`_quantize_draft`)."""
    if kind is None:
        return model_params
    if kind not in QUANTIZATIONS:
        raise EejaxError(f"unknown quantization {kind!r}; choose from {', '.join(QUANTIZATIONS)} (or none)")
    module = model_module(config)
    if not hasattr(module, "quantize_weights"):
        raise UnsupportedModelError(f"quantized weights are not supported for {config.architecture} models yet")
    held = formats({k: v for k, v in model_params.items() if k != "draft"})
    if kind == "gguf":
        if held and "int8" not in held:
            return _quantize_draft(model_params, _to_q8_0)
        raise EejaxError(
            "quantization='gguf' keeps a GGUF file's own blocks: load a known GGUF model by name or convert a .gguf "
            "file with `eejax convert --quantization gguf`; this checkpoint holds "
            + (f"{', '.join(sorted(held))} weights" if held else "float weights (use 'int8')")
        )
    if held:
        if held == {"int8"}:
            return _quantize_draft(model_params)
        raise EejaxError(f"this checkpoint already holds {', '.join(sorted(held))} blocks; load it as it is")
    params = module.quantize_weights(model_params, _to_int8)
    if exits.has_reduced_head(params.get("exits")):  # the reduced head: the quantized head's rows
        params = exits.set_exit_vocab(params, np.asarray(params["exits"]["vocab_ids"]), config.tie_embeddings)
    return _quantize_draft(params)


def _to_int8(w, transposed: bool):
    return jax.tree.map(jnp.asarray, quantize_int8(np.asarray(w), transposed))


def _to_q8_0(w, transposed: bool):
    if w.shape[-2 if transposed else -1] % BLOCK:  # rows of part blocks: per channel
        return _to_int8(w, transposed)
    return jax.tree.map(jnp.asarray, quantize_q8_0(np.asarray(w), transposed))


def _quantize_draft(params: dict, quantize=_to_int8) -> dict:
    """params with a draft head's matrices quantized by `quantize`: int8 per output channel beside
    int8 weights, Q8_0 blocks beside GGUF blocks (kept in tiles as the head is on a CPU with AVX-512
    VNNI: the draft layer's products 1.3x faster at 1 row and 1.8x at a catch-up's 5, 2026-12-01).
    Drafting reads the draft layer once per draft: kept float beside Q4_1 blocks, four drafts read
    ~0.8 of a full step's bytes (SmolLM2), ~0.25 quantized. Its drafts change a little; what is
    emitted does not: the verify pass decides every token."""
    if not params.get("draft"):
        return params
    return {**params, "draft": draft_head.quantize_weights(params["draft"], quantize)}


def draft_blocks(params: dict, config) -> dict:
    """params whose float draft head (its fc and layer) and the reduced head it drafts from are
    Q8_0 blocks taking int16 x, in the kernel's tiles, as beside the CPU's default GGUF load: the
    draft layer then runs as one call (`llama.one_call`), its products and the reduced head's in
    integers. A reduced head shared with exit layers (early exit decides on its logits) stays float."""
    out = _quantize_draft(params, _to_q8_0)
    e = out.get("exits")
    if exits.has_reduced_head(e) and set(e) <= {"vocab_ids", "vocab_head"}:
        # the reduced head's rows are tokens: [K, D] where tied to the embedding, [D, K] untied
        head = _to_q8_0(np.asarray(e["vocab_head"]), not config.tie_embeddings)
        out = {**out, "exits": {**e, "vocab_head": head}}
    blocks = {k: out[k] for k in ("draft", "exits") if k in out}
    return {**out, **cpu_matmul.tiled_for_kernel(with_activations(blocks, "int16"))}


def init_exits(model: Model, *, adapter_rank: int = 0, classifier: bool = True, seed: int = 0) -> Model:
    """A copy of `model` with untrained, deterministic exit modules in `params["exits"]`
    (identity adapters of rank `adapter_rank`, classifiers with P(exit) = 0.5); see
    `eejax.models.exits`. Replaces any exits the model had."""
    c = model.config
    new = exits.init_exits(
        c.num_layers,
        c.hidden_size,
        jax.random.PRNGKey(seed),
        adapter_rank=adapter_rank,
        classifier=classifier,
        dtype=model.dtype,
    )
    return model.with_params({**model.params, "exits": new})


def save(model: Model, path: str | Path, *, overwrite: bool = False, metadata: dict | None = None) -> Path:
    """Writes `model` (params with any exit modules, config, tokenizer) as an eejax checkpoint
    directory at `path`, atomically; `eejax.load(path)` reads it back."""
    return write_checkpoint(path, model.config, model.params, model.tokenizer, metadata, overwrite=overwrite)


def shard(model: Model, mesh: Mesh, rules=RULES) -> Model:
    """`model` with its params placed on `mesh` by their logical axes (`eejax.sharding`); its KV
    caches are created there (`Model.new_cache`) and its programs compiled for it. A draft head is
    placed as a decoder layer is (its K/V are one more cache layer, split by KV heads too)."""
    check_fits(model.config, mesh)
    if model.quantization:
        raise UnsupportedModelError(
            f"a model with quantized weights ({model.quantization}) cannot be placed on a mesh yet: load it without "
            "quantization to shard it"
        )
    params = jax.device_put(model.params, param_shardings(model, mesh, rules))
    return dataclasses.replace(model.with_params(params), mesh=mesh, programs=ProgramCache(mesh, rules))


def check_params(config, params, where: str) -> None:
    """Refuses weights whose names or shapes differ from what `config` describes (say, a
    `num_layers` edited in eejax.json): the model would run and print wrong text."""
    module = model_module(config)
    expected = jax.eval_shape(lambda: module.init_params(config, jax.random.PRNGKey(0)))

    def shapes(tree) -> dict[str, tuple]:
        leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_quantized)
        return {jax.tree_util.keystr(path): tuple(x.shape) for path, x in leaves}

    want = shapes(expected)
    have = shapes({k: v for k, v in params.items() if k not in ("exits", "draft")})
    for name in sorted(want.keys() | have.keys()):
        if name not in have:
            problem = f"weights {name} are missing"
        elif name not in want:
            problem = f"weights {name} are not part of this architecture"
        elif have[name] != want[name]:
            problem = f"weights {name} have shape {have[name]}, the config asks for {want[name]}"
        else:
            continue
        raise EejaxError(f"{where}: the weights do not match {CONFIG_FILE}'s config: {problem}")
    if "exits" in params:
        exits.check_exits(params["exits"], config)
        exits.check_reduced_head(params, config.tie_embeddings)
    if params.get("draft"):
        draft_head.check_draft(params["draft"], config)
