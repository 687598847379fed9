"""Decoding: sampling, the jitted steps, shape buckets and `generate`."""

from eejax.decode.generate import GenerateResult, generate
from eejax.decode.sampling import SamplingParams

__all__ = ["GenerateResult", "SamplingParams", "generate"]
