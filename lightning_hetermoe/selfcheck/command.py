"""The command line: which checks run (``registry``), each in its child process, and the report."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from typing import Sequence

import torch

from ..staging import StagedFile
from .child import run_in_child, start_server
from .registry import CHECKS, KERNEL_TIMEOUT_S
from .report import DEFAULT_TIMEOUT_S, SKIPPED, Check, Row, exit_code, header, line, summary, width_for


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
    p.add_argument("--timeout", metavar="SECONDS", type=float,
                   help="every check's deadline (default: each check's own, "
                        f"{DEFAULT_TIMEOUT_S:g} s or {KERNEL_TIMEOUT_S:g} s for the kernels)")
    return p.parse_args(argv)


def _device_kind(choice: str) -> str:
    """What the parent needs to know of the device, without initialising CUDA in it."""
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return choice


def _run_one(check: Check, args: argparse.Namespace, kind: str, workdir: str) -> Row:
    if check.cuda_only and kind != "cuda":
        return Row(check.name, SKIPPED, "no CUDA")
    print(f"[selfcheck] {check.name} ...", file=sys.stderr, flush=True)
    timeout_s = args.timeout if args.timeout is not None else check.timeout_s
    return run_in_child(check, CHECKS, kind, args.quick, workdir, timeout_s)


def run(args: argparse.Namespace, checks: Sequence[Check] = CHECKS) -> int:
    """Run ``checks`` as the command line says, each in its own child process with a
    deadline; print each row as it finishes, then the verdict; return the exit code."""
    kind = _device_kind(args.device)
    chosen = select(checks, args.only)
    if not chosen:
        print(f"selfcheck: no check's name starts with {args.only!r}; checks: "
              f"{', '.join(c.name for c in checks)}", file=sys.stderr)
        return 2
    width = width_for([c.name for c in chosen])
    if any(kind == "cuda" or not c.cuda_only for c in chosen):
        start_server()
    print(header(width), flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="hetermoe-selfcheck-") as workdir:
        for check in chosen:
            rows.append(_run_one(check, args, kind, workdir))
            print(line(rows[-1], width), flush=True)
            _write_json(args, kind, rows, complete=False)  # a run killed later keeps its rows so far
    print(summary(rows), flush=True)
    _write_json(args, kind, rows, complete=True)
    return exit_code(rows)


def _write_json(args: argparse.Namespace, kind: str, rows: list[Row], complete: bool) -> None:
    if not args.json:
        return
    device = torch.device("cuda", 0) if kind == "cuda" and torch.cuda.is_available() else torch.device(kind)
    report = {"device": str(device), "quick": args.quick, "complete": complete, "rows": [asdict(r) for r in rows]}
    with StagedFile(args.json) as tmp:  # a reader never sees half a file
        tmp.write_text(json.dumps(report, indent=2))


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))
