"""The training forward pass: whole right-padded sequences, no KV cache (each architecture's
`forward_states`), with optional layer dropout that skips the dropped layers' compute. An
encoder-decoder's sequences are its decoder's inputs, and `context` holds the prompts its
encoder reads."""

from __future__ import annotations

from eejax.models.registry import model_module


def layer_states_and_count(params, tokens, lengths, config, skip=None, context=None):
    """(states [L, B, T, D], layers computed int32) of right-padded sequences tokens [B, T] with
    lengths [B]; states[l] is the hidden state after layer l. skip [L] bool drops layer l (its
    input passes through, nothing else runs for it: LayerSkip's layer dropout). `context`: an
    encoder-decoder's prompts (tokens [B, S], lengths [B]), None for a decoder-only model."""
    return model_module(config).forward_states(params, tokens, lengths, config, skip, context)


def layer_states(params, tokens, lengths, config, skip=None, context=None):
    """Hidden states after every layer, [L, B, T, D] (see `layer_states_and_count`)."""
    return layer_states_and_count(params, tokens, lengths, config, skip, context)[0]
