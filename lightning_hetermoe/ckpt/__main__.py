"""Offline checkpoint tools (one process, no GPU, no process group).

    python -m lightning_hetermoe.ckpt consolidate CKPT_DIR OUT.ckpt   # a sharded checkpoint as one file

(A checkpoint as a Hugging Face directory: ``python -m lightning_hetermoe.convert to-hf``.)
"""

from __future__ import annotations

import argparse
import sys
import time

from .consolidate import PROGRESS_EVERY_S
from .dcp import CheckpointFormatError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_hetermoe.ckpt", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="a sharded checkpoint directory as one Lightning checkpoint file "
                                           "(holds the whole model in this process)")
    c.add_argument("checkpoint", help="the sharded checkpoint directory")
    c.add_argument("out", help="the file to write")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["to-hf"]:  # the Hugging Face export is a conversion: it lives with the converters
        print("[hetermoe] to-hf moved: python -m lightning_hetermoe.convert to-hf CKPT OUT_DIR [--max-shard-gb N]",
              file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        from .consolidate import consolidate

        ckpt = consolidate(args.checkpoint, args.out, progress_every_s=PROGRESS_EVERY_S)
        n = sum(t.numel() for t in ckpt["state_dict"].values())
        print(f"[hetermoe] wrote {args.out}: {len(ckpt['state_dict'])} tensors, {n / 1e6:,.1f}M elements, "
              f"{len(ckpt.get('optimizer_states', []))} optimizer state(s), "
              f"in {time.perf_counter() - started:.1f} s", flush=True)
    except (CheckpointFormatError, FileNotFoundError, ValueError) as err:
        print(f"[hetermoe] {args.command}: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
