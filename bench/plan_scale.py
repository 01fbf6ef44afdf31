"""Planning at scale: how long ``make_plan`` takes from 8 to 1,024 GPUs, and how close the
plan comes to the throughput bound.

    python bench/plan_scale.py               # 8 to 1,024 GPUs, flat, on nodes and free, every shipped real model
    python bench/plan_scale.py --sizes 64,256 --models d1
    python bench/plan_scale.py --sizes 10000 --models d1 --layouts flat
    python bench/plan_scale.py --sizes 1024 --layouts flat,nodes --routing skewed

The mix is 1/8 H100, 3/8 A40 and 1/2 V100 (the new user's), as a flat list on one 100
Gbit/s link per GPU, or on nodes of 8 GPUs of one kind each (H100 on NVLink 4, A40 on PCIe
4, V100 on NVLink 2) joined by 200 Gbit/s InfiniBand per node, or flat with transfers
that cost nothing (``free``: the gap left to the bound is the schedule's). The global batch is
4 sequences per GPU (2 for the models whose experts' saved inputs do not fit 4). For each
cell: the seconds ``make_plan`` took, the zebra plan's predicted tokens/s, and that as a
fraction of the bound (every device busy on the work it is
relatively fastest at, no communication: ``simulate/bound.py``). ``--routing skewed``
plans at a measured routing instead of even (``expert_load``: per layer, expert shares drawn
from a Pareto law, seeded, as a trained model's record gives the strategy): every expert
then costs its own, and fewer ranks are alike. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from lightning_hetermoe.cluster import ClusterConfig
from lightning_hetermoe.configs import workload_model
from lightning_hetermoe.plan import make_plan
from lightning_hetermoe.plan.planner import as_cluster
from lightning_hetermoe.profile import make_timer
from lightning_hetermoe.simulate.bound import throughput_bound

MIX = (("h100", 1, "nvlink4"), ("a40", 3, "pcie4"), ("v100", 4, "nvlink2"))  # eighths, node link
# every shipped real model: tokens per sequence, sequences per GPU in the global batch (2 where
# 4 do not fit the mix's memory: Qwen3-30B-A3B's and Mixtral's experts' saved inputs bind)
MODELS = {"d1": (8192, 4), "olmoe_1b_7b": (4096, 4), "qwen3_30b_a3b": (4096, 2), "mixtral_8x7b": (4096, 2),
          "deepseek_v2_lite": (4096, 4), "qwen15_moe_a27b": (4096, 4)}
PER_NODE = 8


def mix_cluster(n: int, layout: str) -> ClusterConfig:
    counts = [(name, max(n * eighths // 8, 1), link) for name, eighths, link in MIX]
    if layout in ("flat", "free"):
        devices = [name for name, c, _ in counts for _ in range(c)]
        # free: transfers cost nothing, so what is left of the gap to the bound is the schedule's
        link = {"bandwidth_gbps": 1e9, "latency_us": 0.0} if layout == "free" else None
        return ClusterConfig(name=f"mix{n}", devices=devices, link=link)
    nodes = []
    for name, c, link in counts:
        for start in range(0, c, PER_NODE):
            nodes.append({"name": f"{name}{start // PER_NODE}", "devices": [name] * min(PER_NODE, c - start),
                          "link": link})
    return ClusterConfig(name=f"mix{n}_nodes", nodes=nodes, network="ib_hdr")


def skewed_routing(model) -> list[list[float]]:
    """Per layer, each expert's share of the routing: Pareto(1.5) weights, seed 0."""
    rng = random.Random(0)
    shares = []
    for _ in range(model.n_layers):
        w = [rng.paretovariate(1.5) for _ in range(model.moe.num_experts)]
        shares.append([x / sum(w) for x in w])
    return shares


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="8,16,64,256,1024")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--layouts", default="flat,nodes,free")
    ap.add_argument("--routing", choices=("even", "skewed"), default="even")
    args = ap.parse_args()
    rows = []
    print(f"{'model':<12} {'layout':<6} {'GPUs':>6} {'nodes':>5} {'plan s':>7} {'zebra tok/s':>13} "
          f"{'bound tok/s':>13} {'of bound':>8} {'best schedule':>20}  plan")
    for model_name in args.models.split(","):
        model, (seq_len, per_gpu) = workload_model(model_name), MODELS[model_name]
        for layout in args.layouts.split(","):
            for n in (int(x) for x in args.sizes.split(",")):
                cluster = mix_cluster(n, layout)
                world = cluster.world_size
                started = time.perf_counter()
                try:
                    plan = make_plan(cluster, model, seq_len=seq_len, global_batch_tokens=per_gpu * world * seq_len,
                                     expert_load=skewed_routing(model) if args.routing == "skewed" else None)
                except ValueError as err:
                    seconds = time.perf_counter() - started
                    print(f"{model_name:<12} {layout:<6} {world:>6} {cluster.num_nodes:>5} {seconds:>7.2f} no plan: {err}")
                    rows.append({"model": model_name, "layout": layout, "gpus": world, "nodes": cluster.num_nodes,
                                 "plan_s": seconds, "error": str(err)})
                    continue
                seconds = time.perf_counter() - started
                bound = throughput_bound(as_cluster(cluster).devices, make_timer(model, seq_len), model, seq_len,
                                         batch_tokens=per_gpu * world * seq_len)
                tps = plan.predicted["zebra"]["tokens_per_s"]
                top = max((v["tokens_per_s"] or 0, k) for k, v in plan.predicted.items())
                g0 = plan.zp_groups[0]
                shape = (f"{len(plan.zp_groups)} groups of {len(g0.attention_ranks)}+{len(g0.expert_ranks)}, "
                         f"R={plan.num_microbatches}")
                print(f"{model_name:<12} {layout:<6} {world:>6} {cluster.num_nodes:>5} {seconds:>7.2f} {tps:>13,.0f} "
                      f"{bound:>13,.0f} {tps / bound:>8.1%} {f'{top[1]} {top[0] / bound:.1%}':>20}  {shape}",
                      flush=True)
                rows.append({"model": model_name, "layout": layout, "gpus": world, "nodes": cluster.num_nodes,
                             "plan_s": seconds, "zebra_tokens_per_s": tps, "bound_tokens_per_s": bound,
                             "fraction_of_bound": tps / bound, "zp_groups": len(plan.zp_groups),
                             "attention_per_group": len(g0.attention_ranks),
                             "experts_per_group": len(g0.expert_ranks), "R": plan.num_microbatches,
                             "best_schedule": top[1], "best_fraction_of_bound": top[0] / bound})
    print(json.dumps({"rows": rows, "max_plan_s": max((r["plan_s"] for r in rows), default=None)}))


if __name__ == "__main__":
    main()
