"""Serving over HTTP: the OpenAI-compatible app, its request schema and metrics. The engine it
drives lives in `eejax.engine` (re-exported here as `eejax.serve.Engine`)."""

from eejax.engine import Engine

__all__ = ["Engine"]
