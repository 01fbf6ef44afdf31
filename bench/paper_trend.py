"""The paper's 2xA40+2xV100 vs 4xA40 comparison, taken apart (docs/paper_trend.md).

    python bench/paper_trend.py [--seq-lens 4096 8192 16384 32768]

For each sequence length: HeterMoE's plan on a40x2_v100x2 and EP on a40x4 (the paper's
baseline), both on D1 with 8 experts at fp16 (the paper's setting) and 1M tokens/step.
Prints the unit costs the datasheets bear on (A40:V100 on one expert GEMM pass and on one
attention micro-batch), then each schedule's busy time per rank by task kind (attention
forward/backward, experts, LM head), the exchange channels' busy time, the step tail
(gradient sync + optimizer), the step time and the ratio. Seconds. A few seconds on a CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from omegaconf import OmegaConf  # noqa: E402

from lightning_hetermoe.cluster import ClusterConfig, get_device  # noqa: E402
from lightning_hetermoe.configs import ModelConfig, from_cfg  # noqa: E402
from lightning_hetermoe.plan import as_cluster, make_plan  # noqa: E402
from lightning_hetermoe.profile import CostModel, make_timer  # noqa: E402
from lightning_hetermoe.simulate import build_tasks, simulate_plan  # noqa: E402
from lightning_hetermoe.simulate.schedules import plan_setup  # noqa: E402

CONF = os.path.join(os.path.dirname(HERE), "conf")
COST = CostModel(precision="16-mixed")
TOKENS = 1 << 20


def load(group: str, name: str):
    return OmegaConf.to_container(OmegaConf.load(os.path.join(CONF, group, f"{name}.yaml")), resolve=True)


def unit_ratios(model: ModelConfig, seq_len: int) -> dict:
    """V100 time / A40 time on one expert (8K tokens, forward) and one attention micro-batch
    (two sequences, forward): what the datasheets and the paper's ratios speak to."""
    a40, v100 = get_device("a40"), get_device("v100")
    timer = make_timer(model, seq_len, cost=COST)
    tok = 2 * seq_len
    return {"expert": timer.expert(v100, 8192) / timer.expert(a40, 8192),
            "attention": timer.attention(v100, tok) / timer.attention(a40, tok)}


def breakdown(cluster_name: str, model: ModelConfig, seq_len: int, schedule: str) -> dict:
    cluster = from_cfg(ClusterConfig, load("cluster", cluster_name))
    view = as_cluster(cluster)
    plan = make_plan(cluster, model, seq_len=seq_len, global_batch_tokens=TOKENS, shrink_to_fit=2, cost_model=COST,
                     max_microbatches=16)
    timer = make_timer(model, seq_len, cost=COST)
    res = simulate_plan(plan, view.devices, model, view.topology, timer, schedule=schedule, keep_timeline=True)
    busy: dict[str, dict[str, float]] = {}
    for t, s, e in zip(res.timeline.tasks, res.timeline.start, res.timeline.end):
        busy.setdefault(t.resource, {}).setdefault(t.kind, 0.0)
        busy[t.resource][t.kind] += e - s
    tails = {}
    if schedule in ("zebra", "distep"):
        _, _, tails, _ = build_tasks(plan_setup(plan, view.devices, model, view.topology, schedule=schedule), timer)
    return {"plan": plan, "result": res, "busy": busy, "tails": tails}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    args = ap.parse_args(argv)
    model = replace(from_cfg(ModelConfig, load("model", "d1_8e")), activation_checkpointing=True)  # as the paper trained
    for s in args.seq_lens:
        u = unit_ratios(model, s)
        mix = breakdown("a40x2_v100x2", model, s, "zebra")
        ref = breakdown("a40x4", model, s, "ep")
        p = mix["plan"]
        print(f"== {s // 1024}K  V100/A40 time: expert {u['expert']:.2f}x, attention micro-batch {u['attention']:.2f}x;"
              f"  mix plan: roles {p.roles}, R={p.num_microbatches}, offloaded {sum(p.offloaded())}, "
              f"batch {p.global_batch_tokens:,} in {p.waves} wave(s) (busy times below: one wave)")
        for label, b in (("zebra a40x2_v100x2", mix), ("ep a40x4", ref)):
            r = b["result"]
            print(f"  {label}: step {r.step_time:.3f} s, {r.tokens_per_s:,.0f} tok/s")
            for res_name, kinds in sorted(b["busy"].items()):
                parts = ", ".join(f"{k} {v:.3f}" for k, v in sorted(kinds.items()))
                print(f"    {res_name:24s} {parts}")
            for res_name, tail in b["tails"].items():
                print(f"    tail {res_name:19s} {tail:.3f}")
        print(f"  ratio zebra(mix) / ep(a40x4) = {mix['result'].tokens_per_s / ref['result'].tokens_per_s:.3f}")


if __name__ == "__main__":
    main()
