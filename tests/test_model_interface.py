"""The model interface: architectures found by name, each module complete, and no code outside
`eejax.models` asking which architecture it runs."""

import ast
import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eejax.config import LlamaConfig, T5Config
from eejax.errors import EejaxError, UnsupportedModelError
from eejax.kernels.cpu_matmul import RowsMatrix
from eejax.models.registry import ARCHITECTURES, ModelModule, model_module
from eejax.models.stack import is_split, on_layer, split_stack
from eejax.train.forward import layer_states

LLAMA = LlamaConfig(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=4,
    max_position_embeddings=64,
)
T5 = T5Config(
    vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2, num_encoder_layers=2, num_heads=2, head_dim=8
)
PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "eejax"


@pytest.mark.parametrize("config", [LLAMA, T5], ids=["llama", "t5"])
def test_every_architecture_implements_the_interface(config):
    m = model_module(config)
    assert m is ARCHITECTURES[config.architecture]
    names = [n for n in dir(ModelModule) if not n.startswith("_")] + list(ModelModule.__annotations__)
    assert not [n for n in names if not hasattr(m, n)]
    params = m.init_params(config, jax.random.PRNGKey(0))
    layers = m.decoder_layers(params)
    assert {x.shape[0] for x in layers.values()} == {config.num_layers}
    assert set(m.DECODE_ONLY_SKIPS) <= set(layers)
    assert m.lm_head(params, jnp.ones((2, config.hidden_size)), config).shape == (2, config.vocab_size)


def test_training_forward_is_the_architectures_and_an_encoder_decoders_needs_its_prompts():
    params = model_module(LLAMA).init_params(LLAMA, jax.random.PRNGKey(0))
    tokens = jnp.asarray(np.arange(12, dtype=np.int32).reshape(2, 6))
    lengths = jnp.asarray([6, 3])
    assert layer_states(params, tokens, lengths, LLAMA).shape == (3, 2, 6, 16)
    with pytest.raises(EejaxError, match="decoder-only model's training forward takes no encoder context"):
        layer_states(params, tokens, lengths, LLAMA, context=(tokens, lengths))
    t5_params = model_module(T5).init_params(T5, jax.random.PRNGKey(0))
    prompts = (jnp.ones((2, 4), jnp.int32), jnp.asarray([4, 2]))
    assert layer_states(t5_params, tokens, lengths, T5, context=prompts).shape == (T5.num_layers, 2, 6, 16)
    with pytest.raises(EejaxError, match="needs the prompts its decoder attends to"):
        layer_states(t5_params, tokens, lengths, T5)


def test_an_unknown_architecture_names_the_known_ones():
    class Other:
        architecture = "mamba"

    with pytest.raises(UnsupportedModelError, match="'mamba'.*llama, t5"):
        model_module(Other())


