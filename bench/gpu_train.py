"""One training run for ``bench/gpu.py``: Lightning's default strategy, ``strategy="hetermoe"``
or a zebra loopback plan, on the same model, in a process of its own.

    python bench/gpu_train.py --strategy default|hetermoe|zebra --json out.json [--quick]
    python bench/gpu_train.py --strategy alternate --rounds 3 --json out.json   # default, hetermoe, in turn

The model is issue #38's: the pack's Mixtral-style decoder at d_model 1024, 8 layers, 16
experts top-2, d_ff 2816, bf16-mixed, 16 x 1024 tokens a step, 40 steps (``--quick``: a tiny
one on the CPU, to try the script without a GPU). What it writes:

- ``setup_s``: from the ``fit`` call to the first training batch (Lightning's set-up, and
  for the pack its planning, layout and kernel warm-up);
- ``step_s``: wall seconds per step over the steps after ``warm_steps`` (the device
  synchronised at both ends only: no sync inside the measured steps);
- ``peak_gb``: CUDA's peak allocation; ``final_loss``; ``schedule``: what the pack ran;
- ``work_done_at``: ``time.time()`` when ``fit`` returned, so that the caller can time how
  long the process took to exit after its work.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from typing import Any

import torch

FULL = dict(d_model=1024, n_layers=8, n_heads=16, experts=16, top_k=2, d_ff=2816, seq=1024, batch=16, steps=40,
            warm=10)
QUICK = dict(d_model=64, n_layers=2, n_heads=4, experts=4, top_k=2, d_ff=128, seq=64, batch=8, steps=6, warm=2)
STRATEGIES = ("default", "hetermoe", "zebra")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_and_data(shape: dict[str, int], accumulate: int = 1) -> tuple[Any, Any]:
    from lightning_hetermoe import ByteCorpusDataModule, DataConfig, ModelConfig, MoEConfig, MoELanguageModel, OptimConfig

    torch.manual_seed(0)
    cfg = ModelConfig(name="gpu-bench", d_model=shape["d_model"], n_layers=shape["n_layers"], n_heads=shape["n_heads"],
                      max_seq_len=shape["seq"], moe=MoEConfig(num_experts=shape["experts"], top_k=shape["top_k"],
                                                              d_ff=shape["d_ff"]))
    dm = ByteCorpusDataModule(DataConfig(seq_len=shape["seq"], batch_size=shape["batch"],
                                         train_windows=shape["batch"] * (shape["steps"] * accumulate + 1), val_windows=8))
    return MoELanguageModel(cfg, OptimConfig()), dm


def loopback_plan(shape: dict[str, int], device_kind: str, microbatches: int = 2) -> Any:
    """One rank that attends and holds every expert: zebra's exchange talks to itself, so
    what it costs over a plain single device is the schedule's own overhead."""
    from lightning_hetermoe.plan import Plan, ZPGroup

    return Plan(model="gpu-bench", cluster="loopback", seq_len=shape["seq"], devices=[device_kind],
                roles=["attention"], zp_groups=[ZPGroup(attention_ranks=[0], expert_ranks=[])], num_microbatches=microbatches,
                seqs_per_rank=[shape["batch"]], placement=[[0] * shape["experts"] for _ in range(shape["n_layers"])],
                base_counts=[[shape["experts"]] * shape["n_layers"]], schedule="zebra")


