"""Decoding: the jitted steps over the paged cache (prefill, decode, early exit, speculation),
sampling, shape buckets, the cost model and a generation's stats. Knows neither the engine nor
HTTP: `eejax.engine` drives these steps."""

from eejax.decode.sampling import SamplingParams
from eejax.decode.stats import GenerateStats

__all__ = ["GenerateStats", "SamplingParams"]
