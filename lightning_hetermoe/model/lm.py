"""The MoE decoder as a LightningModule: next-token loss plus the routers' auxiliary losses."""

from __future__ import annotations

import numbers
import os
from dataclasses import asdict, replace
from typing import Any

import lightning as L
from lightning.pytorch.plugins.precision import MixedPrecision
import torch
from torch import Tensor

from ..configs import ModelConfig, OptimConfig, from_cfg
from ..moe import gate_losses
from .loss import linear_cross_entropy
from .transformer import MoETransformer

# Targets with this value take no part in the loss (cross_entropy's default ignore_index):
# packed corpora put it on each document's first token, which nothing before it predicts.
IGNORE_INDEX = -100


def unpack_batch(batch) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(tokens, targets)`` or ``(tokens, targets, segments)``: ``[batch, seq]`` each;
    ``segments`` are the packed documents' ids (see :func:`.transformer.document_layout`)."""
    if not isinstance(batch, (tuple, list)) or len(batch) not in (2, 3):
        raise ValueError("a batch is (tokens, targets) or (tokens, targets, segment_ids), got "
                         f"{type(batch).__name__} of {len(batch) if isinstance(batch, (tuple, list)) else 1}")
    return batch[0], batch[1], batch[2] if len(batch) == 3 else None


def resolve_fused(setting: bool | str, params: list[Tensor], plugin: Any = None, clip_val: float | None = None,
                  devices: tuple[str, ...] = ("cuda", "cpu")) -> bool | None:
    """The optimizer's ``fused`` argument for ``optim.fused``: ``True`` or ``False`` as given
    (``False`` leaves torch its own choice: ``None``). ``auto``: ``True`` where every
    parameter is a floating-point tensor on one of ``devices``, where torch has a fused step
    (on this project's CPU 5x the multi-tensor step's speed, 2.6x fewer bytes moved:
    ``bench/optimizer_step.py``), unless the trainer clips and the precision ``plugin``
    cannot clip for an optimizer that unscales in its own step (Lightning's mixed precision,
    16-mixed and bf16-mixed alike, refuses to; ``HeterMoEStrategy``'s plugin is made to
    and says so with ``clips_fused``). Elsewhere ``None``: torch's default (its
    multi-tensor step on a GPU, per parameter on a CPU)."""
    if setting != "auto":
        return True if setting else None
    if not params or not all(p.device.type in devices and p.is_floating_point() for p in params):
        return None
    refuses = isinstance(plugin, MixedPrecision) and bool(clip_val) and not getattr(plugin, "clips_fused", False)
    return None if refuses else True


