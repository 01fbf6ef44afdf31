"""The naive reference every parallel run is compared with: one process, the whole global
batch per step, the model's own optimizer and LR schedule, plain ``loss.backward()``.

Also the small builders the distributed tests share (model, data, cluster, Lightning trainer,
a callback that moves experts) and what they read back (whole checkpoints and states)."""

from __future__ import annotations

import contextlib
import copy
import itertools
import os
import tempfile
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_hetermoe import (ByteCorpusDataModule, DataConfig, ModelConfig, MoEConfig, MoELanguageModel, MoELayer,
                                OptimConfig)
from lightning_hetermoe.model.sampling import GlobalOrderSampler
from lightning_hetermoe.model_contract import moe_layers
from lightning_hetermoe.placement import Placement

SEQ = 16
# a fast device and slow ones (at these tiny shapes launches dominate, so the slow device
# launches slowly): unequal batch shares; the A40's larger memory: a larger range of experts
SLOW = {"slow": {"base": "v100", "launch_overhead_s": 1e-4}}


def make_model(num_experts: int = 4, n_layers: int = 2, seed: int = 0, optim: OptimConfig | None = None,
               activation_checkpointing: bool = False, dense_layers: int = 0, **moe: Any) -> MoELanguageModel:
    """A tiny model at the default loss coefficients (balance and z-loss on) unless ``moe`` says
    otherwise; ``dense_layers`` decoder layers with a dense MLP (of 20) before the MoE ones."""
    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=16, n_layers=n_layers, n_heads=2, max_seq_len=SEQ,
                      activation_checkpointing=activation_checkpointing, dense_layers=dense_layers,
                      dense_d_ff=20 if dense_layers else 0,
                      moe=MoEConfig(num_experts=num_experts, d_ff=12, **moe))
    return MoELanguageModel(cfg, optim or OptimConfig())


def data(world: int, global_batch: int = 8, windows: int = 64, shuffle: bool = True, seed: int = 7
         ) -> ByteCorpusDataModule:
    if global_batch % world:
        raise ValueError(f"global batch {global_batch} does not split over {world} ranks")
    dm = ByteCorpusDataModule(DataConfig(seq_len=SEQ, batch_size=global_batch // world, shuffle=shuffle, seed=seed,
                                         train_windows=windows, val_windows=2 * global_batch))
    dm.setup()
    return dm


def mixed_cluster(world: int) -> dict:
    return dict(name="mix", devices=["a40"] + ["slow"] * (world - 1), custom_devices=SLOW)


def global_batches(global_batch: int = 8, windows: int = 64, shuffle: bool = True, seed: int = 7):
    """The global batches of epoch 0, 1, ... in order, as one process sees them."""
    train_set = data(1, global_batch, windows, shuffle, seed).train_set
    sampler = GlobalOrderSampler(train_set, shuffle=shuffle, seed=seed)
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        yield from DataLoader(train_set, batch_size=global_batch, sampler=sampler, drop_last=True)


