"""What a decoding configuration should cost: weights read per generated token, and so its ideal
speed-up over full depth.

Decoding a small batch is bound by reading weights, so the ideal cost of a token is the number
of weights its step reads (counted once per step: the batch shares them). Full depth reads
every layer and the LM head. An early-exit step that exits after E layers reads E layers, the
K/V projections of the L - E skipped layers (KV fill), one exit head per confidence check (the
reduced head of K rows, or the full head; a classifier's D weights), and the head of its token
(no extra one when the last softmax check used the full head). A self-speculation round with
d drafts reads P passes of the E draft layers (P = d + 1 with the bonus pass), d draft heads,
the L - E verify layers and the full head once, and emits the tokens it accepted. A draft head's
round (E = 0) reads its d draft heads, d passes of the draft module (d - 1 drafts and one
catch-up over the verified positions) and all L layers and the full head once.

`ideal speed-up = full-depth weights per token / the configuration's weights per token`, and a
measured speed-up divided by it is the **machinery efficiency**: how much of what skipping
layers could give the implementation delivers.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from eejax.models import draft_head, exits
from eejax.models.registry import model_module
from eejax.options import ExitConfig


@dataclasses.dataclass(frozen=True)
class WeightCounts:
    """Weights (parameters) read by each part of a decode step.

    layer: one decoder layer; kv: one layer's K/V projections and input norm (KV fill);
    head: final norm + LM head; reduced_head: the reduced exit head's rows (0 without one);
    adapter: one exit adapter (0 without); classifier: one exit classifier; num_layers: L;
    draft: the draft head's fc and decoder layer (0 without one).
    """

    layer: float
    kv: float
    head: float
    reduced_head: float
    adapter: float
    classifier: float
    num_layers: int
    draft: float = 0.0

    @classmethod
    def of(cls, params, config) -> WeightCounts:
        m = model_module(config)
        layers = m.decoder_layers(params)
        L = config.num_layers
        per_layer = sum(int(np.prod(x.shape)) for k, x in layers.items() if k not in m.DECODE_ONLY_SKIPS) / L
        kv = sum(int(np.prod(layers[k].shape)) for k in ("attn_norm", "wk", "wv")) / L
        e = params.get("exits") or {}
        adapter = sum(int(np.prod(e[k].shape)) for k in exits.ADAPTER_KEYS if k in e) / L
        classifier = sum(int(np.prod(e[k].shape)) for k in exits.CLASSIFIER_KEYS if k in e) / L
        reduced = int(np.prod(e["vocab_head"].shape)) if "vocab_head" in e else 0
        return cls(
            layer=per_layer,
            kv=kv,
            head=config.vocab_size * config.hidden_size + config.hidden_size,
            reduced_head=reduced + config.hidden_size * bool(reduced),
            adapter=adapter,
            classifier=classifier,
            num_layers=L,
            draft=draft_head.num_weights(params.get("draft") or {}),
        )

    @property
    def full_depth(self) -> float:
        """Weights read by one full-depth token."""
        return self.num_layers * self.layer + self.head

    def exit_head(self, reduced: bool) -> float:
        """One exit-head evaluation: the adapter, then the reduced or the full head."""
        return (self.reduced_head if reduced else self.head) + self.adapter


def exit_step_weights(
    w: WeightCounts,
    config: ExitConfig,
    exit_layer: int,
    check_layers: tuple[int, ...],
    reduced_checks: bool,
    reduced_emit: bool,
) -> float:
    """Weights read by one early-exit step whose batch ran `exit_layer` layers."""
    L = w.num_layers
    if exit_layer >= L:
        checks = len(check_layers)
    else:
        checks = sum(1 for c in check_layers if c <= exit_layer)
    check = {"softmax": w.exit_head(reduced_checks), "classifier": w.classifier}.get(config.measure, 0.0)
    if exit_layer >= L:
        token = w.head
    elif config.measure == "softmax" and not (reduced_checks or reduced_emit):
        token = 0.0  # the last check's full-head logits give the token
    else:
        token = w.exit_head(reduced_emit)
    return min(exit_layer, L) * w.layer + (L - min(exit_layer, L)) * w.kv + checks * check + token


def spec_weights(
    w: WeightCounts,
    exit_layer: int,
    passes: float,
    draft_heads: float,
    rounds: float,
    reduced_drafts: bool,
    draft_module: bool = False,
) -> float:
    """Weights read by speculation rounds at E = `exit_layer`: `passes` draft passes (of E
    layers, or of the draft head's module), `draft_heads` draft-head evaluations and `rounds`
    verify passes (the other layers and the full head)."""
    draft_pass, draft_head, verify = spec_unit_weights(w, exit_layer, reduced_drafts, draft_module)
    return passes * draft_pass + draft_heads * draft_head + rounds * verify


def spec_unit_weights(
    w: WeightCounts, exit_layer: int, reduced_drafts: bool, draft_module: bool = False
) -> tuple[float, float, float]:
    """Weights of one draft pass (E layers, or the draft head's fc and layer), one draft head,
    one verify pass (L - E layers and the full head)."""
    draft_pass = w.draft if draft_module else exit_layer * w.layer
    return draft_pass, w.exit_head(reduced_drafts), (w.num_layers - exit_layer) * w.layer + w.head


def ideal_speedup(w: WeightCounts, weights_per_token: float) -> float:
    """Full-depth weights per token over the configuration's."""
    return w.full_depth / weights_per_token if weights_per_token > 0 else float("nan")
