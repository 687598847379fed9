"""The training loss curve as a PNG (matplotlib, from the `bench` extra)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from eejax.errors import EejaxError


def _pyplot():
    """matplotlib.pyplot with the file-only Agg backend (a named error without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise EejaxError('the loss plot needs matplotlib: pip install "eejax[bench]"') from e
    return plt


def _save(plt, fig, path) -> Path:
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def save_loss_plot(losses, path: str | Path, title: str = "exit training loss") -> Path:
    """Writes the per-step losses and their 20-step running mean to `path` (PNG)."""
    plt = _pyplot()
    losses = np.asarray(losses, np.float64)
    steps = np.arange(1, len(losses) + 1)
    window = min(20, len(losses))
    smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot(steps, losses, lw=0.8, alpha=0.5, label="loss")
    ax.plot(steps[window - 1 :], smooth, lw=1.8, label=f"mean of {window} steps")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()
    return _save(plt, fig, path)


def save_layerskip_plot(log: dict, path: str | Path, num_layers: int) -> Path:
    """A LayerSkip run's curves: the KL of each head it evaluated (exit after l layers, and the
    last layer) over the steps that evaluated it, as 20-point running means (PNG)."""
    plt = _pyplot()
    series: dict[int, list[tuple[int, float]]] = {}
    for step, pairs in enumerate(log["exit_losses"]):
        for layer, kl in pairs:
            series.setdefault(int(layer), []).append((step + 1, kl))
    fig, ax = plt.subplots(figsize=(6.5, 4), dpi=120)
    for layer in sorted(series):
        steps, kls = map(np.asarray, zip(*series[layer]))
        window = min(20, len(kls))
        smooth = np.convolve(kls, np.ones(window) / window, mode="valid")
        label = "last layer" if layer == num_layers - 1 else f"exit after {layer + 1} layers"
        ax.plot(steps[window - 1 :], smooth, lw=1.6, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("KL to the original model (nats)")
    ax.set_title("LayerSkip training: KL per head")
    ax.legend(fontsize=7)
    return _save(plt, fig, path)


def save_draft_plot(losses, agreement, path: str | Path) -> Path:
    """A draft-head run's curves: the loss and, per unrolled pass, the top-1 agreement of the
    draft with the model's next token, as 20-step running means (PNG)."""
    plt = _pyplot()
    losses, agreement = np.asarray(losses, np.float64), np.asarray(agreement, np.float64).reshape(len(losses), -1)
    window = min(20, len(losses))
    steps = np.arange(window, len(losses) + 1)

    def smooth(x):
        return np.convolve(x, np.ones(window) / window, mode="valid")

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5), dpi=120)
    left.plot(steps, smooth(losses), lw=1.6)
    left.set_xlabel("step")
    left.set_ylabel("loss")
    left.set_title("draft head: loss")
    for k in range(agreement.shape[1]):
        right.plot(
            steps,
            smooth(agreement[:, k]),
            lw=1.6,
            label="on the model's features" if k == 0 else f"pass {k + 1}: on its own predictions",
        )
    right.set_xlabel("step")
    right.set_ylabel("top-1 agreement")
    right.set_title("draft head: next-token agreement")
    right.legend(fontsize=7)
    return _save(plt, fig, path)
