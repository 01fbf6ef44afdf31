"""The largest global batch that plans, per real model and GPU mix (issue 41, item 1).

For each model in conf/model and each mix (the shipped o1, o2, o3, c1, c2 and A40+V100
halves of 16, 32 and 64 GPUs): the most sequences of 4,096 tokens the planner plans
(``largest_batch``: the memory model over every layout, doubling then bisection over the
batch), the zebra plan's predicted tokens/s at that batch (``make_plan``), and the wall
seconds of both searches. Activation checkpointing on; the dense optimizer state priced as
the strategy's defaults run it (sharded over the attention ranks for every model here but
d1, whose training state is small). "-": not one sequence fits.

    python bench/plan_batches.py            # the README table (about 3 minutes on 2 cores)
    python bench/plan_batches.py --models d1 --mixes o1,mix16
"""

from __future__ import annotations

import argparse
import json
import os
import time

import yaml

from lightning_hetermoe.cluster import ClusterConfig
from lightning_hetermoe.configs import ModelConfig, from_cfg
from lightning_hetermoe.plan import largest_batch, make_plan

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
MODELS = ("mixtral_8x7b", "qwen3_30b_a3b", "deepseek_v2_lite", "olmoe_1b_7b", "d1")
MIXES = ("o1", "o2", "o3", "c1", "c2", "mix16", "mix32", "mix64")
SEQ_LEN = 4096


def load_model(name: str) -> ModelConfig:
    with open(os.path.join(ROOT, "conf", "model", f"{name}.yaml")) as f:
        return from_cfg(ModelConfig, {**yaml.safe_load(f), "activation_checkpointing": True})


def load_mix(name: str) -> ClusterConfig:
    if name.startswith("mix"):
        n = int(name[3:])
        return ClusterConfig(name=name, devices=["a40"] * (n // 2) + ["v100"] * (n - n // 2))
    with open(os.path.join(ROOT, "conf", "cluster", f"{name}.yaml")) as f:
        return from_cfg(ClusterConfig, yaml.safe_load(f))


def describe(cluster: ClusterConfig) -> str:
    kinds = sorted(set(cluster.devices), key=cluster.devices.index)
    return " + ".join(f"{cluster.devices.count(k)} {k.upper()}" for k in kinds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--mixes", default=",".join(MIXES))
    ap.add_argument("--json", default="", help="also write the rows here")
    args = ap.parse_args()
    rows = []
    print(f"| model | mix | GPUs | largest batch (seqs of {SEQ_LEN}) | tokens | zebra tokens/s | plan "
          f"(groups x attention+expert, R) | search s |")
    print("|---|---|---:|---:|---:|---:|---|---:|")
    for model_name in args.models.split(","):
        model = load_model(model_name)
        for mix in args.mixes.split(","):
            cluster = load_mix(mix)
            started = time.perf_counter()
            n = largest_batch(cluster, model, seq_len=SEQ_LEN)
            row = {"model": model_name, "mix": mix, "gpus": cluster.world_size, "largest_seqs": n}
            if n:
                plan = make_plan(cluster, model, seq_len=SEQ_LEN, global_batch_tokens=n * SEQ_LEN)
                g0 = plan.zp_groups[0]
                row.update(tokens_per_s=plan.predicted["zebra"]["tokens_per_s"], zp_groups=len(plan.zp_groups),
                           attention=len(g0.attention_ranks), experts=len(g0.expert_ranks), R=plan.num_microbatches)
            row["seconds"] = time.perf_counter() - started
            rows.append(row)
            shape = (f"{row['zp_groups']} x {row['attention']}+{row['experts']}, R={row['R']}" if n else "-")
            tps = f"{row['tokens_per_s']:,.0f}" if n else "-"
            print(f"| {model_name} | {mix} ({describe(cluster)}) | {cluster.world_size} | {n or '-'} | "
                  f"{n * SEQ_LEN:,} | {tps} | {shape} | {row['seconds']:.1f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seq_len": SEQ_LEN, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
