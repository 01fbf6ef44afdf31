"""The registry of checks and the command line."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
from dataclasses import asdict
from typing import Iterator, Sequence

import torch

from .autotuning import check_autotuning
from .clocks import check_clocks
from .collectives import check_collectives
from .environment import check_environment
from .grad_sync import check_grad_sync
from .host_syncs import check_host_syncs
from .kernel_numerics import DTYPE_NAMES, check_kernels, check_large_gemm
from .memory import check_memory
from .memory_in_r import check_memory_in_r
from .receive_order import check_receive_order
from .report import Check, Context, exit_code, render, run_checks, summary
from .streams import check_streams
from .wire_dtype import check_wire_dtype


CHECKS: list[Check] = [
    Check("environment", check_environment),
    *(Check(f"kernels {name}", check_kernels(dtype)) for dtype, name in DTYPE_NAMES.items()),
    Check("kernels 4.5M rows", check_large_gemm, cuda_only=True),
    Check("receive order", check_receive_order, cuda_only=True),
    Check("host syncs", check_host_syncs, cuda_only=True),
    Check("collectives ep", check_collectives("ep")),
    Check("collectives zebra", check_collectives("zebra")),
    Check("wire dtype", check_wire_dtype),
    Check("streams", check_streams, cuda_only=True),
    Check("clocks", check_clocks, cuda_only=True),
    Check("memory", check_memory),
    Check("memory in R", check_memory_in_r),
    Check("gradient sync memory", check_grad_sync),
    Check("autotuning", check_autotuning, cuda_only=True),
]


def select(checks: Sequence[Check], only: str | None) -> list[Check]:
    return [c for c in checks if only is None or c.name.startswith(only)]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lightning_hetermoe.selfcheck",
                                description="Check the GPU rules of lightning-hetermoe on this machine.")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: cuda if available; cpu runs what can run without a GPU (gloo, Triton's interpreter)")
    p.add_argument("--quick", action="store_true", help="smaller shapes (CI)")
    p.add_argument("--only", metavar="NAME", help="run only the checks whose name starts with NAME")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    return p.parse_args(argv)


def resolve_device(choice: str) -> torch.device:
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device("cuda", torch.cuda.current_device()) if choice == "cuda" and torch.cuda.is_available() \
        else torch.device(choice)


@contextlib.contextmanager
def _environment(device: torch.device) -> Iterator[None]:
    """For the checks' duration: Triton's interpreter on CPU (the kernels read the variable
    per launch, so a scoped setting is enough), and Lightning's banners muted."""
    saved = os.environ.get("TRITON_INTERPRET")
    if device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    loggers = [logging.getLogger(n) for n in ("lightning", "lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


def run(args: argparse.Namespace, checks: Sequence[Check] = CHECKS) -> int:
    """Run ``checks`` as the command line says, print the table, return the exit code."""
    device = resolve_device(args.device)
    chosen = select(checks, args.only)
    if not chosen:
        print(f"selfcheck: no check's name starts with {args.only!r}; checks: "
              f"{', '.join(c.name for c in checks)}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="hetermoe-selfcheck-") as workdir, _environment(device):
        rows = run_checks(chosen, Context(device=device, quick=args.quick, workdir=workdir))
    print(render(rows))
    print(summary(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "quick": args.quick, "rows": [asdict(r) for r in rows]}, f, indent=2)
    return exit_code(rows)


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))
