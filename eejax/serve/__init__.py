"""Serving: the BucketServe scheduler, the engine (continuous batching over the paged cache) and
the HTTP API."""
