"""Offline conversion to Hugging Face (one process, no GPU, no process group).

    python -m lightning_hetermoe.convert to-hf CKPT OUT_DIR   # a checkpoint as a Hugging Face directory
"""

from __future__ import annotations

import argparse
import sys
import time

from ..ckpt import CheckpointFormatError
from ..ckpt.consolidate import PROGRESS_EVERY_S


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_hetermoe.convert", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    h = sub.add_parser("to-hf", help="a checkpoint (sharded directory or full file) as a Hugging Face directory, "
                                     "streamed one MoE block at a time")
    h.add_argument("checkpoint")
    h.add_argument("out", help="the directory to write (config.json, safetensors shards and their index)")
    h.add_argument("--max-shard-gb", type=float, default=2.0, help="largest safetensors file (default 2)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        from .export import export_hf

        out = export_hf(args.checkpoint, args.out, int(args.max_shard_gb * (1 << 30)),
                        progress_every_s=PROGRESS_EVERY_S)
    except (CheckpointFormatError, FileNotFoundError, ValueError) as err:
        print(f"[hetermoe] {args.command}: {err}", file=sys.stderr)
        return 2
    files = sorted(p.name for p in out.glob("*.safetensors"))
    print(f"[hetermoe] wrote {out}: config.json and {len(files)} safetensors file(s), "
          f"in {time.perf_counter() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
