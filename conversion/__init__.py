"""HF PyTorch checkpoints (and GGUF through transformers) -> eejax checkpoints."""

from conversion.convert import DTYPES, convert

__all__ = ["DTYPES", "convert"]
