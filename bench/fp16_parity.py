"""How far fp16 training on 2 gloo ranks lands from one process on the same global batches.

Each mode (ep, zebra, distep) trains the tests' tiny model for ``--steps`` steps with
Lightning's fp16 plugin (``GradScaler("cpu")``, dynamic scaling from 2**16) and SGD with
momentum; the single-process reference is ``tests/reference.py::reference_fit`` with a
scaler (zebra and distep: cut into the schedule's micro-batches). Printed per mode and
seed: the relative gap ``|actual - reference| / |reference - initial|`` (norms) over all
parameters and per group (dense, router, experts), the largest per-tensor ratio of max
differences, and whether the loss scale took the same path (a step skipped on one side
only moves the weights by a whole step).

    python bench/fp16_parity.py                      # ep zebra distep, seed 7, lr 0.01
    python bench/fp16_parity.py ep --seeds 7 1 2 3 4 --lr 0.02
    python bench/fp16_parity.py --seeds 7 1 2 3 4 --noise   # and one process against itself

The gap of one seed is noisy: fp16 rounds, a last-bit change upstream flips a token's
top-k choice now and then, and the run drifts from there. Judge a change over seeds.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.plugins import MixedPrecision  # noqa: E402

from harness import run_ranks  # noqa: E402
from lightning_hetermoe import HeterMoEStrategy, OptimConfig  # noqa: E402
from reference import (ScaleHistory, data, make_model, perturbed_fit, reference_fit, relative_gap,  # noqa: E402
                       trainer)
from helpers_zebra import GLOBAL, WINDOWS, make_test_plan, pieces  # noqa: E402


class Scales(L.Callback):
    def __init__(self) -> None:
        self.history: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.history.append(float(trainer.precision_plugin.scaler.get_scale()))


def fit(rank: int, world: int, cases: list[dict], steps: int, optim: dict) -> list:
    out = []
    for case in cases:
        model = make_model(4, seed=rank + case["model_seed"], optim=OptimConfig(**optim))
        scales = Scales()
        plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
        t = trainer(HeterMoEStrategy(mode=case["mode"], plan=case.get("plan")), world, max_steps=steps,
                    plugins=[plugin], callbacks=[scales])
        t.fit(model, datamodule=data(world, GLOBAL[world], windows=WINDOWS[world], seed=case["data_seed"]))
        out.append(({k: v.clone() for k, v in model.state_dict().items()}, scales.history))
    return out


def noise_floor(seed: int, model_seed: int, steps: int, optim: dict, eps: float = 1e-7) -> float:
    """One process against itself with its initial weights scaled by 1 + eps * N(0, 1)."""
    model = make_model(4, seed=model_seed, optim=OptimConfig(**optim))
    fit = dict(global_batch=GLOBAL[2], windows=WINDOWS[2], seed=seed)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    return relative_gap(perturbed_fit(model, steps, eps, scaler=torch.amp.GradScaler("cpu"), **fit),
                        reference_fit(model, steps, scaler=torch.amp.GradScaler("cpu"), **fit), initial)


def group(name: str) -> str:
    return "experts" if ".experts." in name else "router" if ".router." in name else "dense"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("modes", nargs="*", default=["ep", "zebra", "distep"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[7], help="data seeds (model seed: 0 for 7, else the same)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--noise", action="store_true",
                    help="also one process against itself, initial weights x (1 + 1e-7 N)")
    args = ap.parse_args()
    optim = dict(name="sgd", lr=args.lr, momentum=args.momentum, warmup_steps=0)
    plan = make_test_plan(2, [0], R=2)
    cases = [dict(mode=m, plan=None if m == "ep" else plan, data_seed=s, model_seed=0 if s == 7 else s)
             for s in args.seeds for m in args.modes]
    per_rank = run_ranks(2, fit, 2, cases, args.steps, optim, timeout=60.0 * len(cases))
    for c, case in enumerate(cases):
        model = make_model(4, seed=case["model_seed"], optim=OptimConfig(**optim))
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        scaler = ScaleHistory("cpu")
        cut = pieces(plan, case["mode"]) if case["mode"] != "ep" else None
        ref = reference_fit(model, args.steps, global_batch=GLOBAL[2], windows=WINDOWS[2], seed=case["data_seed"],
                            pieces=cut, scaler=scaler)
        got, history = per_rank[0][c]
        num: dict[str, float] = {}
        den: dict[str, float] = {}
        worst = (0.0, "")
        for n, r in ref.items():
            if not r.is_floating_point():
                continue
            k = group(n)
            num[k] = num.get(k, 0.0) + float((got[n].double() - r.double()).square().sum())
            den[k] = den.get(k, 0.0) + float((r.double() - initial[n].double()).square().sum())
            moved = float((r.float() - initial[n].float()).abs().max())
            if moved > 0:
                worst = max(worst, (float((got[n].float() - r.float()).abs().max()) / moved, n))
        total = (sum(num.values()) / sum(den.values())) ** 0.5
        groups = " ".join(f"{k} {(num[k] / den[k]) ** 0.5:.4f}" for k in sorted(num) if den[k])
        same = "same scales" if history == scaler.history else \
            f"scales differ: {history} vs one process {scaler.history}"
        print(f"seed {case['data_seed']:2d} {case['mode']:6s} gap {total:.4f} ({groups}; per-tensor max "
              f"{worst[0]:.4f} {worst[1]}) {same}", flush=True)
    if args.noise:
        for s in args.seeds:
            print(f"seed {s:2d} one process, initial weights x (1 + 1e-7 N): gap "
                  f"{noise_floor(s, 0 if s == 7 else s, args.steps, optim):.4f}", flush=True)


if __name__ == "__main__":
    main()
