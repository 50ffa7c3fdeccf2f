"""The loss-curve PNG: training loss per logged step, held-out loss per evaluation, the unigram line."""

from __future__ import annotations

from pathlib import Path


def plot_loss_curve(
    train: list[tuple[int, float]],
    heldout: list[tuple[int, float]],
    unigram_loss: float,
    path: Path,
    title: str,
) -> None:
    """Write ``path``; needs matplotlib, which only training uses (``pip install -e '.[train]'``)."""
    try:
        import matplotlib
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            "plotting the loss curve needs matplotlib: pip install -e '.[train]' (or pip install matplotlib)"
        ) from e
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    ax.plot(*zip(*train, strict=True), lw=1, color="tab:blue", label="train loss")
    if heldout:
        ax.plot(*zip(*heldout, strict=True), "o-", ms=4, color="tab:red", label="held-out loss")
    ax.axhline(unigram_loss, ls="--", color="gray", label=f"unigram baseline ({unigram_loss:.2f})")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(0, max(unigram_loss + 1, min(max(loss for _, loss in train), 10)))
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
