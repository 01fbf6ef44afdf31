"""Memory per rank: measured against the prediction and against the ideal, and what fits where.

    python bench/memory.py                 # both parts (about 15 minutes on 2 cores)
    python bench/memory.py --quick         # part 1 on the base model only, part 2 as ever
    python bench/memory.py --part 2        # only the planner's table (seconds)

Part 1 runs the main job (``recipes/train.py``, 4 CPU processes) on a model of 206M
parameters (``d_model=512, n_layers=4, num_experts=32, d_ff=1024``: 3.3 GB of training
state) and on one 4x larger (128 experts: 13 GB), built on the meta device and trained with
activation checkpointing, under ep,
zebra (2xA40 + 2xV100, not emulated: the planner assigns roles) and datacentric: 3 steps,
a sharded checkpoint at the end, then a resume of that checkpoint onto another mode and
mix for 2 more steps (ep -> zebra, zebra -> datacentric, datacentric -> ep). Each rank
reports (``summary.json``, ``memory``) its peak above what the process held when the
strategy started, what it held (weights, gradients, optimizer state), and the strategy's
prediction for it. Per rank:

* ``peak / predicted``: goal within 10%;
* ``total / ideal``: the process's whole high-water mark against a bare process that
  imports the pack plus the rank's state; goal at most 1.25. For datacentric the ideal
  also counts the one layer of full experts the mode must gather to compute.

Part 2 is the planner's view of real models (OLMoE-1B-7B, Qwen1.5-MoE-A2.7B,
DeepSeek-V2-Lite, Qwen3-30B-A3B, Mixtral-8x7B) on the shipped GPU mixes at 16-mixed, 4K
tokens per sequence: for each mode the largest global batch (1M tokens halved down to
32K) that fits, its step time, the busiest rank's memory and the device's, or why nothing
fits (and how much more memory it would take).

The last line is JSON: ``worst_peak_over_predicted``, ``worst_total_over_ideal`` and every row.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from omegaconf import OmegaConf

from runs import ROOT, run_job

MODELS = {"206M": ["model.d_model=512", "model.n_layers=4", "model.n_heads=8", "model.moe.num_experts=32",
                   "model.moe.d_ff=1024"],
          "805M": ["model.d_model=512", "model.n_layers=4", "model.n_heads=8", "model.moe.num_experts=128",
                   "model.moe.d_ff=1024"]}
CLUSTER = {"ep": "cpu4", "datacentric": "cpu4", "zebra": "a40x2_v100x2"}
RESUME_ONTO = {"ep": "zebra", "zebra": "datacentric", "datacentric": "ep"}
# Built on the meta device, with activation checkpointing (as runs of real size train, and
# as the paper did): each rank's activations are its layers' inputs, not their working sets.
RUN = ["init_on_meta=true", "model.activation_checkpointing=true", "logger=none"]

REAL = ["olmoe_1b_7b", "qwen15_moe_a27b", "deepseek_v2_lite", "qwen3_30b_a3b", "mixtral_8x7b"]
MIXES = ["o1", "o2", "o3", "c1", "c2", "a40x2_v100x2", "a40x4"]
SEQ = 4096


def bare_process_gb() -> float:
    """Resident memory of a process that imported torch, Lightning and the pack."""
    code = ("import torch, lightning, lightning_hetermoe\n"
            "from lightning_hetermoe.strategy.memory_watch import rss_bytes\nprint(rss_bytes() / 1e9)")
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                cwd=ROOT).stdout.strip())


def job(model: str, mode: str, steps: int, workdir: Path, extra: list[str]) -> dict:
    return run_job([*MODELS[model], *RUN, f"cluster={CLUSTER[mode]}", f"strategy.mode={mode}",
                    f"trainer.max_steps={steps}", *extra], timeout=1800, workdir=workdir)


def rows_of(summary: dict, model: str, phase: str, mode: str, bare: float) -> list[dict]:
    out = []
    for r in summary["memory"]["ranks"]:
        held, peak, pred = r["held_gb"], r["peak_gb"], r.get("predicted_gb")
        total = r["baseline_gb"] + peak  # the process's whole high-water mark
        # data-centric must gather a layer's full experts to compute it: its irreducible working set
        gathered = r["predicted"]["layer"] if mode == "datacentric" and r.get("predicted") else 0.0
        ideal = bare + held + gathered
        out.append({"model": model, "phase": phase, "mode": mode, "rank": r["rank"], "where": r["where"],
                    "held_gb": held, "predicted_gb": pred, "peak_gb": peak, "total_gb": total, "ideal_gb": ideal,
                    "peak_over_predicted": peak / pred if pred else None, "total_over_ideal": total / ideal})
    return out


def part1(models: list[str], bare: float) -> list[dict]:
    rows = []
    for model in models:
        for mode in ("ep", "zebra", "datacentric"):
            workdir = Path(tempfile.mkdtemp(prefix=f"bench_memory_{model}_{mode}_"))
            try:
                ckpt = workdir / "ckpt"
                trained = job(model, mode, 3, workdir, [f"save_checkpoint={ckpt}"])
                rows += rows_of(trained, model, "train + save", mode, bare)
                onto = RESUME_ONTO[mode]
                resumed = job(model, onto, 5, workdir, [f"ckpt_path={ckpt}"])
                rows += rows_of(resumed, model, f"resume from {mode}", onto, bare)
                print(f"[bench] {model} {mode} -> {onto}: "
                      f"loss {trained['final_loss']:.3f} then {resumed['final_loss']:.3f}", flush=True)
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
    return rows


def part2() -> list[dict]:
    from lightning_hetermoe.cluster import ClusterConfig
    from lightning_hetermoe.configs import ModelConfig, from_cfg
    from lightning_hetermoe.plan import make_plan
    from lightning_hetermoe.profile import CostModel
    from lightning_hetermoe.profile.memory import MemoryModel

    rows = []
    for name in REAL:
        model = from_cfg(ModelConfig, OmegaConf.load(ROOT / "conf" / "model" / f"{name}.yaml"), "model")
        mem = MemoryModel(model)
        params = mem.attention_stack_params() + model.n_layers * model.moe.num_experts * mem.expert_params()
        for mix in MIXES:
            cluster = from_cfg(ClusterConfig, OmegaConf.load(ROOT / "conf" / "cluster" / f"{mix}.yaml"), "cluster")
            usable = sum(d.usable_bytes for d in cluster.specs())
            best: dict[str, dict] = {}
            reason = ""
            tokens = 1 << 20
            while tokens >= 32768 and len(best) < 3:
                try:
                    plan = make_plan(cluster, model, seq_len=SEQ, global_batch_tokens=tokens,
                                     cost_model=CostModel(precision="16-mixed"))
                except ValueError as err:
                    reason = str(err)
                    tokens //= 2
                    continue
                for mode in ("zebra", "ep", "datacentric"):
                    got = plan.predicted.get(mode, {})
                    if mode not in best and got.get("step_time_s"):
                        best[mode] = {"global_batch_tokens": plan.total_seqs * SEQ, "R": plan.num_microbatches,
                                      "step_time_s": got["step_time_s"], "tokens_per_s": got["tokens_per_s"]}
                tokens //= 2
            row = {"model": name, "params_b": params / 1e9, "mix": mix, "gpus": cluster.world_size,
                   "state_gb": params * 16 / 1e9, "usable_gb": usable / 1e9, "modes": best}
            if not best:
                row["why"] = reason.split(":")[0] if "exceed" not in reason else reason
                row["memory_short_x"] = params * 16 / usable
            rows.append(row)
    return rows


def show(rows1: list[dict], rows2: list[dict]) -> None:
    if rows1:
        print("\nPart 1: per rank (GB); peak is above the process's start, total its whole high-water mark")
        print(f"{'model':6} {'phase':22} {'mode':11} {'rank':>4} {'where':28} {'held':>6} {'pred':>6} {'peak':>6} "
              f"{'pk/pred':>7} {'total':>6} {'ideal':>6} {'tot/ideal':>9}")
        for r in rows1:
            print(f"{r['model']:6} {r['phase']:22} {r['mode']:11} {r['rank']:>4} {r['where'][:28]:28} "
                  f"{r['held_gb']:6.3f} {r['predicted_gb'] or math.nan:6.3f} {r['peak_gb']:6.3f} "
                  f"{r['peak_over_predicted'] or math.nan:7.2f} {r['total_gb']:6.3f} {r['ideal_gb']:6.3f} "
                  f"{r['total_over_ideal']:9.2f}")
    print("\nPart 2: real models on the shipped GPU mixes (16-mixed, 4K tokens per sequence, AdamW: 16 B/param, 4 more at its step)")
    for r in rows2:
        head = f"{r['model']:17} {r['params_b']:5.1f}B on {r['mix']:13} ({r['gpus']:2} GPUs, {r['usable_gb']:5.0f} GB)"
        if not r["modes"]:
            print(f"{head}: nothing fits; needs {r['state_gb']:.0f} GB of state "
                  f"({r['memory_short_x']:.2f}x the cluster's memory): {r['why'][:90]}")
            continue
        parts = [f"{m} {v['global_batch_tokens'] // 1024}K tok R={v['R']} {v['step_time_s']:.2f} s/step"
                 for m, v in r["modes"].items()]
        print(f"{head}: " + "; ".join(parts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="part 1 on the base model only")
    parser.add_argument("--part", type=int, choices=[1, 2], help="run one part only")
    args = parser.parse_args()
    rows1: list[dict] = []
    if args.part in (None, 1):
        bare = bare_process_gb()
        print(f"[bench] a bare process that imports the pack: {bare:.3f} GB", flush=True)
        rows1 = part1(["206M"] if args.quick else list(MODELS), bare)
    rows2 = part2() if args.part in (None, 2) else []
    show(rows1, rows2)
    result = {"worst_peak_over_predicted": max((r["peak_over_predicted"] or 0 for r in rows1), default=None),
              "worst_total_over_ideal": max((r["total_over_ideal"] for r in rows1), default=None),
              "part1": rows1, "part2": rows2}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
