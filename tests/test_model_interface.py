"""The model interface: architectures found by name, each module complete, and no code outside
`eejax.models` asking which architecture it runs."""

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eejax.config import LlamaConfig, T5Config
from eejax.errors import UnsupportedModelError
from eejax.models.registry import ARCHITECTURES, ModelModule, model_module
from eejax.train.forward import layer_states

LLAMA = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                    head_dim=4, max_position_embeddings=64)
T5 = T5Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2, num_encoder_layers=2, num_heads=2,
              head_dim=8)
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


def test_training_forward_is_the_architectures_and_refused_for_encoder_decoders():
    params = model_module(LLAMA).init_params(LLAMA, jax.random.PRNGKey(0))
    tokens = jnp.asarray(np.arange(12, dtype=np.int32).reshape(2, 6))
    assert layer_states(params, tokens, jnp.asarray([6, 3]), LLAMA).shape == (3, 2, 6, 16)
    t5_params = model_module(T5).init_params(T5, jax.random.PRNGKey(0))
    with pytest.raises(UnsupportedModelError, match="decoder-only"):
        layer_states(t5_params, tokens, jnp.asarray([6, 3]), T5)


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
                    isinstance(c, ast.Constant) and c.value in ARCHITECTURES for c in node.comparators):
                if "architecture" in ast.unparse(node.left):
                    offenders.append(f"{rel}:{node.lineno}")
    assert not offenders
