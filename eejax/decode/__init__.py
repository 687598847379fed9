"""Decoding: sampling, the jitted steps, shape buckets and `generate`."""

from eejax.decode.generate import GenerateResult, generate
from eejax.decode.stats import GenerateStats
from eejax.decode.sampling import SamplingParams

__all__ = ["GenerateResult", "GenerateStats", "SamplingParams", "generate"]
