"""The planner's plan against a brute force over every layout, on the paper's configurations.

    python bench/plan_brute_force.py                          # C1, C2, O1-O3: about 7 minutes
    python bench/plan_brute_force.py --clusters c2 --models w1 --seq-lens 16384

For each configuration ``recipes/paper.py`` plans (its clusters, models and sequence
lengths, fp16, every block checkpointed, up to 16 micro-batches and 4 waves, the batch
halved where it does not fit), ``make_plan`` plans it; then every set of attention ranks
(how many of each device kind attend, kinds alike within) is searched over every group
count and R (``plan_for_batch``'s ``_splits``: that set alone) at the batch the plan
planned, in 1, 2 and 4 waves (more waves only while the last count's activations bind a
member's experts, as the planner does: otherwise a wave adds only a pipeline fill and
drain). Prints each configuration's planned zebra tokens/s, the brute force's best and
their ratio (> 1: the search missed a faster layout), with the layout that won; the last
line is JSON with the worst ratio and the configurations missed by more than 0.1%.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from dataclasses import replace

from omegaconf import OmegaConf

from lightning_hetermoe.cluster import ClusterConfig
from lightning_hetermoe.configs import ModelConfig, from_cfg
from lightning_hetermoe.plan import make_plan
from lightning_hetermoe.plan.planner import activations_bind, plan_for_batch
from lightning_hetermoe.profile import CostModel

CONF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
COST = CostModel(precision="16-mixed")  # as recipes/paper.py prices the paper's fp16
MISSED = 1e-3  # a brute force more than this much faster: a layout the search missed (below: rounding)
PLAN = dict(seq_len=0, asym_ea=True, cost_model=COST, ep_groups="world", max_microbatches=16,
            schedules=("zebra",))


def load(group: str, name: str) -> dict:
    cfg = OmegaConf.load(os.path.join(CONF, group, f"{name}.yaml"))
    cfg.pop("hydra", None)  # the run directory's ${now:...} resolves only under Hydra
    return OmegaConf.to_container(cfg, resolve=True)


def zebra_rate(plan) -> float:
    return plan.predicted["zebra"]["tokens_per_s"]


def brute_force(cluster: ClusterConfig, model: ModelConfig, seq_len: int, tokens: int) -> tuple[float, str]:
    """The fastest zebra tokens/s over every set of attention ranks and wave count, and its layout."""
    kinds = sorted(set(cluster.devices))
    counts = [cluster.devices.count(k) for k in kinds]
    best, layout = 0.0, ""
    for vec in itertools.product(*(range(c + 1) for c in counts)):
        if not sum(vec):
            continue
        for waves in (1, 2, 4):
            if (tokens // seq_len) % waves:
                continue
            try:
                p = plan_for_batch(cluster, model, global_batch_tokens=tokens, waves=waves, _splits=[vec],
                                   **{**PLAN, "seq_len": seq_len})
            except ValueError:
                continue  # fewer sequences in flight may fit
            if zebra_rate(p) > best:
                best = zebra_rate(p)
                attending = " + ".join(f"{n} {k}" for k, n in zip(kinds, vec) if n)
                layout = f"{attending} attending, {len(p.zp_groups)} group(s), R={p.num_microbatches}, {waves} wave(s)"
            if not activations_bind(p, cluster, model):
                break  # another wave would only add a pipeline fill and drain
    return best, layout


def main() -> None:
    paper = load("", "paper")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clusters", default=",".join(paper["clusters"]))
    ap.add_argument("--models", default=",".join(paper["models"]))
    ap.add_argument("--seq-lens", default=",".join(str(s) for s in paper["seq_lens"]))
    args = ap.parse_args()
    rows = []
    for c in args.clusters.split(","):
        cluster = from_cfg(ClusterConfig, load("cluster", c))
        for m in args.models.split(","):
            model = replace(from_cfg(ModelConfig, load("model", m)), activation_checkpointing=True)
            for s in (int(x) for x in args.seq_lens.split(",")):
                started = time.perf_counter()
                try:
                    plan = make_plan(cluster, model, global_batch_tokens=int(paper["global_batch_tokens"]),
                                     shrink_to_fit=2, max_waves=int(paper["max_waves"]), **{**PLAN, "seq_len": s})
                except ValueError as err:
                    print(f"{c} {m} {s}: no plan ({err})", flush=True)
                    continue
                best, layout = brute_force(cluster, model, s, plan.global_batch_tokens)
                ratio = best / zebra_rate(plan)
                rows.append({"cluster": c, "model": m, "seq_len": s, "planned": zebra_rate(plan), "brute_force": best,
                             "ratio": ratio, "layout": layout})
                print(f"{c} {m} {s}: planned {zebra_rate(plan):,.0f} tok/s, brute force {best:,.0f} ({ratio:.3f}x: "
                      f"{layout}), {time.perf_counter() - started:.0f} s", flush=True)
    worst = max(rows, key=lambda r: r["ratio"], default=None)
    print(json.dumps({"rows": rows, "worst_ratio": worst["ratio"] if worst else None,
                      "missed": [r for r in rows if r["ratio"] > 1 + MISSED]}))


if __name__ == "__main__":
    main()