class MoELanguageModel(L.LightningModule):
    """The pack's MoE decoder (:class:`MoETransformer` of ``model``, a
    :class:`ModelConfig` or its dict) trained on next-token cross-entropy plus every MoE
    layer's balance and z-losses at ``model.moe``'s coefficients, with the optimizer
    and warm-up of ``optim`` (an :class:`OptimConfig` or its dict). A batch is ``(tokens,
    targets)`` or ``(tokens, targets, segments)`` (packed documents' ids), as
    :class:`ByteCorpusDataModule` and :class:`TokenizedDataModule` give them; it logs
    ``train_loss`` (the cross-entropy), ``balance_loss``, ``z_loss`` and ``val_loss``."""

    def __init__(self, model: ModelConfig | dict | None = None, optim: OptimConfig | dict | None = None) -> None:
        super().__init__()
        self.model_cfg = from_cfg(ModelConfig, model or {})
        self.optim_cfg = from_cfg(OptimConfig, optim or {})
        self.save_hyperparameters({"model": asdict(self.model_cfg), "optim": asdict(self.optim_cfg)})
        self.model = MoETransformer(self.model_cfg)

    @property
    def lr(self) -> float:
        """``optim.lr``, under the name Lightning's tuner looks for: ``Tuner(trainer).lr_find(model)``
        sets it, and the optimizer built next and a checkpoint's hyperparameters take it."""
        return self.optim_cfg.lr

    @lr.setter
    def lr(self, value: float) -> None:
        value = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else value
        self.optim_cfg = replace(self.optim_cfg, lr=value)  # checked as the config is
        self.hparams["optim"]["lr"] = self.optim_cfg.lr

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, map_location: Any = None, hparams_file: Any = None,
                             strict: bool | None = None, **kwargs: Any) -> "MoELanguageModel":
        """Lightning's ``load_from_checkpoint``, which also takes the sharded checkpoint
        directory a large model saves (read by :func:`lightning_hetermoe.load_checkpoint`)."""
        from ..ckpt import is_sharded_checkpoint, load_checkpoint

        if hparams_file is None and isinstance(checkpoint_path, (str, os.PathLike)) \
                and is_sharded_checkpoint(checkpoint_path):
            kwargs.pop("weights_only", None)  # the directory's meta.pt holds the loop state: read whole
            return load_checkpoint(checkpoint_path, cls, map_location=map_location, strict=strict, **kwargs)
        return super().load_from_checkpoint(checkpoint_path, map_location=map_location, hparams_file=hparams_file,
                                            strict=strict, **kwargs)

    def forward(self, tokens: Tensor, segments: Tensor | None = None) -> Tensor:
        return self.model(tokens, segments)[0]

    def losses(self, batch) -> dict[str, Tensor]:
        """``ce``: the mean over the targets that are not ``IGNORE_INDEX``, the head run
        with it ``model.loss_chunk_tokens`` tokens at a time (its logits never whole)."""
        tokens, targets, segments = unpack_batch(batch)
        hidden, auxes = self.model.features(tokens, segments)
        ce = linear_cross_entropy(hidden, self.model.head.weight, targets, IGNORE_INDEX, self.model_cfg.loss_chunk_tokens)
        moe = self.model_cfg.moe
        balance = torch.stack([a.balance_loss for a in auxes]).sum()
        z = torch.stack([a.z_loss for a in auxes]).sum()
        loss = ce + moe.aux_loss_coef * balance + moe.z_loss_coef * z + gate_losses(auxes)
        dropped = torch.stack([a.dropped for a in auxes]).sum()
        return {"loss": loss, "ce": ce, "balance_loss": balance, "z_loss": z, "dropped": dropped,
                "tokens_per_expert": torch.stack([a.tokens_per_expert for a in auxes])}

    def training_step(self, batch, batch_idx: int) -> Tensor:
        out = self.losses(batch)
        self.log("train_loss", out["ce"], prog_bar=True)
        self.log_dict({"balance_loss": out["balance_loss"], "z_loss": out["z_loss"]})
        self.last_tokens_per_expert = out["tokens_per_expert"].detach()
        return out["loss"]

    def validation_step(self, batch, batch_idx: int) -> None:
        out = self.losses(batch)
        self.log("val_loss", out["ce"], prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        o = self.optim_cfg
        try:
            trainer = self.trainer
        except RuntimeError:  # a module outside a Trainer (configured by hand)
            trainer = None
        fused = resolve_fused(o.fused, list(self.parameters()), trainer.precision_plugin if trainer else None,
                              trainer.gradient_clip_val if trainer else None)
        if o.name == "sgd":
            cls, kwargs = torch.optim.SGD, dict(momentum=o.momentum, nesterov=o.nesterov)
        else:
            cls, kwargs = (torch.optim.Adam if o.name == "adam" else torch.optim.AdamW), dict(betas=o.betas)
        try:
            opt = cls(self.parameters(), lr=o.lr, weight_decay=o.weight_decay, fused=fused, **kwargs)
        except RuntimeError:
            if not (fused and o.fused == "auto"):
                raise
            # a torch without this optimizer's fused step on these devices (an older one's
            # CPU): auto takes torch's own step
            opt = cls(self.parameters(), lr=o.lr, weight_decay=o.weight_decay, **kwargs)
        if o.warmup_steps == 0:
            return opt
        warmup = o.warmup_steps
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
