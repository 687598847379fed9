"""Attention kernels: the jnp reference over the paged cache (Triton kernels plug in here)."""

from eejax.kernels.attention import paged_attention, reference_paged_attention

__all__ = ["paged_attention", "reference_paged_attention"]