class Timing:
    """Lightning callback: set-up end, and the measured window of steps."""

    def __init__(self, warm: int, cuda: bool) -> None:
        import lightning as L

        outer = self

        class _CB(L.Callback):
            def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
                if outer.first_batch_at is None:
                    outer.first_batch_at = time.perf_counter()
                # once: under accumulate_grad_batches every batch of the step starts at this count
                if trainer.global_step == warm and outer.window_start is None:
                    outer._sync()
                    outer.window_start = time.perf_counter()

            def on_train_end(self, trainer: Any, pl_module: Any) -> None:
                outer._sync()
                outer.window_end = time.perf_counter()
                outer.steps = trainer.global_step

            def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, *args: Any) -> None:
                loss = outputs["loss"] if isinstance(outputs, dict) else outputs
                if isinstance(loss, torch.Tensor):
                    outer.last_loss = loss.detach()

        self.callback = _CB()
        self.cuda, self.warm = cuda, warm
        self.first_batch_at: float | None = None
        self.window_start: float | None = None
        self.window_end: float | None = None
        self.steps = 0
        self.last_loss: torch.Tensor | None = None

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def run(strategy_name: str, quick: bool, steps: int | None = None, *, shape: dict[str, int] | None = None,
        microbatches: int = 2, accumulate: int = 1, callbacks: list[Any] | None = None) -> dict[str, Any]:
    """One fit. ``shape`` overrides the model and batch (default FULL, QUICK with ``quick``);
    ``microbatches``: the zebra plan's R; ``accumulate``: Lightning's ``accumulate_grad_batches``
    (a step is then an optimizer step, over ``accumulate`` batches of ``shape["batch"]``);
    ``callbacks``: the fit's own besides the timing."""
    import lightning as L

    import lightning_hetermoe  # noqa: F401  (registers strategy="hetermoe")
    from lightning_hetermoe import HeterMoEStrategy

    cuda = torch.cuda.is_available() and not quick
    shape = dict(shape or (QUICK if quick else FULL), **({"steps": steps} if steps is not None else {}))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    model, dm = model_and_data(shape, accumulate)
    if strategy_name == "default":
        strategy: Any = "auto"
    elif strategy_name == "hetermoe":
        strategy = "hetermoe"
    else:
        strategy = HeterMoEStrategy(mode="zebra", plan=loopback_plan(shape, "h100" if cuda else "cpu", microbatches))
    timing = Timing(shape["warm"], cuda)
    trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, strategy=strategy, precision="bf16-mixed",
                        max_steps=shape["steps"], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, callbacks=[timing.callback, *(callbacks or [])],
                        accumulate_grad_batches=accumulate)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.fit(model, datamodule=dm)
    measured = trainer.global_step - shape["warm"]
    out = {
        "strategy": strategy_name,
        "schedule": getattr(trainer.strategy, "schedule", None) or type(trainer.strategy).__name__,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "shape": shape,
        "setup_s": (timing.first_batch_at - t0) if timing.first_batch_at else None,
        "fit_s": time.perf_counter() - t0,
        "step_s": ((timing.window_end - timing.window_start) / measured
                   if timing.window_start is not None and timing.window_end is not None and measured > 0 else None),
        "tokens_per_s": None,
        "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
        "final_loss": float(timing.last_loss) if timing.last_loss is not None else None,
    }
    if out["step_s"]:
        out["tokens_per_s"] = shape["batch"] * accumulate * shape["seq"] / out["step_s"]
    return out


def alternate(rounds: int, quick: bool) -> dict[str, Any]:
    """Lightning's default strategy and ``strategy="hetermoe"`` fitted in turn, ``rounds``
    times each, in this one process: the host's speed drifts between processes by more than
    the 3% the goal allows, so the verdict is the median of paired ratios here."""
    runs: dict[str, list[dict[str, Any]]] = {"default": [], "hetermoe": []}
    shape = QUICK if quick else FULL
    run("default", quick, steps=shape["warm"] + 1)  # the process's first fit pays its warm-up: not a pair's
    for _ in range(rounds):
        for name in runs:
            runs[name].append(run(name, quick))
    ratios = sorted(h["step_s"] / d["step_s"] for d, h in zip(runs["default"], runs["hetermoe"], strict=True)
                    if d["step_s"] and h["step_s"])
    return {"strategy": "alternate", "rounds": rounds,
            "default_step_s": [r["step_s"] for r in runs["default"]],
            "hetermoe_step_s": [r["step_s"] for r in runs["hetermoe"]],
            "hetermoe_over_default": ratios,
            "median_hetermoe_over_default": ratios[len(ratios) // 2] if ratios else None,
            "step_s": None, "setup_s": None, "peak_gb": None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--strategy", choices=STRATEGIES + ("alternate",), required=True,
                   help="alternate: default and hetermoe in turn, --rounds times each, in this process")
    p.add_argument("--rounds", type=int, default=3, help="--strategy alternate: fits of each")
    p.add_argument("--json", required=True, help="where to write the result")
    p.add_argument("--quick", action="store_true", help="a tiny model on the CPU (tries the script)")
    args = p.parse_args(argv)
    if args.strategy == "alternate":
        if args.rounds < 1:
            p.error(f"--rounds={args.rounds} is invalid: must be >= 1")
        result = alternate(args.rounds, args.quick)
    else:
        result = run(args.strategy, args.quick)
    result["work_done_at"] = time.time()
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    keys = ("strategy", "median_hetermoe_over_default", "default_step_s", "hetermoe_step_s") \
        if args.strategy == "alternate" else ("strategy", "schedule", "setup_s", "step_s", "peak_gb")
    print(json.dumps({k: result[k] for k in keys}), flush=True)
    return 0


if __name__ == "__main__":
    from lightning_hetermoe.process_exit import run_and_exit

    run_and_exit(main)  # no finalization: its collections walk every object torch and Lightning made
