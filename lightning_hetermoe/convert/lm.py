"""A converted Hugging Face causal LM as a LightningModule the strategy trains."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..configs import OptimConfig, from_cfg
from ..model.lm import MoELanguageModel
from ..model.loss import DEFAULT_LOSS_CHUNK, linear_cross_entropy
from ..moe import gate_losses
from .hf import HFMoEBlock, moe_aux, to_hetermoe


class HFMoELanguageModel(L.LightningModule):
    """Next-token cross-entropy plus every MoE layer's balance and z-loss, each at its
    layer's ``aux_loss_coef`` / ``z_loss_coef``.

    ``hf_model`` is a ``...ForCausalLM``; one not yet converted is converted here
    (:func:`~.hf.to_hetermoe`). A batch is ``(tokens, targets)`` (targets already shifted,
    as :class:`~lightning_hetermoe.ByteCorpusDataModule` gives) or a dict with
    ``input_ids`` and optional ``labels`` (unshifted, ``-100`` ignored) and
    ``attention_mask``, as Hugging Face collators give (padding still counts in the
    balance loss's routing fractions). The cross-entropy runs ``loss_chunk_tokens`` tokens
    at a time through the model's own head (:func:`~lightning_hetermoe.model.loss.linear_cross_entropy`:
    its logits never whole) where the head is a plain linear map of the decoder's output; a
    model that post-processes its logits (soft-capping, a logit scale) takes the whole
    logits as it gives them.
    """

    def __init__(self, hf_model: nn.Module, optim: OptimConfig | dict | None = None,
                 loss_chunk_tokens: int = DEFAULT_LOSS_CHUNK) -> None:
        super().__init__()
        if isinstance(loss_chunk_tokens, bool) or not isinstance(loss_chunk_tokens, int) or loss_chunk_tokens < 1:
            raise ValueError(f"HFMoELanguageModel loss_chunk_tokens={loss_chunk_tokens!r} is invalid: must be an "
                             f"integer >= 1 (tokens per chunk of the loss)")
        self.loss_chunk_tokens = loss_chunk_tokens
        self.optim_cfg = from_cfg(OptimConfig, optim or {})
        self.save_hyperparameters({"optim": asdict(self.optim_cfg)})
        if not any(isinstance(m, HFMoEBlock) for m in hf_model.modules()):
            hf_model = to_hetermoe(hf_model)
        self.model = hf_model

    def forward(self, tokens: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.model(input_ids=tokens, attention_mask=attention_mask, use_cache=False).logits

    def losses(self, batch: Any) -> dict[str, Tensor]:
        tokens, targets, mask = _unpack(batch)
        head = _plain_head(self.model)
        if head is not None:
            hidden = self.model.get_decoder()(input_ids=tokens, attention_mask=mask, use_cache=False).last_hidden_state
            ce = linear_cross_entropy(hidden, head.weight, targets, -100, self.loss_chunk_tokens)
        else:
            logits = self(tokens, mask)
            ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
        auxes = moe_aux(self.model)
        layers = [m for m in self.model.modules() if isinstance(m, HFMoEBlock)]
        balance = torch.stack([a.balance_loss for a in auxes]).sum()
        z = torch.stack([a.z_loss for a in auxes]).sum()
        loss = ce + sum(l.cfg.aux_loss_coef * a.balance_loss + l.cfg.z_loss_coef * a.z_loss
                        for l, a in zip(layers, auxes)) + gate_losses(auxes)
        dropped = torch.stack([a.dropped for a in auxes]).sum()
        return {"loss": loss, "ce": ce, "balance_loss": balance, "z_loss": z, "dropped": dropped,
                "tokens_per_expert": torch.stack([a.tokens_per_expert for a in auxes])}

    # The same steps, logging and optimizer set-up as the pack's own model: they only use
    # ``losses`` and ``optim_cfg``, so both models train, report and tune alike.
    lr = MoELanguageModel.lr
    training_step = MoELanguageModel.training_step
    validation_step = MoELanguageModel.validation_step
    configure_optimizers = MoELanguageModel.configure_optimizers


def _plain_head(hf_model: nn.Module) -> nn.Linear | None:
    """The causal LM's head where its logits are ``head(decoder output)`` and nothing more."""
    head = hf_model.get_output_embeddings() if hasattr(hf_model, "get_output_embeddings") else None
    config = getattr(hf_model, "config", None)
    post = any(getattr(config, name, None) not in (None, 1.0, 0.0)
               for name in ("final_logit_softcapping", "logit_scale", "logits_scaling"))
    if not isinstance(head, nn.Linear) or head.bias is not None or post or not hasattr(hf_model, "get_decoder"):
        return None
    return head


def _unpack(batch: Any) -> tuple[Tensor, Tensor, Tensor | None]:
    if isinstance(batch, dict):
        tokens = batch["input_ids"]
        labels = batch.get("labels", tokens)
        return tokens, F.pad(labels[:, 1:], (0, 1), value=-100), batch.get("attention_mask")
    if isinstance(batch, (tuple, list)) and len(batch) == 3:
        raise ValueError("a batch with segment ids (packed documents) needs the pack's model; a converted Hugging "
                         "Face model takes (tokens, targets) or a dict: set data.document_mask=false")
    tokens, targets = batch
    return tokens, targets, None
