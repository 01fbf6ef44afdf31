"""Gantt charts of simulated steps: one row per lane (ranks that behave alike) and channel,
each compute row labelled with how busy it is, bars labelled with their micro-batch;
:func:`draw_gantt_compare` puts several schedules on one time axis."""

from __future__ import annotations

from .step import StepResult

COLORS = {
    "attn_fwd": "#4c72b0",
    "attn_bwd": "#8da0cb",
    "expert_fwd": "#dd8452",
    "expert_bwd": "#fdb87d",
    "attn_re": "#6f8fc4",  # a checkpointed EP block's forward again, in its backward
    "expert_re": "#e9a06b",
    "head": "#55a868",
    "dispatch": "#937860",
    "combine": "#c44e52",
}
CHANNELS = {"a2e": "dispatch channel", "e2a": "combine channel", "dense": "balance counts"}


def _rows(result: StepResult) -> list[str]:
    tl = result.timeline
    return sorted({t.resource for t in tl.tasks}, key=lambda r: (r in CHANNELS, r))


def _draw(ax, result: StepResult, title: str) -> None:
    tl = result.timeline
    rows = _rows(result)
    y = {r: i for i, r in enumerate(rows)}
    # one collection of bars a row: a bar per call (matplotlib's barh) took most of a plan
    # recipe's seconds on a step of a few thousand tasks
    bars: dict[str, tuple[list[tuple[float, float]], list[str]]] = {r: ([], []) for r in rows}
    for t, s, e in zip(tl.tasks, tl.start, tl.end, strict=True):
        if e <= s:
            continue
        spans, colors = bars[t.resource]
        spans.append((s, e - s))
        colors.append(COLORS.get(t.kind, "grey"))
        if t.mb >= 0 and (e - s) > result.step_time / 60:  # label bars wide enough to read
            ax.text((s + e) / 2, y[t.resource], str(t.mb), ha="center", va="center", fontsize=6, color="white")
    for r, (spans, colors) in bars.items():
        if spans:
            drawn = ax.broken_barh(spans, (y[r] - 0.4, 0.8), facecolors=colors, edgecolor="white", linewidth=0.3)
            drawn.sticky_edges.x.append(0.0)  # the axis starts at the step's start, as barh's bars held it
    labels = []
    for r in rows:
        name = CHANNELS.get(r, r.split(":", 1)[1] if ":" in r else r)
        busy = sum(width for _, width in bars[r][0])
        # the chart is one wave; the share is of the step, every wave's busy time in it
        share = result.waves * busy / result.step_time if result.step_time > 0 else 0.0
        labels.append(f"{name}  {share:.0%} busy")
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(result.step_time, color="k", lw=0.8, ls="--")
    # the dashed line is the whole step: every wave, then the optimizer
    ax.set_title(title if result.waves == 1 else f"{title}; 1 of {result.waves} waves shown", fontsize=9)


def _legend(fig) -> None:
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=k) for k, c in COLORS.items()]
    fig.legend(handles=handles, ncol=len(COLORS), fontsize=7, loc="lower center")


def draw_gantt(result: StepResult, path: str, title: str | None = None) -> str:
    """Write a PNG of ``result``'s timeline to ``path`` (matplotlib, Agg backend); bar labels
    are micro-batch numbers."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    if result.timeline is None:
        raise ValueError("draw_gantt: the result has no timeline (simulate with keep_timeline=True)")
    rows = _rows(result)
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(rows) + 1.8))
    _draw(ax, result, title or f"{result.schedule}: step {result.step_time:.3g} s, {result.tokens_per_s:,.0f} tokens/s")
    ax.set_xlabel("time (s); bar labels: micro-batch")
    _legend(fig)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draw_gantt_compare(results: dict[str, StepResult], path: str, title: str = "") -> str:
    """Several schedules of the same step, stacked on one shared time axis."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    shown = {k: r for k, r in results.items() if r.timeline is not None}
    if not shown:
        raise ValueError("draw_gantt_compare: no result has a timeline")
    heights = [len(_rows(r)) + 1 for r in shown.values()]
    fig, axes = plt.subplots(len(shown), 1, sharex=True, figsize=(12, 0.42 * sum(heights) + 1.8),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, (name, r) in zip(axes[:, 0], shown.items()):
        _draw(ax, r, f"{name}: step {r.step_time:.3g} s, {r.tokens_per_s:,.0f} tokens/s")
    axes[-1, 0].set_xlabel("time (s), shared by every schedule; bar labels: micro-batch")
    if title:
        fig.suptitle(title, fontsize=10)
    _legend(fig)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
