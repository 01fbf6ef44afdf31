"""How well does an emulated heterogeneous run follow the simulator?

Runs the EP mode of the real strategy on emulated GPU mixes (one CPU process per rank,
``python recipes/train.py cluster=<emu_...>``), reads the measured wall time per training
step from ``summary.json``, and compares it with the simulator's EP prediction for the
same cluster, model and batch shape (``lightning_hetermoe.simulate.simulate_ep`` with the
emulated ranks' cost model), scaled by the cluster's ``time_scale``::

    python bench/emulation_fidelity.py                       # emu_a40_v100 and emu_a40x2_v100x2
    python bench/emulation_fidelity.py --clusters emu_a40_v100 --steps 12

Prints one line per cluster and, last, one JSON line ``{"max_rel_error": x, ...}`` where
``x = max |measured - predicted| / predicted`` over the clusters (target: <= 0.15).

What is and is not modelled: the emulated ranks pad attention+router, expert and
all-to-all transfer tasks to the cost model (forward and backward); the embedding, LM
head, loss, gradient all-reduce, optimizer step and Lightning's own loop run at real CPU
speed, while the simulator charges the head, all-reduce and optimizer at modelled device
speed. At the configured time scales those parts are a few percent of a step either way;
the JSON also gives the prediction without them (``predicted_core_s``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CLUSTERS = ("emu_a40_v100", "emu_a40x2_v100x2")


def compose_cfg(overrides: list[str]):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


class _CoreTimer:
    """The same timer with the LM head, gradient all-reduce and optimizer step free."""

    def __init__(self, timer) -> None:
        self.timer = timer

    def __getattr__(self, name):
        return getattr(self.timer, name)

    def head(self, dev, tokens):
        return 0.0

    def optimizer(self, dev, n_params):
        return 0.0

    def allreduce(self, nbytes, n_ranks, link):
        return 0.0


def predict(cfg) -> dict:
    """Simulated EP step (device seconds) for the composed train config, and its scaled wall time."""
    from lightning_hetermoe.cluster import ClusterConfig
    from lightning_hetermoe.cluster.devices import resolve_cluster
    from lightning_hetermoe.config import DataConfig, ModelConfig, from_cfg
    from lightning_hetermoe.emulate import emulation_cost_model
    from lightning_hetermoe.profile.timer import make_timer
    from lightning_hetermoe.simulate import ep_setup, simulate_step

    model = from_cfg(ModelConfig, cfg.model)
    data = from_cfg(DataConfig, cfg.data)
    cluster = from_cfg(ClusterConfig, cfg.cluster)
    devs = resolve_cluster(cluster)
    timer = make_timer(model, data.seq_len, cost=emulation_cost_model())
    # Lightning gives every rank its own batch of data.batch_size sequences, no accumulation.
    setup = ep_setup(devs, model, seq_len=data.seq_len, total_seqs=data.batch_size * len(devs), link=cluster.link,
                     timer=timer, num_microbatches=1)
    res = simulate_step(setup, timer, "ep", keep_timeline=False)
    core = simulate_step(setup, _CoreTimer(timer), "ep", keep_timeline=False)
    return {
        "predicted_device_s": res.step_time,
        "predicted_s": res.step_time * cluster.time_scale,
        # attention/expert/transfer tasks only: what the emulator pads
        "predicted_core_s": core.step_time * cluster.time_scale,
        "time_scale": cluster.time_scale,
        "devices": list(cluster.devices),
    }


def run_emulated(cluster: str, steps: int, extra: list[str], workdir: Path, timeout: float) -> dict:
    run_dir = workdir / cluster
    cmd = [sys.executable, str(ROOT / "recipes" / "train.py"), f"cluster={cluster}", f"trainer.max_steps={steps}",
           "trainer.limit_val_batches=1", "+trainer.num_sanity_val_steps=0", f"hydra.run.dir={run_dir}", *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise RuntimeError(f"emulated run on {cluster} failed with exit code {proc.returncode}")
    summary = json.loads((run_dir / "summary.json").read_text())
    log = proc.stdout + proc.stderr
    overruns = [line for line in log.splitlines() if "the emulated clock is not faithful" in line]
    summary["overrun_warnings"] = len(overruns)
    summary["first_overrun"] = overruns[0].strip()[-300:] if overruns else None
    summary["process_wall_s"] = wall
    return summary


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clusters", nargs="+", default=list(DEFAULT_CLUSTERS))
    ap.add_argument("--steps", type=int, default=10, help="training steps per run (the first is warm-up)")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per run")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run, e.g. data.batch_size=4")
    args = ap.parse_args(argv)

    rows = []
    with tempfile.TemporaryDirectory(prefix="emu_fidelity_") as tmp:
        for cluster in args.clusters:
            cfg = compose_cfg([f"cluster={cluster}", *args.overrides])
            if not cfg.cluster.emulate:
                raise SystemExit(f"cluster {cluster} is not emulated (emulate: false)")
            pred = predict(cfg)
            meas = run_emulated(cluster, args.steps, list(args.overrides), Path(tmp), args.timeout)
            measured = meas["step_time_s"]
            rel = abs(measured - pred["predicted_s"]) / pred["predicted_s"]
            row = {
                "cluster": cluster,
                "devices": pred["devices"],
                "time_scale": pred["time_scale"],
                "measured_step_s": measured,
                "measured_median_step_s": meas["step_time_median_s"],
                "predicted_step_s": pred["predicted_s"],
                "predicted_core_s": pred["predicted_core_s"],
                "predicted_device_step_ms": pred["predicted_device_s"] * 1e3,
                "rel_error": rel,
                "measured_steps": meas["steps"] - 1,
                "overrun_warnings": meas["overrun_warnings"],
                "first_overrun": meas["first_overrun"],
                "run_wall_s": meas["process_wall_s"],
            }
            rows.append(row)
            print(f"{cluster}: measured {measured:.3f} s/step, simulated EP {pred['predicted_s']:.3f} s/step "
                  f"({pred['predicted_device_s'] * 1e3:.3f} ms on the devices x {pred['time_scale']:g}), "
                  f"error {rel:.1%}" + (f", {meas['overrun_warnings']} overrun warning(s)" if meas["overrun_warnings"] else ""),
                  flush=True)
    result = {"max_rel_error": max(r["rel_error"] for r in rows), "target": 0.15, "schedule": "ep",
              "simulator": "lightning_hetermoe.simulate.simulate_step (ep_setup, R=1)", "runs": rows}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    main()
