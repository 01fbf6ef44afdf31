"""The rows, the table and the verdict of the self-check; a check is a function of a Context."""

from __future__ import annotations

import contextlib
import io
import sys
import traceback
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

OK, FAIL, SKIPPED = "ok", "FAIL", "skipped"


@dataclass
class Row:
    check: str
    result: str  # ok, FAIL or skipped
    detail: str
    seconds: float = 0.0  # the check's wall time, its child process's start to its row


class Skip(Exception):
    """The check cannot run here; the message says why."""


class Failed(Exception):
    """The check ran and found a problem; the message is the row's detail as it stands."""


@dataclass
class Context:
    device: torch.device
    quick: bool
    workdir: str  # run directories and checkpoints of the Trainer runs

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


DEFAULT_TIMEOUT_S = 120.0  # a check's deadline unless it names its own (or --timeout overrides)


@dataclass
class Check:
    name: str
    fn: Callable[[Context], str]  # returns the detail of a passing check
    cuda_only: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S  # its child process is killed past this


def run_check(check: Check, ctx: Context) -> Row:
    if check.cuda_only and not ctx.cuda:
        return Row(check.name, SKIPPED, "no CUDA")
    try:
        # What Lightning and the strategy print (banners, the plan table) would bury the
        # table; stderr (warnings, tracebacks) stays visible.
        with contextlib.redirect_stdout(io.StringIO()):
            detail = check.fn(ctx)
    except Skip as why:
        return Row(check.name, SKIPPED, str(why))
    except Failed as problem:
        return Row(check.name, FAIL, str(problem))
    except Exception as err:  # any failure is a row; the traceback helps on the GPU day
        traceback.print_exc(file=sys.stderr)
        return Row(check.name, FAIL, f"{type(err).__name__}: {err}")
    return Row(check.name, OK, detail)


def width_for(names: Sequence[str]) -> int:
    return max([len("check")] + [len(n) for n in names])


def header(width: int) -> str:
    return (f"{'check':<{width}}  {'result':<7}  {'seconds':>7}  detail\n"
            f"{'-' * width}  {'-' * 7}  {'-' * 7}  {'-' * 6}")


def line(row: Row, width: int) -> str:
    return f"{row.check:<{width}}  {row.result:<7}  {row.seconds:>7.1f}  {row.detail}"


def render(rows: Sequence[Row]) -> str:
    width = width_for([r.check for r in rows])
    return "\n".join([header(width)] + [line(r, width) for r in rows])


def summary(rows: Sequence[Row]) -> str:
    counts = Counter(r.result for r in rows)
    verdict = "FAILED" if counts[FAIL] else "passed"
    return (f"selfcheck {verdict}: {counts[OK]} ok, {counts[FAIL]} failed, {counts[SKIPPED]} skipped "
            f"of {len(rows)} checks")


def exit_code(rows: Sequence[Row]) -> int:
    return 1 if any(r.result == FAIL for r in rows) else 0


def joined(problems: Sequence[str], most: int = 4) -> str:
    more = f"; and {len(problems) - most} more" if len(problems) > most else ""
    return "; ".join(problems[:most]) + more