class _RecordBalance:
    """Stands in for a layer's balance loss in :func:`pieces_loss`: records what it needs."""

    def __init__(self) -> None:
        self.items: list[tuple[torch.Tensor, torch.Tensor, int]] = []

    def __call__(self, probs: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        counts = torch.bincount(indices.reshape(-1), minlength=probs.shape[-1])
        self.items.append((probs.mean(0), counts, probs.shape[0]))
        return probs.sum() * 0


@contextlib.contextmanager
def recording_balance(model: MoELanguageModel):
    """Each MoE layer's balance loss swapped for a recorder of what it was asked (for a
    reference that writes the global balance loss out itself); restored after."""
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    saved = [layer.balance for layer in layers]
    recorders = [_RecordBalance() for _ in layers]
    for layer, rec in zip(layers, recorders, strict=True):
        layer.balance = rec
    try:
        yield recorders
    finally:
        for layer, b in zip(layers, saved, strict=True):
            layer.balance = b


def global_balance(model: MoELanguageModel, recorders: list, tokens: int) -> torch.Tensor:
    """The balance loss over the whole global batch (``tokens`` tokens): expert fractions of
    every recorded call together, router probabilities averaged by each call's tokens."""
    coef, loss = model.model_cfg.moe.aux_loss_coef, 0.0
    for rec in recorders:
        counts = sum(c for _, c, _ in rec.items)
        frac = counts.float() / counts.sum()
        mean_probs = sum(p * (t / tokens) for p, _, t in rec.items)
        loss = loss + coef * len(frac) * (frac * mean_probs).sum()
    return loss


def pieces_loss(model: MoELanguageModel, batch, pieces: list[int], stats: dict | None = None) -> torch.Tensor:
    """The global batch as separate forward passes of ``pieces`` sequences each (capacity then
    applies per piece, as on a rank's micro-batch), with the balance loss's expert fractions
    over the whole global batch, written out term by term."""
    with recording_balance(model) as recorders:
        total = sum(pieces)
        loss, at = 0.0, 0
        for n in pieces:
            piece = tuple(t[at:at + n] for t in batch)
            out = model.losses(piece)
            loss = loss + out["loss"] * (n / total)
            at += n
            if stats is not None:  # what the case exercised: drops, experts left without tokens
                stats["dropped"] = stats.get("dropped", 0) + int(out["dropped"])
                stats["idle_experts"] = stats.get("idle_experts", 0) + int((out["tokens_per_expert"] == 0).sum())
        return loss + global_balance(model, recorders, total * batch[0].shape[1])


def reference_fit(model: MoELanguageModel, steps: int, *, global_batch: int = 8, windows: int = 64,
                  accumulate: int = 1, clip: float | None = None, shuffle: bool = True,
                  seed: int = 7, pieces: list[int] | None = None, stats: dict | None = None,
                  scaler: torch.amp.GradScaler | None = None, clip_algorithm: str = "norm",
                  overfit: int = 0, batches: Any = None) -> dict[str, torch.Tensor]:
    """``scaler``: fp16 autocast with loss scaling, in the order Lightning's 16-mixed runs
    it (scale, backward, unscale, clip, step unless inf/nan, update; the LR scheduler steps
    either way). ``overfit``: the first that many global batches of the unshuffled order,
    over and over (Lightning's ``overfit_batches``). ``batches``: the global batches to take
    instead of the corpus's (an iterator)."""
    model = copy.deepcopy(model)
    conf = model.configure_optimizers()
    opt = conf["optimizer"] if isinstance(conf, dict) else conf
    sched = conf["lr_scheduler"]["scheduler"] if isinstance(conf, dict) else None
    if batches is None:
        batches = global_batches(global_batch, windows, shuffle and not overfit, seed)
    if overfit:
        batches = itertools.cycle(list(itertools.islice(batches, overfit)))
    autocast = torch.autocast("cpu", dtype=torch.float16, enabled=scaler is not None)
    # aux-loss-free balancing: each router's bias moves once per step, by the step's load
    biased = [m.router for m in model.modules() if isinstance(m, MoELayer)
              if getattr(m.router, "expert_bias", None) is not None]
    for _ in range(steps):
        opt.zero_grad()
        load = 0
        for _ in range(accumulate):
            batch = next(batches)
            with autocast:
                if pieces is None:
                    out = model.losses(batch)
                    loss, load = out["loss"], load + out["tokens_per_expert"].detach()
                else:
                    assert not biased, "the pieces reference does not count the load"
                    loss = pieces_loss(model, batch, pieces, stats)
            loss = loss / accumulate
            (scaler.scale(loss) if scaler is not None else loss).backward()
            if stats is not None:  # the CE a rank logs: over its own rows (default: all)
                rows = stats.get("ce_rows") or batch[0].shape[0]
                with torch.no_grad():
                    stats["last_ce"] = float(model.losses(tuple(t[:rows] for t in batch))["ce"])
        if scaler is not None:
            scaler.unscale_(opt)
        if stats is not None:  # the norm of every gradient, unscaled, before the clip
            stats.setdefault("grad_norms", []).append(
                float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])))
        if clip is not None and clip_algorithm == "value":
            torch.nn.utils.clip_grad_value_(model.parameters(), clip)
        elif clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if sched is not None:
            sched.step()
        for l, router in enumerate(biased):
            with torch.no_grad():  # written out here, not the router's own update
                router.expert_bias += router.bias_update_rate * torch.sign(load[l].float().mean() - load[l].float())
    if stats is not None:
        stats["model"] = model
    return model.state_dict()