def test_no_architecture_checks_outside_models():
    """`isinstance(config, T5Config)` and the like belong in `eejax.models` (and the config and
    checkpoint modules that build configs); everything else asks `model_module`."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("models/") or rel in ("config.py", "checkpoint.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                if names & {"T5Config", "LlamaConfig"}:
                    offenders.append(f"{rel}:{node.lineno}")
            if isinstance(node, ast.Compare) and any(
                isinstance(c, ast.Constant) and c.value in ARCHITECTURES for c in node.comparators
            ):
                if "architecture" in ast.unparse(node.left):
                    offenders.append(f"{rel}:{node.lineno}")
    assert not offenders


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(exit="softmax:0.02"),
        dict(exit="state:0.7"),
        dict(spec="1:2"),
        dict(temperature=0.9, top_k=8, seed=3),
    ],
    ids=str,
)
def test_per_layer_weight_buffers_give_the_stacked_layouts_tokens(options):
    """A CPU reads each layer's weights from its own buffer (`Model.run_params`); a GPU from the
    stack, or the stack's matrices held as their rows ("rows"). The layouts give the same tokens
    and exit layers (static and traced layer ranges)."""
    import eejax

    config = dataclasses.replace(LLAMA, num_layers=4)
    params = model_module(config).init_params(config, jax.random.PRNGKey(1), scale=0.3)
    prompts = [[3, 9, 27, 5, 8], [11, 4], [7, 7, 7, 2, 40, 41, 42]]
    out = {}
    for layout in ("stacked", "split", "rows"):
        model = eejax.Model(config, params, layer_buffers=layout)
        assert is_split(model.run_params["layers"]) == (layout == "split")
        held = model.run_params["layers"]["wq"] if layout != "split" else None
        assert isinstance(held, RowsMatrix) == (layout == "rows")
        r = eejax.generate(model, prompts, max_new_tokens=6, ignore_eos=True, **options)
        out[layout] = (r.tokens, r.exit_layers)
    assert out["split"] == out["stacked"] == out["rows"]
    if "exit" in options:
        assert min(map(min, out["split"][1])) < config.num_layers  # some steps exited: traced layer ranges ran


def test_auto_decodes_stacked_while_the_split_program_compiles(monkeypatch):
    """On a CPU "auto" takes the split layout, but its first steps run the stacked loop while the
    unrolled program compiles in a background thread; once it is ready, decoding uses it. An
    explicit "split" (or $EEJAX_BACKGROUND_COMPILE=off) compiles it before the first step. A loop
    that never pauses gets it too, BUSY_S seconds after first asking. The tokens are the same
    throughout."""
    import eejax

    config = dataclasses.replace(LLAMA, num_layers=4)
    params = model_module(config).init_params(config, jax.random.PRNGKey(1), scale=0.3)
    prompts = [[3, 9, 27, 5, 8], [11, 4]]
    want = eejax.generate(eejax.Model(config, params, layer_buffers="stacked"), prompts, max_new_tokens=6).tokens
    model = eejax.Model(config, params)
    assert not model.compiles_split_later  # the suite's setting (conftest)
    monkeypatch.setenv("EEJAX_BACKGROUND_COMPILE", "on")
    assert model.layout == "split" and model.compiles_split_later
    assert not eejax.Model(config, params, layer_buffers="split").compiles_split_later
    took_split, get_soon = [], model.programs.get_soon

    def spy(*args, **kwargs):
        program, program_args = get_soon(*args, **kwargs)
        took_split.append(is_split(program_args[0]["layers"]))
        return program, program_args

    model.programs.get_soon = spy
    for options in (dict(), dict(spec="1:2")):  # decode steps; speculation rounds
        took_split.clear()
        assert eejax.generate(model, prompts, max_new_tokens=6, **options).tokens == want
        assert took_split[0] is False  # the first program did not wait for the split one
        model.programs.wait()
        took_split.clear()
        assert eejax.generate(model, prompts, max_new_tokens=6, **options).tokens == want
        assert took_split and all(took_split)
    assert model.programs.background_seconds > 0
    # A loop that never pauses still gets the split program, BUSY_S after first asking for it.
    from eejax.decode import programs

    monkeypatch.setattr(programs, "IDLE_S", 1e9)
    monkeypatch.setattr(programs, "BUSY_S", 0.0)
    model.programs.clear()
    took_split.clear()
    assert eejax.generate(model, prompts, max_new_tokens=6).tokens == want
    assert model.programs.wait(timeout=120)  # the cache was never idle
    took_split.clear()
    assert eejax.generate(model, prompts, max_new_tokens=6).tokens == want
    assert took_split and all(took_split)


def test_on_layer_reads_the_same_weights_in_both_layouts():
    stack = {"w": jnp.arange(24.0).reshape(4, 2, 3)}
    split = split_stack(stack)
    for layer in (0, 3, jnp.int32(2)):
        assert np.array_equal(
            on_layer(stack, ("w",), layer, lambda lp: lp["w"] * 2),
            on_layer(split, ("w",), layer, lambda lp: lp["w"] * 2),
        )
    traced = jax.jit(lambda i: on_layer(split, ("w",), i, lambda lp: lp["w"].sum()))
    assert [float(traced(i)) for i in range(4)] == [float(stack["w"][i].sum()) for i in range(4)]


def test_per_layer_buffers_share_the_stacks_memory_on_a_cpu():
    """One copy of the weights: each layer's buffer is a view of the stack (64-byte layers)."""
    stack = jnp.arange(4 * 16 * 8, dtype=jnp.float32).reshape(4, 16, 8)
    layers = split_stack({"w": stack})["w"]
    base, size = stack.unsafe_buffer_pointer(), 16 * 8 * 4
    assert [x.unsafe_buffer_pointer() for x in layers] == [base + i * size for i in range(4)]
    assert all(np.array_equal(x, stack[i]) for i, x in enumerate(layers))


def test_the_engine_reads_per_layer_buffers_too():
    import eejax
    from eejax.engine.engine import Engine
    from eejax.errors import EejaxError

    config = dataclasses.replace(LLAMA, num_layers=4)
    params = model_module(config).init_params(config, jax.random.PRNGKey(2), scale=0.3)
    prompts = [[3, 9, 27, 5, 8], [11, 4, 6]]
    want = eejax.generate(eejax.Model(config, params), prompts, max_new_tokens=5, ignore_eos=True).tokens
    engine = Engine(
        eejax.Model(config, params, layer_buffers="split"),
        max_slots=2,
        max_new_tokens=8,
        cache_budget="1MiB",
        page_size=8,
    )
    seqs = [engine.submit(p, max_new_tokens=5) for p in prompts]
    engine.run()
    assert [s.tokens for s in seqs] == want  # (the config names no EOS: every row runs to 5 tokens)
    with pytest.raises(EejaxError, match="layer_buffers"):
        eejax.Model(config, params, layer_buffers="unrolled")


