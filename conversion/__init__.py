"""HF PyTorch checkpoints (torch reads them) and Llama GGUF files (`gguf_file`, no torch) -> eejax checkpoints."""

from conversion.convert import DTYPES, convert

__all__ = ["DTYPES", "convert"]
