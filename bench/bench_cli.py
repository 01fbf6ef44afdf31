"""What the benchmarks' command lines share (no torch here: a bench sets its threads before
torch is imported): a list of R values read from a flag, and the result written and printed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable


def microbatch_values(p: argparse.ArgumentParser, text: str, ok: Callable[[int], bool] = lambda r: r >= 1,
                      rule: str = "be >= 1") -> list[int]:
    """``--microbatches`` as integers, each passing ``ok`` (else ``p.error`` naming ``rule``)."""
    try:
        rs = [int(r) for r in text.split(",")]
    except ValueError:
        p.error(f"--microbatches={text!r} is invalid: give integers >= 1, e.g. 1,2")
    if any(r < 1 or not ok(r) for r in rs):
        p.error(f"--microbatches={text!r} is invalid: every R must {rule}")
    return rs


def emit(result: Any, json_path: str | None) -> int:
    """The result as the last line of output (and in ``json_path``, indented, if given)."""
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0