def test_the_rows_layout_is_refused_on_a_mesh():
    import eejax
    from eejax.errors import EejaxError

    params = model_module(LLAMA).init_params(LLAMA, jax.random.PRNGKey(0))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tensor",))
    with pytest.raises(EejaxError, match="'rows' is for one device"):
        assert eejax.Model(LLAMA, params, layer_buffers="rows", mesh=mesh).layout


AXIS_NAMES = {"vocab", "embed", "heads", "kv_heads", "mlp", "norm", "layers", "relpos_buckets", "adapter"}
CONFIGS = {
    "llama-untied": LLAMA,
    "llama-tied": dataclasses.replace(LLAMA, tie_embeddings=True),
    "t5-v1.0": T5,
    "t5-v1.1": dataclasses.replace(
        T5, gated=True, activation="gelu_new", tie_embeddings=False, scale_decoder_outputs=False
    ),
}


def is_spec(x):
    return isinstance(x, jax.sharding.PartitionSpec)


@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
def test_flax_init_gives_every_param_its_logical_axes(config):
    """Params come from the Flax model's `init`; each array has one logical axis name per
    dimension (what a mesh shards by), the stacked layers' first one `layers`."""
    m = model_module(config)
    params = m.init_params(config, jax.random.PRNGKey(0))
    specs = m.logical_axes(config)
    assert jax.tree.structure(specs, is_leaf=is_spec) == jax.tree.structure(params)
    for spec, x in zip(jax.tree.leaves(specs, is_leaf=is_spec), jax.tree.leaves(params)):
        assert len(spec) == x.ndim and set(spec) <= AXIS_NAMES
    layer_specs = m.decoder_layers(specs)
    assert {s[0] for s in jax.tree.leaves(layer_specs, is_leaf=is_spec)} == {"layers"}
    assert layer_specs["wk"][1:] == ("embed", "kv_heads")  # the paged cache's head axis


def test_model_logical_axes_cover_the_exits_and_the_reduced_head():
    import eejax
    from eejax.models import exits

    model = eejax.init_exits(
        eejax.Model(LLAMA, model_module(LLAMA).init_params(LLAMA, jax.random.PRNGKey(0))), adapter_rank=4
    )
    model = model.with_params(exits.set_exit_vocab(model.params, [1, 5, 9], tied=False))
    specs = model.logical_axes()
    assert jax.tree.structure(specs, is_leaf=is_spec) == jax.tree.structure(model.params)
    assert tuple(specs["exits"]["adapter_down"]) == ("layers", "embed", "adapter")
    assert tuple(specs["exits"]["vocab_head"]) == ("embed", "vocab")
    h = jax.random.normal(jax.random.PRNGKey(1), (3, LLAMA.hidden_size))
    e = model.params["exits"]
    assert np.array_equal(exits.adapt(e, h, 1), h)  # untrained adapters are the identity
    assert np.allclose(exits.classifier_prob(e, h, 2), 0.5)


def test_the_flax_forward_without_a_cache_gives_the_paged_prefills_logits():
    """`Llama.__call__` (what `init` runs: dense causal attention, scanned layers) and the paged
    prefill the decoder runs are the same model."""
    import eejax
    from eejax.models.llama import Llama
    from tests.helpers import sequence_logits

    params = model_module(LLAMA).init_params(LLAMA, jax.random.PRNGKey(3), scale=0.3)
    rows = [[5, 9, 2, 33, 7, 1], [8, 8, 40]]
    tokens = np.zeros((2, 6), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    dense = Llama(LLAMA).apply({"params": params}, tokens, np.array([6, 3], np.int32))
    for i, r in enumerate(rows):
        np.testing.assert_allclose(
            dense[i, : len(r)], sequence_logits(eejax.Model(LLAMA, params), r), rtol=2e-5, atol=2e-5
        )


def test_the_t5_flax_forward_without_a_cache_gives_the_paged_decoders_logits():
    from eejax.cache import init_cache
    from eejax.models import t5

    config = CONFIGS["t5-v1.1"]
    params = t5.init_params(config, jax.random.PRNGKey(4), scale=0.3)
    prompt, lengths = np.array([[4, 9, 13, 2, 0], [6, 7, 8, 9, 10]], np.int32), np.array([4, 5], np.int32)
    dec = np.array([[0, 12, 30, 5], [0, 3, 3, 3]], np.int32)
    dense = t5.T5(config).apply({"params": params}, prompt, lengths, dec, np.array([4, 4], np.int32))
    b, t = dec.shape
    cache = init_cache(config.num_layers, 1 + b, 8, config.num_kv_heads, config.head_dim, jnp.float32)
    batch = t5.token_batch(
        config,
        np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)),
        np.ones((b, t), bool),
        np.arange(1, 1 + b, dtype=np.int32)[:, None],
        np.full((b,), t, np.int32),
        8,
        context=t5.encode_context(params, prompt, lengths, config),
    )
    h, _ = t5.run_layers(params, t5.embed(params, dec), cache, batch, config)
    np.testing.assert_allclose(dense, t5.lm_head(params, h, config), rtol=2e-5, atol=2e-5)
