"""The routing warm-up at set-up dealt over the ranks (each forwards its share of every
sampled batch, the counts summed in one all-reduce) against rank 0 forwarding every chunk
alone while the others wait (the set-up before), and against the same deal with one forward
a chunk (each rank's small chunks not merged: ``MERGE_TOKENS`` 0, the set-up before that
change), side by side in one run.

    python bench/warmup_deal.py                     # 2 CPU processes, about a minute
    python bench/warmup_deal.py --world 2 --rounds 3 --d-model 256
    python bench/warmup_deal.py --seq 16 --per-rank 4 --d-model 32 --layers 2 --experts 8 --samples 128  # tiny

``--world`` processes over gloo, each computing on its share of this machine's cores (its
"device": those of the ranks that wait stay idle, as their GPUs would). Every contender
samples the same batches through the same model and must give the same shares (checked);
per contender the median wall seconds of the warm-up on rank 0, the tokens and forwards
rank 0 ran, and the ratios alone / dealt and chunk by chunk / dealt. Rank 0's forwards drop
by the world size; its wall time by less where the cores are shared (2 ranks on 2 cores).
Merging pays where a chunk is small (a few thousand tokens: a tiny model's, or a short
sequence's); past ``MERGE_TOKENS`` a chunk a forward, both the same. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from types import SimpleNamespace
from typing import Any

from gloo_ranks import run_ranks


def _trainer(dataset: Any, per_rank: int) -> Any:
    """What :func:`warmup_routing` reads of a trainer: the fitting stage's loader."""
    import torch
    from lightning.pytorch.trainer.states import TrainerFn

    loader = torch.utils.data.DataLoader(dataset, batch_size=per_rank)
    loop = SimpleNamespace(_data_source=SimpleNamespace(dataloader=lambda: loader))
    return SimpleNamespace(state=SimpleNamespace(fn=TrainerFn.FITTING), fit_loop=loop, validate_loop=None,
                           test_loop=None, predict_loop=None)


def _rank(rank: int, world: int, port: int, out: Any, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from lightning_hetermoe import ModelConfig, MoEConfig, MoELanguageModel, MoELayer, OptimConfig, comm
    from lightning_hetermoe.strategy import routing_warmup as warmup
    from lightning_hetermoe.strategy.routing_warmup import warmup_routing

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    comm.configure(torch.device("cpu"))
    torch.manual_seed(0)  # every rank the same model: the strategy broadcasts rank 0's first
    cfg = ModelConfig(vocab_size=256, d_model=args.d_model, n_layers=args.layers, n_heads=4, max_seq_len=args.seq,
                      moe=MoEConfig(num_experts=args.experts, top_k=2, d_ff=2 * args.d_model, expert_backend="torch"))
    model = MoELanguageModel(cfg, OptimConfig())
    first = next(m for m in model.modules() if isinstance(m, MoELayer))
    gen = torch.Generator().manual_seed(1)
    samples = [(t, t) for t in torch.randint(0, 256, (args.samples, args.seq), generator=gen)]
    trainer = _trainer(samples, args.per_rank)
    # a rank's device is its share of the cores, as each GPU is its rank's alone: the cores of
    # the ranks that wait stay idle, as their GPUs would
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    times: dict[str, list[float]] = {"alone": [], "dealt": [], "chunked": []}
    tokens: dict[str, int] = {}
    forwards: dict[str, int] = {}
    merge_tokens = warmup.MERGE_TOKENS
    shares: dict[str, Any] = {}
    for _ in range(args.rounds):
        for name in times:
            alone = name == "alone"
            seen: list[int] = []  # the tokens of each forward rank 0 ran
            hook = first.register_forward_pre_hook(lambda mod, a: seen.append(a[0].shape[:-1].numel()))
            warmup.MERGE_TOKENS = 0 if name == "chunked" else merge_tokens
            dist.barrier()
            start = time.perf_counter()
            if alone:  # rank 0 forwards every chunk; the others wait for its answer
                got = warmup_routing(model, trainer, args.per_rank, args.per_rank * world) if rank == 0 else None
                box = [got]
                dist.broadcast_object_list(box, src=0)
                got = box[0]
            else:
                got = warmup_routing(model, trainer, args.per_rank, args.per_rank * world, None, rank, world)
            times[name].append(time.perf_counter() - start)
            hook.remove()
            warmup.MERGE_TOKENS = merge_tokens
            tokens[name], forwards[name], shares[name] = sum(seen), len(seen), got
    if rank == 0:
        out.put({"times": times, "tokens": tokens, "forwards": forwards, "batches": len(shares["dealt"] or []),
                 "same": shares["alone"] == shares["dealt"] == shares["chunked"]})
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2, help="processes (default 2)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each contender, alternated (default 3)")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256, help="tokens per sequence (default 256)")
    ap.add_argument("--per-rank", type=int, default=16, help="sequences per rank's share (default 16)")
    ap.add_argument("--samples", type=int, default=512, help="sequences in the dataset (default 512)")
    args = ap.parse_args(argv)
    if args.world < 2 or args.rounds < 1:
        ap.error(f"--world={args.world} --rounds={args.rounds}: at least 2 processes and 1 round")
    res = run_ranks(_rank, args.world, args, results=1)[0]
    median = {n: statistics.median(v) for n, v in res["times"].items()}
    out = {"world": args.world, "batches": res["batches"], "same_shares": res["same"],
           "alone_s": median["alone"], "dealt_s": median["dealt"],
           "chunked_s": median["chunked"], "alone_over_dealt": median["alone"] / median["dealt"],
           "chunked_over_dealt": median["chunked"] / median["dealt"],
           "rank0_tokens_alone": res["tokens"]["alone"], "rank0_tokens_dealt": res["tokens"]["dealt"],
           "rank0_forwards": res["forwards"]}
    for name in ("alone", "dealt", "chunked"):
        print(f"{name:7}: {median[name]:.3f} s on rank 0 (median of {args.rounds}), rank 0 forwarded "
              f"{res['tokens'][name]:,} tokens in {res['forwards'][name]} forward(s)", flush=True)
    print(f"{out['batches']} warm-up batches over {args.world} ranks: alone / dealt {out['alone_over_dealt']:.2f}x, "
          f"chunk by chunk / dealt {out['chunked_over_dealt']:.2f}x, the same shares: {out['same_shares']}")
    print(json.dumps(out), flush=True)
    if not out["same_shares"]:
        raise SystemExit("the contenders measured different routing")
    return out


if __name__ == "__main__":
    main()
