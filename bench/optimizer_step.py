"""The optimizer step: torch's AdamW per parameter, multi-tensor and fused, side by side on
a rank's state.

    python bench/optimizer_step.py                       # D1's attention rank and one layer of experts, CPU
    python bench/optimizer_step.py --model olmoe_1b_7b --expert-layers 0
    python bench/optimizer_step.py --device cuda --json step.json   # on a GPU

The parameters are those of ``bench/clip_norm.py`` (every dense parameter of
``conf/model/<model>`` at full size, plus ``--expert-layers`` layers' experts), each with
a gradient, stepped by AdamW with the pack's defaults (``conf/optim/adamw.yaml``) and
weight decay on. For each implementation, after a first step (which creates the state):
the median seconds of a step over ``--repeats`` on ``--device`` (CUDA synchronised), the
bytes every aten call read and wrote (per parameter: the memory traffic a GPU streams
at its bandwidth), and the largest tensor one allocated (the step's temporaries). Then
each over the fused step. ``optim.fused=auto`` takes the fused step on a GPU; the cost
model prices a step at 36 bytes per parameter (``CostModel.optimizer_bytes_per_param``).
The last line is JSON.
"""

from __future__ import annotations

import statistics
import time

import torch

from clip_norm import Traffic, emit, rank_state, rank_state_parser
from lightning_hetermoe.configs import OptimConfig

IMPLEMENTATIONS = {"per parameter (foreach=False)": {"foreach": False}, "multi-tensor (foreach=True)": {"foreach": True},
                   "fused (fused=True)": {"fused": True}}


def make(base: list[torch.Tensor], how: dict) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
    o = OptimConfig()
    params = [torch.nn.Parameter(g.clone()) for g in base]
    for p, g in zip(params, base):
        p.grad = g.clone()
    opt = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, weight_decay=0.1, **how)
    opt.step()  # the state exists from here, as at every step after the first
    return opt, params


def main() -> None:
    args = rank_state_parser(__doc__, "d1", 3).parse_args()
    device, sync, base = rank_state(args, "parameters")
    n = sum(g.numel() for g in base)
    rows, reference = {}, None
    for name, how in IMPLEMENTATIONS.items():
        opt, params = make(base, how)
        times = []
        for _ in range(args.repeats):
            sync()
            t0 = time.perf_counter()
            opt.step()
            sync()
            times.append(time.perf_counter() - t0)
        with Traffic() as traffic:
            opt.step()
        # every implementation steps the same parameters from the same start, the same times
        landed = torch.cat([p.detach().flatten()[:4096].double() for p in params])
        reference = landed if reference is None else reference
        rows[name] = {"s": statistics.median(times), "bytes_per_param": traffic.bytes / n,
                      "largest_alloc_bytes": traffic.largest,
                      "max_abs_diff_from_first": float((landed - reference).abs().max())}
        r = rows[name]
        print(f"{name:30} {r['s'] * 1e3:9.1f} ms   {r['bytes_per_param']:5.1f} B/param moved   largest allocation "
              f"{r['largest_alloc_bytes'] / 2**20:8.1f} MiB   parameters {r['max_abs_diff_from_first']:.1e} from the "
              f"first's", flush=True)
        del opt, params
    fused = rows["fused (fused=True)"]
    ratios = {name: {"time_over_fused": r["s"] / fused["s"],
                     "bytes_over_fused": r["bytes_per_param"] / fused["bytes_per_param"]} for name, r in rows.items()}
    for name, q in ratios.items():
        print(f"  {name:30} {q['time_over_fused']:.2f}x the fused step's time, {q['bytes_over_fused']:.2f}x its bytes")
    result = {"model": args.model, "device": str(device), "elements": n, "rows": rows, "over_fused": ratios,
              "work_done_at": time.time()}
    emit(result, args.json)


if __name__ == "__main__":
    main()
