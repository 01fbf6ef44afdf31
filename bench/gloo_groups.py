"""Gloo groups built with every pair connected at once (gloo's default) beside connected on
first use (``TORCH_GLOO_LAZY_INIT=1``, what the strategy sets), side by side in one run.

    python bench/gloo_groups.py                 # 16 CPU processes, about 10 s
    python bench/gloo_groups.py --world 32

Each contender starts ``--world`` processes that build the default group and two more
world-wide gloo groups (the pack's host groups are as wide), then run an all-reduce and an
all-gather on one of them. Per contender: rank 0's open file descriptors after building and
after the collectives, and the slowest rank's seconds to build; the ratio eager / lazy (on
2 cores and 32 processes it varied from 0.52x to 1.36x run to run: the descriptors are the
measure here). The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from gloo_ranks import run_ranks


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rank(rank: int, world: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    start = time.perf_counter()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    groups = [dist.new_group(list(range(world)), backend="gloo") for _ in range(2)]
    built_s, built = time.perf_counter() - start, _fds()
    x = torch.ones(4)
    dist.all_reduce(x, group=groups[0])
    out: list = [None] * world
    dist.all_gather_object(out, rank, group=groups[0])
    dist.barrier()
    queue.put((rank, built, _fds(), built_s))
    dist.barrier()
    dist.destroy_process_group()


def contender(world: int, lazy: bool) -> dict:
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1" if lazy else "0"  # the spawned processes read it
    rows = sorted(run_ranks(_rank, world, timeout_s=300))  # rank 0's first
    return {"fds_built": rows[0][1], "fds_used": rows[0][2], "build_s": max(r[3] for r in rows)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=16, help="processes (default 16)")
    args = ap.parse_args(argv)
    if args.world < 2:
        ap.error(f"--world={args.world}: at least 2 processes")
    before = os.environ.get("TORCH_GLOO_LAZY_INIT")
    try:
        res = {"eager": contender(args.world, False), "lazy": contender(args.world, True)}
    finally:
        os.environ.pop("TORCH_GLOO_LAZY_INIT", None) if before is None else os.environ.update(
            TORCH_GLOO_LAZY_INIT=before)
    for name, r in res.items():
        print(f"{name:5}: rank 0 holds {r['fds_built']} descriptors built, {r['fds_used']} after an all-reduce and "
              f"an all-gather; built in {r['build_s']:.2f} s (slowest rank)", flush=True)
    out = {"world": args.world, **res, "build_eager_over_lazy": res["eager"]["build_s"] / res["lazy"]["build_s"]}
    print(f"{args.world} ranks: eager / lazy set-up {out['build_eager_over_lazy']:.2f}x")
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
