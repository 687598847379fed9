"""The host runtime that `generate` and the server share: the `Engine` (continuous batching over
the paged cache), its scheduler, admission, lifecycle, requests and sequences, the speculation
policy, stop strings, process replicas, and `generate` itself (a loop over the engine)."""

from eejax.engine.engine import Engine
from eejax.engine.generate import GenerateResult, generate

__all__ = ["Engine", "GenerateResult", "generate"]
