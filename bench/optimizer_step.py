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
model prices the clipped step at 36 bytes per parameter there, and every optimizer the
``optim`` config names at its own count (``optimizer_step_traffic``).

Then the fused step behind gradient clipping at 1.0 (it binds: the gradients' norm is in
the hundreds), as the strategy clips: the global norm (``strategy/grad_norm.py``), then
either every gradient scaled by ``clip / norm`` before the step (Lightning's way, and the
strategy's under a loss scaler) or the coefficient handed to the fused step as its
gradient divisor (``fold_into_step``: the strategy's way without one). Both leave the same
clipped gradients behind; the parameters are compared. The byte count takes every tensor
an operation may write as written: the fused step's gradients count as written with or
without a divisor, though without one the step leaves them alone (on a GPU: 28 bytes per
parameter, so the scaled clip moves 40 where the count says 44; the folded clip's 36 are
what it moves). Then the same under 16-mixed's loss scale (the gradients scaled by
2^16): unscaled (``GradScaler.unscale_``: a pass with the overflow check), scaled by the
clip and stepped, beside all of it in the fused step (``AgreedGradScaler.unscale_in_step_``:
the norm of the scaled gradients gives the clip and the overflow verdict). The last line is
JSON.
"""

from __future__ import annotations

import statistics
import time

import torch

from clip_norm import CLIP, Traffic, emit, rank_state, rank_state_parser
from lightning_hetermoe.configs import OptimConfig
from lightning_hetermoe.strategy.grad_norm import clip_, squared_norm, unfold
from lightning_hetermoe.strategy.precision import AgreedGradScaler

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


def clipped(fold: bool):
    """The clip, then the fused step: the gradients scaled first, or the clip folded in."""
    def step(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], base: list[torch.Tensor]) -> None:
        for p, g in zip(params, base):
            p.grad.copy_(g)  # the same unclipped gradients at every step (outside the timing)
        yield
        clip_(opt, [p.grad for p in params], squared_norm((p.grad for p in params), params[0].device).sqrt(), CLIP, fold)
        opt.step()
        unfold(opt)
    return step


LOSS_SCALE = 2.0 ** 16


def loss_scaled(fold: bool):
    """16-mixed: the gradients carry the loss scale; unscaled, clipped by scaling and stepped
    (``unscale_`` first, as Lightning's clip needs), or unscaled and clipped in the fused step
    (``AgreedGradScaler.unscale_in_step_``). The scaler's ``step`` and ``update`` each time."""
    def step(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], base: list[torch.Tensor]) -> None:
        scaler = AgreedGradScaler(params[0].device.type, init_scale=LOSS_SCALE)
        scaler.scale(torch.zeros((), device=params[0].device))  # the scale exists, as after a scaled backward
        for p, g in zip(params, base):
            p.grad.copy_(g).mul_(LOSS_SCALE)  # as a scaled backward leaves them (outside the timing)
        yield
        if fold:
            scaler.unscale_in_step_(opt, squared_norm((p.grad for p in params), params[0].device).sqrt(), CLIP)
        else:
            scaler.unscale_(opt)
            clip_(opt, [p.grad for p in params], squared_norm((p.grad for p in params), params[0].device).sqrt(), CLIP,
                  fold=False)
        scaler.step(opt)
        scaler.update()
    return step


def plain(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], base: list[torch.Tensor]):
    yield
    opt.step()


CLIPPED = {"fused, clip scaled first": clipped(False), "fused, clip folded in": clipped(True)}
SCALED = {"16-mixed: unscale, scale, step": loss_scaled(False), "16-mixed: all in the step": loss_scaled(True)}


def timed(opt, params, base, step, repeats: int, sync) -> tuple[float, Traffic]:
    """Median seconds of ``step`` over ``repeats``, and one more step's traffic (each
    ``step`` a generator: what comes before its ``yield`` is set-up, not timed)."""
    times = []
    for _ in range(repeats):
        run = step(opt, params, base)
        next(run)
        sync()
        t0 = time.perf_counter()
        next(run, None)
        sync()
        times.append(time.perf_counter() - t0)
    run = step(opt, params, base)
    next(run)
    with Traffic() as traffic:
        next(run, None)
    return statistics.median(times), traffic


def main() -> None:
    args = rank_state_parser(__doc__, "d1", 3).parse_args()
    device, sync, base = rank_state(args, "parameters")
    n = sum(g.numel() for g in base)
    rows, reference = {}, None
    cases = [(name, how, plain) for name, how in IMPLEMENTATIONS.items()]
    cases += [(name, {"fused": True}, step) for name, step in {**CLIPPED, **SCALED}.items()]
    for name, how, step in cases:
        if name in (next(iter(CLIPPED)), next(iter(SCALED))):
            reference = None  # the clipped steps land elsewhere: compared with each other
        opt, params = make(base, how)
        seconds, traffic = timed(opt, params, base, step, args.repeats, sync)
        # every implementation steps the same parameters from the same start, the same times
        landed = torch.cat([p.detach().flatten()[:4096].double() for p in params])
        reference = landed if reference is None else reference
        rows[name] = {"s": seconds, "bytes_per_param": traffic.bytes / n,
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
    folds = {}
    for what, pair in (("clip", CLIPPED), ("16-mixed", SCALED)):
        first, folded = (rows[name] for name in pair)
        folds[what] = {"time_first_over_folded": first["s"] / folded["s"],
                       "bytes_first_over_folded": first["bytes_per_param"] / folded["bytes_per_param"]}
        print(f"  {what}: the separate passes take {folds[what]['time_first_over_folded']:.2f}x the folded step's "
              f"time, {folds[what]['bytes_first_over_folded']:.2f}x its bytes")
    result = {"model": args.model, "device": str(device), "elements": n, "rows": rows, "over_fused": ratios,
              "clip": CLIP, "loss_scale": LOSS_SCALE, "folds": folds, "work_done_at": time.time()}
    emit(result, args.json)


if __name__ == "__main__":
    from lightning_hetermoe.process_exit import run_and_exit

    run_and_exit(main)  # no finalization: its collections walk every object torch and Lightning made
