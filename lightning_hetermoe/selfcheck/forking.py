"""The main job's child ranks, forked once torch, Lightning and the pack are loaded
(``strategy/early_ranks.py``), on the device: those imports load no CUDA driver, and a forked
child computes on the device, its parent too after it (CUDA; a CPU run's jobs fork already).

Probed in a new interpreter: the check's own process has the device set up already, where
the recipe's rank 0 forks before anything touches it."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from .report import Context, Failed, Skip

PROBE_TIMEOUT_S = 90.0
SIDE = 256  # a SIDE x SIDE matmul of ones: every entry of the product is SIDE

PROBE = r"""
import json, os, sys, time
import lightning_hetermoe.training  # what the recipe imports before it forks its ranks
from lightning_hetermoe.strategy.early_ranks import fork_hazard
hazard = fork_hazard()
if hazard:
    print(json.dumps({"hazard": hazard}))
    sys.exit(0)
import torch
device, side = sys.argv[1], int(sys.argv[2])
def computes():
    x = torch.ones(side, side, device=device)
    return float((x @ x).sum()) == float(side) ** 3
sys.stdout.flush()
started = time.monotonic()
pid = os.fork()
if pid == 0:
    code = 1
    try:
        code = 0 if computes() else 2
    finally:
        os._exit(code)
_, status = os.waitpid(pid, 0)
child_s = time.monotonic() - started
print(json.dumps({"hazard": "", "child_code": os.waitstatus_to_exitcode(status), "child_s": child_s,
                  "parent_ok": computes()}), flush=True)
os._exit(0)  # no finalization: its collections walk every object torch and Lightning made
"""


def probe(device: str, timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, Any]:
    """Run the probe in a new interpreter; what it found (``error`` where it printed nothing)."""
    try:
        proc = subprocess.run([sys.executable, "-c", PROBE, device, str(SIDE)], capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"the probe did not end within {timeout_s:.0f} s (a forked child hung?)"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        return {"error": f"the probe exited {proc.returncode}: {tail}"}
    return json.loads(lines[-1])


def fork_verdict(found: dict[str, Any], device: str) -> str:
    """The row's detail for what :func:`probe` found; :class:`Failed` where the main job's
    ranks would not start as forks, or a fork could not compute."""
    if "error" in found:
        raise Failed(found["error"])
    if found["hazard"]:
        raise Failed(f"after the imports {found['hazard']}: the main job starts its child ranks as new "
                     "interpreters here (each imports again: seconds of CPU a rank)")
    if found["child_code"] != 0:
        raise Failed(f"a child forked after the imports exited {found['child_code']} computing on {device}")
    if not found["parent_ok"]:
        raise Failed(f"the parent computed wrongly on {device} after its fork")
    return (f"no CUDA driver after importing torch, Lightning and the pack; a forked child computed on {device} "
            f"({found['child_s']:.1f} s from the fork to its exit), its parent after it")


def check_fork_after_imports(ctx: Context) -> str:
    if not sys.platform.startswith("linux"):
        raise Skip("the main job forks its ranks on Linux only")
    device = str(ctx.device)
    return fork_verdict(probe(device), device)