class ScaleHistory(torch.amp.GradScaler):
    """The single process's scaler, recording the scale after every step."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.history: list[float] = []

    def update(self, new_scale=None) -> None:
        super().update(new_scale)
        self.history.append(float(self.get_scale()))


def validation_loss(model: MoELanguageModel, world_batch: int = 8) -> float:
    """Mean cross-entropy over the validation batches (one process, global batches)."""
    val = data(1, world_batch).val_set
    losses = []
    with torch.no_grad():
        model.eval()
        for batch in DataLoader(val, batch_size=world_batch, drop_last=True):
            losses.append(float(model.losses(batch)["ce"]))
        model.train()
    return sum(losses) / len(losses)


def whole_checkpoint(path) -> dict:
    """A checkpoint as one dict of whole tensors: a full file as saved, a sharded directory
    consolidated (what ``python -m lightning_hetermoe.ckpt consolidate`` writes)."""
    from lightning_hetermoe.ckpt import is_sharded_checkpoint
    from lightning_hetermoe.ckpt.consolidate import consolidate

    if not is_sharded_checkpoint(path):
        return torch.load(path, weights_only=False)
    with tempfile.TemporaryDirectory() as tmp:
        return consolidate(path, os.path.join(tmp, "whole.ckpt"))


def whole_state(t) -> dict:
    """The trained model's state dict, every expert gathered (a collective)."""
    from lightning_hetermoe.strategy.expert_state import ExpertState

    return ExpertState(t.strategy.backend, t.lightning_module).module_state()


class MoveAt(L.Callback):
    """At the end of step ``step``, move every layer's experts to ``placement`` (a test's
    stand-in for a rebalancing decision: the same call the rebalancer makes)."""

    def __init__(self, step: int, placement) -> None:
        self.step, self.placement, self.moved, self.final = step, placement, None, None

    def on_train_end(self, trainer, pl_module):
        self.final = trainer.strategy.placement  # where the experts ended (a later rebalance included)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and self.moved is None:
            before = [layer.dispatcher for _, layer in moe_layers(pl_module)]
            self.moved = trainer.strategy.move_experts(Placement(self.placement))
            self.after = trainer.strategy.placement.to_lists()
            # A move keeps each layer's dispatcher object: what wraps it (the emulated
            # clock's exchange timing) must survive a migration.
            self.kept = all(a is b for a, b in zip(before, [layer.dispatcher for _, layer in moe_layers(pl_module)], strict=True))


def trainer(strategy, devices: int, **kwargs: Any) -> L.Trainer:
    # the run directory (plan.json, checkpoints) goes to a temporary place, not the checkout
    defaults = dict(default_root_dir=os.path.join(tempfile.gettempdir(), "lightning-hetermoe-tests"),
                    accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    defaults.update(kwargs)
    return L.Trainer(strategy=strategy, devices=devices, **defaults)


def assert_same_params(actual: dict, expected: dict, initial: dict, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        moved = (expected[name] - initial[name]).abs().max()
        assert moved > 0 or "noise" in name, f"{name} never trained: the comparison would be vacuous"
        torch.testing.assert_close(actual[name], expected[name], rtol=rtol, atol=atol, msg=name)


def relative_gap(got: dict, ref: dict, initial: dict) -> float:
    """How far ``got`` landed from ``ref``, over every floating-point tensor, relative to how
    far ``ref`` moved from ``initial`` (norms over all of them)."""
    names = [n for n, r in ref.items() if r.is_floating_point()]
    num = sum(float((got[n].double() - ref[n].double()).square().sum()) for n in names)
    den = sum(float((ref[n].double() - initial[n].double()).square().sum()) for n in names)
    return (num / den) ** 0.5


def perturbed_fit(model: MoELanguageModel, steps: int, eps: float = 1e-7, **fit: Any) -> dict[str, torch.Tensor]:
    """:func:`reference_fit` from initial weights scaled by ``1 + eps * N(0, 1)``: one process
    against itself, the noise floor of a low-precision run (a rounding that flips a token's
    top-k choice makes the run drift from there, by as much on one CPU as any schedule)."""
    model = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + eps * torch.randn(p.shape, generator=gen))
    return reference_fit(model, steps, **fit)
