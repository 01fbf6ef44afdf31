"""What the Trainer-run checks share: a tiny model and data, a loopback zebra plan, one run
at a time on its own one-rank process group."""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any, Iterator

import torch

from .report import Context

SEQ, EXPERTS, GLOBAL_BATCH = 16, 4, 8


def tiny_model(n_layers: int = 2, d_model: int = 16, **moe: Any) -> Any:
    from .. import ModelConfig, MoEConfig, MoELanguageModel, OptimConfig

    torch.manual_seed(0)
    cfg = ModelConfig(d_model=d_model, n_layers=n_layers, n_heads=2, max_seq_len=SEQ,
                      moe=MoEConfig(num_experts=EXPERTS, d_ff=12, **moe))
    return MoELanguageModel(cfg, OptimConfig())


def data() -> Any:
    from .. import ByteCorpusDataModule, DataConfig

    # two batches per epoch: two steps end the epoch, so validation runs without extra settings
    dm = ByteCorpusDataModule(DataConfig(seq_len=SEQ, batch_size=GLOBAL_BATCH, seed=7,
                                         train_windows=2 * GLOBAL_BATCH, val_windows=2 * GLOBAL_BATCH))
    dm.setup()
    return dm


def mixed_precision(ctx: Context) -> str:
    """Lightning's mixed precision with the 16-bit type this device computes in: bf16 from
    sm80 on (and on CPU, whose autocast is bf16), fp16 below."""
    return "bf16-mixed" if not ctx.cuda or torch.cuda.is_bf16_supported(including_emulation=False) else "16-mixed"


def loopback_plan(ctx: Context, n_layers: int = 2, num_microbatches: int = 2) -> Any:
    """One rank that attends and holds every expert: zebra's exchange talks to itself."""
    from ..plan import Plan, ZPGroup

    return Plan(model="selfcheck", cluster="selfcheck", seq_len=SEQ, devices=[ctx.device.type], roles=["attention"],
                zp_groups=[ZPGroup(attention_ranks=[0], expert_ranks=[])], num_microbatches=num_microbatches,
                seqs_per_rank=[GLOBAL_BATCH], placement=[[0] * EXPERTS for _ in range(n_layers)],
                base_counts=[[EXPERTS] * n_layers])


def through_the_exchange() -> Any:
    """A callback sending one-rank EP's rows through its all-to-all, as a group of two or more
    does: a group of one dispatches as one device and issues none, and one GPU has no
    larger group to check the exchange with."""
    import lightning as L

    from ..model_contract import moe_layers

    class ThroughTheExchange(L.Callback):
        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:  # the strategy has swapped the dispatchers
            for _, layer in moe_layers(pl_module):
                if getattr(layer.dispatcher, "alone", None) is not None:
                    layer.dispatcher.alone = None

    return ThroughTheExchange()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainer(ctx: Context, strategy: Any, name: str, **kwargs: Any) -> Any:
    import lightning as L

    # Each run starts its own one-rank process group (the strategy does, as under a
    # launcher); a fresh port keeps it clear of the last run's store.
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())
    settings = dict(default_root_dir=os.path.join(ctx.workdir, name), accelerator="gpu" if ctx.cuda else "cpu",
                    devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    settings.update(kwargs)
    return L.Trainer(strategy=strategy, **settings)


def _end_run(strategy: Any) -> None:
    """Leave the run's process group, so the next run starts its own (even after a failure)."""
    import torch.distributed as dist

    import lightning_hetermoe.comm as comm
    from ..strategy import heartbeat

    try:
        strategy.shutdown()
    except Exception:
        heartbeat.stop()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        comm.forget()


@contextlib.contextmanager
def one_run(ctx: Context, name: str, mode: str, plan: Any = None, strategy_args: dict[str, Any] | None = None,
            **trainer_kwargs: Any) -> Iterator[tuple]:
    from .. import HeterMoEStrategy

    strategy = HeterMoEStrategy(mode=mode, plan=plan, **(strategy_args or {}))
    try:
        yield strategy, _trainer(ctx, strategy, name, **trainer_kwargs)
    finally:
        _end_run(strategy)
