"""Tune the Triton expert kernels' tiles on this GPU and (``--write``) record the winners in
the shipped table, ``kernels/tiles.json``, for this device kind (other kinds' entries kept).

Runs Triton's autotuner (at most 3 candidates per kernel, pruned by shared memory:
``kernels.tuning.autotune_candidates``) over the forward and backward expert MLP at each
row bucket for the given shapes and dtypes, then, per (dtype, kernel, bucket), takes the
config that won for most GEMM shapes (the table is keyed by bucket, not by width). Later
runs launch those configs with no autotuning. CUDA only: elsewhere it says so and exits 0.

    python bench/tune_tiles.py --shape 4096,14336,8 --shape 2048,768,128 --dtype bf16 --write
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

TABLE = Path(__file__).resolve().parents[1] / "kernels" / "tiles.json"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", default=None, metavar="D_MODEL,D_FF,EXPERTS",
                    help="an expert layer (repeatable); default: Mixtral-8x7B's and Qwen3-30B-A3B's")
    ap.add_argument("--dtype", action="append", choices=sorted(DTYPES), default=None, help="default bf16")
    ap.add_argument("--bucket", action="append", type=int, default=None,
                    help="row buckets to tune (default: every one, kernels.tuning.tuning_buckets)")
    ap.add_argument("--activation", default="swiglu", choices=["swiglu", "gelu"])
    ap.add_argument("--write", action="store_true", help=f"record the winners in {TABLE}")
    return ap.parse_args(argv)


def winners(capability, dtype, smem) -> dict[tuple[str, int], "object"]:
    """(kernel, bucket) -> the tile most GEMM shapes picked, from the autotuners' caches."""
    from lightning_hetermoe.kernels import launch, triton_src
    from lightning_hetermoe.kernels.tiles import Tile

    out = {}
    for which, fn in (("gemm", triton_src.grouped_gemm_kernel), ("wgrad", triton_src.grouped_wgrad_kernel)):
        votes: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        for key, cfg in launch.autotuner(fn, which, capability, dtype, smem).cache.items():
            kw = cfg.kwargs
            votes[int(key[2])][Tile(kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], cfg.num_stages, cfg.num_warps,
                                    kw["GROUP"])] += 1
        for bucket, counter in votes.items():
            out[(which, bucket)] = counter.most_common(1)[0][0]
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_tiles: needs a CUDA device (none in this process); nothing tuned", flush=True)
        return 0
    from lightning_hetermoe.kernels import tiles, tuning, warm_up
    from lightning_hetermoe.kernels.availability import tf32_enabled, triton_runs_dtype
    from lightning_hetermoe.kernels.measured import device_kind

    device = torch.device("cuda", torch.cuda.current_device())
    capability = tuple(torch.cuda.get_device_capability(device))
    smem = tuning.device_smem(device)
    kind = device_kind(device)  # the tile table's key: on ROCm not the capability's NVIDIA name
    shapes = [tuple(int(v) for v in s.split(",")) for s in (args.shape or ["4096,14336,8", "2048,768,128"])]
    buckets = args.bucket or tuning.tuning_buckets()
    entries = {}
    with tuning.autotuning(True):
        for name in args.dtype or ["bf16"]:
            dtype = DTYPES[name]
            if not triton_runs_dtype(dtype, "cuda", capability, tf32_enabled()):
                print(f"{kind} {name}: runs on the torch loop here (fp32 without TF32), skipped", flush=True)
                continue
            for d_model, d_ff, experts in shapes:
                ran = warm_up(d_model, d_ff, args.activation, False, dtype, device, rows=buckets, experts=experts)
                print(f"{kind} {name} d_model={d_model} d_ff={d_ff} experts={experts}: tuned rows {ran}", flush=True)
            for (which, bucket), tile in sorted(winners(capability, dtype, smem).items()):
                entries[(name, which, bucket)] = tile
                print(f"  {name} {which} bucket {bucket}: {tile.to_json()}", flush=True)
    if args.write and entries:
        table = json.loads(TABLE.read_text(encoding="utf-8")) if TABLE.exists() else {}
        TABLE.write_text(json.dumps(tiles.with_entries(table, kind, entries), indent=1) + "\n", encoding="utf-8")
        print(f"wrote {len(entries)} entries for {kind} to {TABLE}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
