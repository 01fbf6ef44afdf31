"""The packed loader against a training step: can loading ever be the bottleneck?

    python bench/loader.py                      # about a minute on 2 cores
    python bench/loader.py --corpus data/mine   # a corpus prepare_data.py wrote

Without ``--corpus`` it prepares the default corpus (the pydoc topics, a 4096-token BPE)
into a temporary directory. For each shape (rows x seq_len) it times, in this process:

* the loader: ``TokenizedDataModule``'s training loader as the main job builds it (global
  order sampler, packing from the memory map, segment ids, collate; ``num_workers=0``, so
  its time adds to every step), in batches/s and tokens/s, over whole epochs;
* a training step of the default model (``conf/model/tiny`` at the corpus's vocabulary:
  forward with the document mask, backward, AdamW) on this machine's CPU, without
  Lightning or the strategy (the step a real run takes is longer still);

and the byte loader of the main job at its shape, for comparison. Then the demand a real
workload puts on one process's loader: the planner's predicted tokens/s of the paper's D1
model (2.1B) at 4K tokens per sequence on an A40+V100 pair and on 8 H100s, divided by the
ranks (each rank loads its own share of every global batch).

The last line is JSON with every number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(8, 64), (8, 128), (4, 1024), (1, 8192)]
MODEL_MAX_TOKENS = 8192  # the model step is timed up to this many tokens per batch (CPU attention is O(seq^2))


def loader_rate(make_loader, min_batches: int = 200, min_s: float = 1.0) -> tuple[float, int]:
    """Batches/s of fresh epochs of ``make_loader()`` until enough batches and seconds."""
    n, epoch, started = 0, 0, time.perf_counter()
    tokens_per_batch = 0
    while n < min_batches or time.perf_counter() - started < min_s:
        loader = make_loader()
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            tokens_per_batch = batch[0].numel()
            n += 1
        epoch += 1
    return n / (time.perf_counter() - started), tokens_per_batch


def step_time(model_cfg, batch, steps: int = 8) -> float:
    """Median seconds of forward + backward + AdamW on one process."""
    from lightning_hetermoe import MoELanguageModel

    torch.manual_seed(0)
    lm = MoELanguageModel(model_cfg)
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-3)
    times = []
    for i in range(steps + 2):
        t = time.perf_counter()
        loss = lm.losses(batch)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def workload_demand() -> dict[str, float]:
    """Tokens/s one process's loader must serve for D1 at 4K: the planner's best schedule
    on the cluster, over its ranks."""
    from omegaconf import OmegaConf

    from lightning_hetermoe.cluster import ClusterConfig
    from lightning_hetermoe.configs import ModelConfig, from_cfg
    from lightning_hetermoe.plan import make_plan

    d1 = from_cfg(ModelConfig, OmegaConf.load(ROOT / "conf" / "model" / "d1.yaml"))
    out = {}
    for name, devices in (("a40+v100", ["a40", "v100"]), ("8xh100", ["h100"] * 8)):
        plan = make_plan(ClusterConfig(name=name, devices=devices), d1, seq_len=4096,
                         global_batch_tokens=4096 * 4 * len(devices))
        best = max(p["tokens_per_s"] for p in plan.predicted.values() if p.get("tokens_per_s"))
        out[name] = best / len(devices)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", help="a prepared corpus (default: prepare the pydoc topics into a temp dir)")
    args = ap.parse_args()
    torch.set_num_threads(1)  # one core: the loader and the step get the same

    from omegaconf import OmegaConf

    from lightning_hetermoe import ByteCorpusDataModule, DataConfig, ModelConfig, TokenizedDataModule
    from lightning_hetermoe.configs import PrepareConfig, from_cfg
    from lightning_hetermoe.corpus.format import read_meta

    tmp = None
    path = args.corpus
    if path is None:
        from lightning_hetermoe.corpus.prepare import prepare_corpus

        tmp = tempfile.TemporaryDirectory(prefix="bench_loader_")
        path = str(Path(tmp.name) / "pydoc_bpe")
        prepare_corpus(PrepareConfig(out=path), log=lambda s: print(s, file=sys.stderr))
    meta = read_meta(path)
    tiny = from_cfg(ModelConfig, OmegaConf.load(ROOT / "conf" / "model" / "tiny.yaml"))
    rows = []
    print(f"corpus {path}: {meta.num_documents} documents, {meta.num_tokens:,} tokens, vocab {meta.vocab_size}")
    print(f"{'shape':>10} {'loader batches/s':>17} {'loader tokens/s':>16} {'model step (ms)':>16} {'loader / step':>14}")
    for batch_size, seq_len in SHAPES:
        cfg = DataConfig(corpus="tokenized", path=path, seq_len=seq_len, batch_size=batch_size, train_windows=None,
                         val_windows=1, val_fraction=0.15)  # a validation row even at 8192 tokens
        dm = TokenizedDataModule(cfg)
        dm.setup()
        rate, tokens = loader_rate(dm.train_dataloader)
        row = {"batch_size": batch_size, "seq_len": seq_len, "loader_batches_per_s": rate,
               "loader_tokens_per_s": rate * tokens, "step_s": None, "loader_over_step": None}
        if batch_size * seq_len <= MODEL_MAX_TOKENS and batch_size > 1:
            model_cfg = ModelConfig(**{**OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / "tiny.yaml")),
                                       "vocab_size": meta.vocab_size, "max_seq_len": max(tiny.max_seq_len, seq_len)})
            batch = next(iter(dm.train_dataloader()))
            row["step_s"] = step_time(model_cfg, batch)
            row["loader_over_step"] = (1 / rate) / row["step_s"]
        rows.append(row)
        step = f"{row['step_s'] * 1e3:16.1f}" if row["step_s"] else f"{'-':>16}"
        share = f"{row['loader_over_step']:14.2%}" if row["loader_over_step"] is not None else f"{'-':>14}"
        print(f"{batch_size:>4} x {seq_len:<5}{rate:17.0f} {rate * tokens:16,.0f} {step} {share}")
    byte_dm = ByteCorpusDataModule(DataConfig())
    byte_dm.setup()
    byte_rate, byte_tokens = loader_rate(byte_dm.train_dataloader)
    print(f"byte loader (main job, 8 x 64): {byte_rate:.0f} batches/s, {byte_rate * byte_tokens:,.0f} tokens/s")
    demand = workload_demand()
    longest = rows[-1]["loader_tokens_per_s"]
    for name, per_rank in demand.items():
        print(f"D1 (2.1B) at 4K on {name}: {per_rank:,.0f} tokens/s per rank predicted; the packed loader at "
              f"{SHAPES[-1][0]} x {SHAPES[-1][1]} serves {longest:,.0f} ({longest / per_rank:.0f}x)")
    print(json.dumps({"corpus": path, "rows": rows, "byte_loader_batches_per_s": byte_rate,
                      "byte_loader_tokens_per_s": byte_rate * byte_tokens, "d1_4k_tokens_per_s_per_rank": demand}))
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
