"""Draw book/images/engine_step.png: one engine step and the chapter that builds each part.

The README and the book's introduction show it. Rerun after the step changes:

    python scripts/draw_engine_figure.py
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "book" / "images" / "engine_step.png"

# (label, detail, chapter) in the order one step runs them.
STAGES = [
    ("schedule", "who runs, how many\ntokens; preempts when\nblocks run out", "6, 7"),
    ("propose", "a draft model's\nguesses", "10"),
    ("prepare", "one typed ForwardBatch:\nslots, block tables,\nmasks", "5"),
    ("forward", "Qwen2.5 over the\npaged KV cache", "1-5"),
    ("sample", "greedy, sampling,\ngrammar masks,\nverification", "6, 9, 9b, 10"),
    ("update", "appends tokens;\nfrees or caches\nblocks (radix)", "6, 8"),
]
COLOURS = ["#4C72B0", "#8172B2", "#55A868", "#C44E52", "#DD8452", "#937860"]


def main() -> None:
    fig, ax = plt.subplots(figsize=(12, 3.6), dpi=120)
    ax.set_xlim(0, 12)
    ax.set_ylim(0, 3.6)
    ax.axis("off")
    width, gap = 1.72, 0.28
    for i, ((label, detail, chapter), colour) in enumerate(zip(STAGES, COLOURS, strict=True)):
        x = 0.2 + i * (width + gap)
        ax.add_patch(FancyBboxPatch((x, 1.3), width, 1.1, boxstyle="round,pad=0.04", fc=colour, ec="none"))
        ax.text(x + width / 2, 2.05, label, ha="center", va="center", color="white", fontsize=13, weight="bold")
        ax.text(
            x + width / 2,
            1.6,
            f"chapters {chapter}" if "," in chapter or "-" in chapter else f"chapter {chapter}",
            ha="center",
            va="center",
            color="white",
            fontsize=9,
        )
        ax.text(x + width / 2, 0.95, detail, ha="center", va="top", fontsize=9, color="#333333", linespacing=1.3)
        if i + 1 < len(STAGES):
            ax.add_patch(
                FancyArrowPatch(
                    (x + width + 0.02, 1.85), (x + width + gap - 0.02, 1.85), arrowstyle="-|>", mutation_scale=14
                )
            )
    loop = FancyArrowPatch(
        (0.2 + 5 * (width + gap) + width / 2, 2.45), (0.2 + width / 2, 2.45),
        connectionstyle="arc3,rad=0.08", arrowstyle="-|>", mutation_scale=14, color="#555555",
    )  # fmt: skip
    ax.add_patch(loop)
    ax.text(6, 3.45, "one engine step, repeated while requests remain (mini_infer.engine.LLMEngine.step)",
            ha="center", va="center", fontsize=10.5, color="#333333")  # fmt: skip
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, bbox_inches="tight", facecolor="white")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
