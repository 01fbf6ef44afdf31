"""Gantt chart of a simulated step: one row per lane (ranks that behave alike) and channel."""

from __future__ import annotations

from .step import StepResult

COLORS = {
    "attn_fwd": "#4c72b0",
    "attn_bwd": "#8da0cb",
    "expert_fwd": "#dd8452",
    "expert_bwd": "#fdb87d",
    "head": "#55a868",
    "dispatch": "#937860",
    "combine": "#c44e52",
}


def draw_gantt(result: StepResult, path: str, title: str | None = None) -> str:
    """Write a PNG of ``result``'s timeline to ``path`` (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    tl = result.timeline
    if tl is None:
        raise ValueError("draw_gantt: the result has no timeline (simulate with keep_timeline=True)")
    rows = sorted({t.resource for t in tl.tasks}, key=lambda r: (r in ("a2e", "e2a"), r))
    y = {r: i for i, r in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(12, 0.5 * len(rows) + 1.6))
    for t, s, e in zip(tl.tasks, tl.start, tl.end):
        if e <= s:
            continue
        ax.barh(y[t.resource], e - s, left=s, height=0.8, color=COLORS.get(t.kind, "grey"), edgecolor="none")
    labels = [r.split(":", 1)[1] if ":" in r else {"a2e": "dispatch ch.", "e2a": "combine ch."}.get(r, r) for r in rows]
    ax.set_yticks(range(len(rows)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    ax.set_title(title or f"{result.schedule}: step {result.step_time:.3f} s, {result.tokens_per_s:,.0f} tokens/s")
    ax.axvline(result.step_time, color="k", lw=0.8, ls="--")
    ax.legend(
        handles=[Patch(color=c, label=k) for k, c in COLORS.items()],
        ncol=7,
        fontsize=7,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.18 if len(rows) < 6 else -0.08),
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
