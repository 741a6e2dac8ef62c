"""What ``embshard train`` leaves behind: the metric history, its PNG plot and the summary.

:class:`History` records the training metrics of each progress window and the held-out metrics
of each evaluation against the step. :func:`plot_history` draws train and eval NE, AUC and loss
against steps into a PNG (matplotlib, Agg backend, imported only here). :func:`summary_lines`
is the one-screen summary, ending with the paths of the plot and the log.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["History", "plot_history", "summary_lines"]

PANELS = (
    ("ne", "normalized entropy (ratio; lower is better)"),
    ("auc", "AUC (0.5 = random; higher is better)"),
    ("loss", "log loss (nats per sample)"),
)


@dataclass
class History:
    """Metrics against steps: ``train`` per progress window, ``eval`` per evaluation."""

    train: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    eval: list[tuple[int, dict[str, float]]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "train": [{"step": s, **v} for s, v in self.train],
            "eval": [{"step": s, **v} for s, v in self.eval],
        }


def plot_history(history: History, path: Path, title: str) -> Path:
    """Draw ``history`` into the PNG ``path``; returns it."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(15, 4.5), constrained_layout=True)
    for ax, (name, label) in zip(axes, PANELS, strict=True):
        for points, style, what in (
            (history.train, "-", "train (window mean)"),
            (history.eval, "o--", "eval (held-out day)"),
        ):
            xs = [s for s, v in points if name in v]
            if xs:
                ax.plot(xs, [v[name] for _, v in points if name in v], style, label=what)
        ax.set_xlabel("training step (global batches)")
        ax.set_ylabel(label)
        ax.set_title(name.upper() if name != "loss" else "loss")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def summary_lines(s: dict[str, Any]) -> list[str]:
    """The end-of-run summary of the summary dict ``s`` (see ``train_rank``)."""
    first, final, window = s["first_window_loss"], s["final_window_loss"], s["window"]
    change = (final - first) / first * 100 if first else 0.0
    memory = ", ".join(f"rank {r} {m:.0f} MiB" for r, m in enumerate(s["peak_rss_mib"]))
    lines = [
        "",
        f"done: {s['steps']} steps, {s['steps_per_s']:.1f} steps/s, "
        f"{s['samples_per_s']:,.0f} samples/s ({s['world_size']} ranks x "
        f"{s['batch_size_per_rank']} samples, timed after the first step, without evaluation "
        "and checkpoint time)",
        f"loss: first {window} steps {first:.4f} -> last {window} steps {final:.4f} "
        f"({change:+.1f}%)",
    ]
    if "comm_wait_ms_per_step" in s:
        lines.append(
            f"rank 0 waited {s['comm_wait_ms_per_step']:.1f} ms per step on embshard's collectives "
            f"(pipeline: {s.get('pipeline', '-')})"
        )
    evals = s["history"]["eval"]
    if evals:
        a, b = evals[0], evals[-1]
        lines.append(
            f"held-out: AUC {a['auc']:.4f} -> {b['auc']:.4f}, NE {a['ne']:.4f} -> {b['ne']:.4f} "
            f"(step {a['step']} -> {b['step']}); calibration {b['calibration']:.3f}, "
            f"accuracy {b['accuracy']:.3f}"
        )
    lines.append(f"peak memory (RSS): {memory}")
    lines.append(f"data: {s['data']} | pipeline: {s['pipeline']}")
    for name in ("plot", "log", "summary_json"):
        if s.get(name):
            lines.append(f"{name.replace('_', ' ')}: {s[name]}")
    return lines
