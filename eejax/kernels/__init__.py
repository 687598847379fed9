"""Attention over the paged cache: the jnp reference and the Triton kernel, behind one dispatch."""

from eejax.kernels.attention import paged_attention, reference_paged_attention

__all__ = ["paged_attention", "reference_paged_attention"]
