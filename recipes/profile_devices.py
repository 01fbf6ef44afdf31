"""Profile the configured model on each device kind of a cluster (real or emulated).

    python recipes/profile_devices.py                            # tiny model, emulated A40 + V100
    python recipes/profile_devices.py cluster=emu_a40x2_v100x2 data.seq_len=128
    torchrun --nproc-per-node 4 recipes/profile_devices.py cluster=<real mix>   # one process per GPU

Writes ``profile.json`` (a :class:`~lightning_hetermoe.profile.Profile`, what the planner
takes instead of the cost model) and ``summary.json`` (the figures beside the cost
model's) into the Hydra run directory. (Not named ``profile.py``: the script's folder is
first on ``sys.path``, and that name would shadow the standard library's ``profile``.)
"""

import json
import os
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from lightning_hetermoe.configs import ConfigError
from lightning_hetermoe.measure import profile_summary, run_profile


@hydra.main(version_base="1.3", config_path="../conf", config_name="profile")
def main(cfg: DictConfig) -> None:
    out = Path(HydraConfig.get().runtime.output_dir)
    started = time.perf_counter()
    try:
        profile = run_profile(cfg)
    except ConfigError as err:
        # A bad value is the user's to fix: one line naming the field, no stack trace.
        raise SystemExit(f"[profile] config error: {err}") from None
    if int(os.environ.get("RANK", "0")) != 0:
        return
    profile.to_json(str(out / "profile.json"))
    summary = profile_summary(profile, cfg)
    summary["wall_s"] = time.perf_counter() - started
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"[hetermoe] wrote {out / 'profile.json'} and summary.json: "
          + ", ".join(f"{k}: attn {v['attention_fwd_ms']:.3f} ms, expert {v['expert_fwd_ms']:.3f} ms"
                      for k, v in summary["devices"].items()), flush=True)


if __name__ == "__main__":
    main()
