"""One request's timeline as a picture: when each stage started and ended, when each audio chunk
was handed on, and the first token, from the timestamps the orchestrator records per request
(`metrics["timeline"]` of an output; `omni-pd generate --json` prints it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_timeline(metrics: dict[str, Any], path: str | Path, title: str = "one request") -> Path:
    """Draw `metrics` (an OmniRequestOutput's metrics) as a Gantt chart into a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timeline = metrics.get("timeline") or {}
    stages = sorted(timeline.get("stages", {}).items(), key=lambda kv: kv[1]["start_ms"])
    if not stages:
        raise ValueError("these metrics hold no timeline; they come from an OmniRequestOutput")
    chunks = timeline.get("audio_chunks_ms", [])
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.55 * (len(stages) + 1)))
    labels = []
    for row, (stage_id, span) in enumerate(stages):
        ax.barh(row, span["end_ms"] - span["start_ms"], left=span["start_ms"], height=0.5, color=f"C{row}")
        labels.append(f"stage {stage_id}: {span['name']}")
    audio_row = len(stages)
    labels.append("audio to client")
    if chunks:
        ax.scatter(
            chunks,
            [audio_row] * len(chunks),
            marker="v",
            s=60,
            color="black",
            zorder=3,
            label=f"{len(chunks)} audio chunks",
        )
    for key, style, name in (
        ("ttft_ms", "--", "first token"),
        ("ttfa_ms", ":", "first audio"),
        ("e2e_ms", "-", "end"),
    ):
        if metrics.get(key) is not None:
            ax.axvline(metrics[key], linestyle=style, color="grey", linewidth=1)
            ax.text(
                metrics[key],
                audio_row + 0.45,
                f" {name} {metrics[key]:.0f} ms",
                fontsize=8,
                va="bottom",
                rotation=0,
            )
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the request arrived")
    ax.set_title(title, fontsize=10)
    ax.set_xlim(left=0)
    ax.set_ylim(audio_row + 1.1, -0.6)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
