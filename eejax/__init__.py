"""eejax: fast early-exit language model inference in JAX.

model = eejax.load("smollm2-135m")           # or an eejax checkpoint directory
out = eejax.generate(model, ["The capital of France is"], max_new_tokens=16)
out.texts, out.tokens, out.exit_layers, out.stats    # spec not given: "auto" (a draft head drafts where it pays)
out = eejax.generate(model, prompts, spec="none")   # full depth whatever the model carries
out = eejax.generate(model, prompts, exit=eejax.ExitConfig("softmax", threshold=0.9))
out = eejax.generate(model, prompts, spec=eejax.LayerSkipSpec(exit_layer=12, num_speculations=4))
out = eejax.generate(model, prompts, spec="draft:4:lookup")   # eejax.SpecConfig.parse's spelling
t5 = eejax.load("path/to/converted-t5")          # encoder-decoder: prompts go to the encoder
out = eejax.generate(t5, ["summarize: ..."], exit="softmax:0.9")
sharded = eejax.shard(model, eejax.make_mesh(tensor=2))   # several devices: same calls, same tokens
"""

from eejax.config import LlamaConfig, RopeScaling, T5Config
from eejax.decode import GenerateStats, SamplingParams
from eejax.engine import GenerateResult, generate
from eejax.errors import EejaxError, OutOfPagesError, UnsupportedModelError
from eejax.loading import Model, init_exits, load, save, shard
from eejax.options import (
    DraftChainSpec,
    DraftLookupSpec,
    DraftStopSpec,
    DraftTreeSpec,
    ExitConfig,
    LayerSkipSpec,
    SpecConfig,
)
from eejax.sharding import make_mesh

__version__ = "0.1.0"


def convert(
    src, dst, *, dtype: str = "float32", quantization: str | None = None, overwrite: bool = False, progress: bool = True
):
    """Converts an HF checkpoint directory or a .gguf file into an eejax checkpoint at `dst`
    (`quantization`: None, "gguf" to keep a .gguf file's blocks, or "int8"; see `conversion.convert`)."""
    from conversion import convert as _convert

    return _convert(src, dst, dtype=dtype, quantization=quantization, overwrite=overwrite, progress=progress)


__all__ = [
    "DraftChainSpec",
    "DraftLookupSpec",
    "DraftStopSpec",
    "DraftTreeSpec",
    "EejaxError",
    "ExitConfig",
    "GenerateResult",
    "GenerateStats",
    "LayerSkipSpec",
    "LlamaConfig",
    "Model",
    "OutOfPagesError",
    "RopeScaling",
    "SamplingParams",
    "SpecConfig",
    "T5Config",
    "UnsupportedModelError",
    "convert",
    "generate",
    "init_exits",
    "load",
    "make_mesh",
    "save",
    "shard",
]
