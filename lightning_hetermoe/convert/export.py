"""Offline: a checkpoint as a Hugging Face ``save_pretrained`` directory, streamed
(``python -m lightning_hetermoe.convert to-hf``).

The checkpoint (sharded directory or full file) of a converted Hugging Face model
(:class:`~lightning_hetermoe.convert.HFMoELanguageModel`) records the model's config; the
export rebuilds the model's skeleton on the meta device from it, and writes every tensor
under the name the Hugging Face model itself uses (the MoE layers' stacked experts back in
the block's own layout, :func:`~lightning_hetermoe.convert.moe_tensors_to_hf`), one MoE
block at a time, into safetensors files of at most ``max_shard_bytes`` with their index:
``AutoModelForCausalLM.from_pretrained`` reads it as it reads its own.

A checkpoint of the pack's own model (:class:`~lightning_hetermoe.MoELanguageModel`) is
exported as the ``MixtralForCausalLM`` that computes the same function.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from ..checkpoint_files import is_sharded_checkpoint
from ..ckpt import dcp
from ..ckpt.consolidate import ReadProgress, read_meta, saved_bytes, state_dict_of
from ..ckpt.loading import read_checkpoint_file
from ..staging import StagedDirectory, staged

DEFAULT_SHARD_BYTES = 2 << 30
INDEX = "model.safetensors.index.json"  # names each tensor's shard
SHARD_GLOB = "model-[0-9][0-9][0-9][0-9][0-9]-of-[0-9][0-9][0-9][0-9][0-9].safetensors"  # the shards' names


def checkpoint_tensors(path: str | os.PathLike) -> tuple[dict[str, Any], Iterator[tuple[str, Tensor]], int]:
    """``(hyper-parameters and hetermoe info, state-dict tensors, their bytes)`` of a sharded
    directory or a full file (memory-mapped: its tensors are read as they are taken)."""
    if is_sharded_checkpoint(path):
        meta = read_meta(path)
        return meta, state_dict_of(path, meta), saved_bytes(path, "state_dict.")
    ckpt = read_checkpoint_file(path, "checkpoint", map_location="cpu", mmap=True)
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), dict):
        raise dcp.CheckpointFormatError(f"checkpoint={str(path)!r} is not a Lightning checkpoint (it holds no "
                                        f"state_dict)")
    state = ckpt["state_dict"]
    return ckpt, iter(state.items()), sum(t.numel() * t.element_size() for t in state.values()
                                          if isinstance(t, Tensor))


def export_hf(path: str | os.PathLike, out: str | os.PathLike, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
              progress_every_s: float | None = None, say: Callable[[str], None] | None = None) -> Path:
    """Write checkpoint ``path`` as a Hugging Face directory ``out``; returns ``out``.
    ``progress_every_s``: say how much is read that often (``say``: print)."""
    meta, tensors, total = checkpoint_tensors(path)
    if progress_every_s is not None:
        tensors = ReadProgress("to-hf", total, progress_every_s, say).counted(tensors)
    hf = (meta.get("hetermoe") or {}).get("hf")
    if hf is not None:
        names = _HFNames(hf)
    else:
        names = _MixtralNames(meta)
    out = Path(out)
    # written beside out and moved in once whole: an export stopped half-way leaves an
    # earlier one in out as it was (the index and the config, which name the rest, last)
    with staged(StagedDirectory, out, last=(INDEX, "config.json")) as tmp:
        writer = _ShardedSafetensors(tmp, max_shard_bytes)
        for name, t in names.convert(tensors):
            writer.add(name, t)
        writer.close()
        names.config.save_pretrained(str(tmp))
    # an earlier export's shards this one's index does not name (it had more of them): the
    # files a user added (a tokenizer, a model card) stay
    shards = set(writer.weight_map.values())
    for old in out.glob(SHARD_GLOB):
        if old.name not in shards:
            old.unlink()
    return out


class _HFNames:
    """Names of a converted Hugging Face model: the LightningModule's ``<prefix><hf name>``,
    the MoE blocks' tensors back in the block's layout."""

    def __init__(self, hf: dict[str, Any]) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        from .hf import SPARSE_BLOCKS, HFMoEBlock, to_hetermoe

        self.prefix = hf["prefix"]
        config = dict(hf["config"])
        self.config = AutoConfig.for_model(config.pop("model_type"), **config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.config)
        self.hf_names = {path: list(module.state_dict()) for path, module in model.named_modules()
                         if type(module).__name__ in SPARSE_BLOCKS}  # each block's own tensor names
        to_hetermoe(model)
        self.blocks = sorted((n for n, m in model.named_modules() if isinstance(m, HFMoEBlock)), key=len, reverse=True)

    def convert(self, tensors: Iterator[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        from .hf import moe_tensors_to_hf

        pending: dict[str, dict[str, Tensor]] = {}
        for name, t in tensors:
            if not name.startswith(self.prefix):
                continue
            name = name[len(self.prefix):]
            block = next((b for b in self.blocks if name.startswith(b + ".")), None)
            if block is None:
                yield name, t
                continue
            local = name[len(block) + 1:]
            pending.setdefault(block, {})[local] = t
            if _complete(pending[block], self.hf_names[block]):
                for k, v in moe_tensors_to_hf(pending.pop(block), self.hf_names[block]).items():
                    yield f"{block}.{k}", v
        if pending:
            raise dcp.CheckpointFormatError(f"MoE blocks with tensors missing from the checkpoint: {sorted(pending)}")


def _complete(ours: dict[str, Tensor], hf_names: list[str]) -> bool:
    need = {"router.weight", "experts.w_up", "experts.w_down"}
    if any(n.startswith(("shared_expert.", "shared_experts.")) and ".gate_proj" in n for n in hf_names):
        need |= {"shared_expert.w_up", "shared_expert.w_down"}
    if "shared_expert_gate.weight" in hf_names:
        need.add("shared_expert.gate")
    if "gate.e_score_correction_bias" in hf_names:
        need.add("router.expert_bias")
    return need <= set(ours)


class _MixtralNames:
    """The pack's own model as the Mixtral computing the same function."""

    def __init__(self, meta: dict[str, Any]) -> None:
        from transformers import MixtralConfig

        from ..configs import ModelConfig, from_cfg
        from .mixtral import mixtral_config_kwargs

        hparams = meta.get("hyper_parameters") or {}
        if "model" not in hparams:
            raise dcp.CheckpointFormatError("the checkpoint is neither of a converted Hugging Face model (no hf entry) "
                                            "nor of the pack's MoELanguageModel (no model hyper-parameters)")
        self.cfg = from_cfg(ModelConfig, hparams["model"], "model")
        self.config = MixtralConfig(**mixtral_config_kwargs(self.cfg))

    def convert(self, tensors: Iterator[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        from .hf import moe_tensors_to_hf

        experts = {}
        for name, t in tensors:
            if not name.startswith("model."):
                continue
            name = name[len("model."):]
            if name == "embed.weight":
                yield "model.embed_tokens.weight", t
            elif name == "norm.weight":
                yield "model.norm.weight", t
            elif name == "head.weight":
                yield "lm_head.weight", t
            else:
                _, i, rest = name.split(".", 2)
                hf = f"model.layers.{i}."
                if rest == "attn_norm.weight":
                    yield hf + "input_layernorm.weight", t
                elif rest == "moe_norm.weight":
                    yield hf + "post_attention_layernorm.weight", t
                elif rest == "attn.qkv.weight":
                    width, kv = self.cfg.attention_width, self.cfg.kv_heads * self.cfg.head_size
                    q, k, v = t.split([width, kv, kv], dim=0)
                    yield hf + "self_attn.q_proj.weight", q
                    yield hf + "self_attn.k_proj.weight", k
                    yield hf + "self_attn.v_proj.weight", v
                elif rest == "attn.proj.weight":
                    yield hf + "self_attn.o_proj.weight", t
                elif rest.startswith("moe."):
                    block = experts.setdefault(i, {})
                    block[rest[len("moe."):]] = t
                    if {"router.weight", "experts.w_up", "experts.w_down"} <= set(block):
                        hf_names = ["gate.weight", "experts.gate_up_proj", "experts.down_proj"]
                        for k, v in moe_tensors_to_hf(experts.pop(i), hf_names).items():
                            yield f"{hf}mlp.{k}", v


class _ShardedSafetensors:
    """safetensors files of at most ``limit`` bytes each, and the index JSON naming each tensor's file."""

    def __init__(self, out: Path, limit: int) -> None:
        self.out, self.limit = out, limit
        self.batch: dict[str, Tensor] = {}
        self.size = 0
        self.files: list[dict[str, Tensor]] = []
        self.weight_map: dict[str, str] = {}
        self.written: list[list[str]] = []
        self.total = 0

    def add(self, name: str, t: Tensor) -> None:
        n = t.numel() * t.element_size()
        if self.batch and self.size + n > self.limit:
            self._flush()
        self.batch[name] = t.detach().contiguous()
        self.size += n
        self.total += n

    def _flush(self) -> None:
        from safetensors.torch import save_file

        index = len(self.written)
        fname = f"model-{index + 1:05d}.safetensors"
        save_file(self.batch, str(self.out / fname), metadata={"format": "pt"})
        self.written.append(list(self.batch))
        self.batch, self.size = {}, 0

    def close(self) -> None:
        if self.batch:
            self._flush()
        total = len(self.written)
        for i, names in enumerate(self.written):
            old = self.out / f"model-{i + 1:05d}.safetensors"
            new = self.out / f"model-{i + 1:05d}-of-{total:05d}.safetensors"
            old.rename(new)
            for n in names:
                self.weight_map[n] = new.name
        (self.out / INDEX).write_text(json.dumps(
            {"metadata": {"total_size": self.total}, "weight_map": self.weight_map}, indent=2))
