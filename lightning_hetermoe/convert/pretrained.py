"""Pretrained Hugging Face MoE weights, read per rank: each process reads only the tensors,
and the rows of stacked experts, that it holds.

:func:`from_pretrained` builds the model a ``save_pretrained`` directory describes on the
meta device (no storage), converts its sparse MoE blocks (:func:`~.hf.to_hetermoe`) and
attaches a :class:`HFWeights` source; the strategy materialises each rank's share at set-up
and the source fills it from the safetensors files, through the index JSON of a sharded
save. safetensors reads a slice of a tensor without loading its file, so a rank holding
experts 3 and 4 of a layer reads those rows and nothing else.

Names on disk follow what ``save_pretrained`` writes: the model's own names, except the
experts, which Transformers 5 writes one expert at a time (``experts.{e}.gate_proj.weight``
and the like; Mixtral's ``w1/w3/w2`` under ``block_sparse_moe``), and also reads fused
(``experts.gate_up_proj``). Both are read here.
"""

from __future__ import annotations

import json
import os
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .hf import PER_EXPERT_NAMES, HFMoEBlock, to_hetermoe

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class PretrainedError(ValueError):
    """A pretrained directory does not hold what the model needs."""


class SafetensorsDirectory:
    """The tensors of a ``save_pretrained`` directory by name (one file, or sharded with its
    index); reads whole tensors or rows, without loading whole files."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        index = self.directory / INDEX_FILE
        if index.is_file():
            self.files = dict(json.loads(index.read_text())["weight_map"])
        elif (self.directory / SINGLE_FILE).is_file():
            from safetensors import safe_open

            with safe_open(str(self.directory / SINGLE_FILE), "pt") as f:
                self.files = {k: SINGLE_FILE for k in f.keys()}
        else:
            raise PretrainedError(f"{self.directory} holds neither {INDEX_FILE} nor {SINGLE_FILE}: pass a directory "
                                  f"written by save_pretrained (safetensors)")
        self._stack: ExitStack | None = None
        self._open: dict[str, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def __enter__(self) -> "SafetensorsDirectory":
        self._stack = ExitStack()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._open.clear()
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def _file(self, name: str) -> Any:
        from safetensors import safe_open

        if name not in self.files:
            raise PretrainedError(f"{self.directory} has no tensor {name!r}")
        fname = self.files[name]
        if fname not in self._open:
            handle = safe_open(str(self.directory / fname), "pt")
            self._open[fname] = self._stack.enter_context(handle) if self._stack is not None else handle
        return self._open[fname]

    def read(self, name: str) -> Tensor:
        return self._file(name).get_tensor(name)

    def read_rows(self, name: str, rows: list[int]) -> Tensor:
        """``tensor[rows]`` of a stacked tensor: one slice per run of consecutive rows."""
        sl = self._file(name).get_slice(name)
        parts, start = [], 0
        for i in range(1, len(rows) + 1):
            if i == len(rows) or rows[i] != rows[i - 1] + 1:
                parts.append(sl[rows[start]:rows[i - 1] + 1])
                start = i
        if not parts:
            shape = sl.get_shape()
            return torch.empty((0, *shape[1:]))
        return torch.cat(parts) if len(parts) > 1 else parts[0]


class HFWeights:
    """A :class:`~lightning_hetermoe.strategy.materialize.WeightSource` for a converted
    Hugging Face model: its tensors by name from a ``save_pretrained`` directory. Holds only
    the directory path and the converted blocks' paths (it travels with the model)."""

    def __init__(self, directory: str | os.PathLike, blocks: list[str]) -> None:
        self.directory = str(directory)
        self.blocks = sorted(blocks, key=len, reverse=True)

    def fill(self, targets: dict[str, Any]) -> set[str]:
        filled = set()
        with SafetensorsDirectory(self.directory) as disk:
            prefixes = {block: self._disk_prefix(disk, block) for block in self.blocks}
            for name, target in targets.items():
                if target.local.numel() == 0:
                    continue  # not held here: nothing to read
                value = self._value(disk, prefixes, name, target.rows)
                if value is None:
                    continue
                if tuple(value.shape) != tuple(target.local.shape):
                    raise PretrainedError(f"{name}: {self.directory} gives shape {list(value.shape)}, the model "
                                          f"holds {list(target.local.shape)} here")
                target.local.data.copy_(value)
                filled.add(name)
        return filled

    def _disk_prefix(self, disk: SafetensorsDirectory, block: str) -> str:
        """Where a block's tensors are on disk: its own path, or a sibling name (Mixtral's
        ``block_sparse_moe``) found by its router weight."""
        if f"{block}.gate.weight" in disk:
            return block
        parent = block.rsplit(".", 1)[0] if "." in block else ""
        pattern = re.compile(rf"^{re.escape(parent)}\.([^.]+)\.gate\.weight$" if parent else r"^([^.]+)\.gate\.weight$")
        found = [k for k in disk.files if pattern.match(k)]
        if len(found) != 1:
            raise PretrainedError(f"{disk.directory}: cannot find the router weights of MoE block {block} "
                                  f"(looked for {block}.gate.weight and {parent}.<name>.gate.weight)")
        return found[0][: -len(".gate.weight")]

    def _value(self, disk: SafetensorsDirectory, prefixes: dict[str, str], name: str, rows: list[int] | None
               ) -> Tensor | None:
        block = next((b for b in self.blocks if name.startswith(b + ".")), None)
        if block is None:
            return disk.read(name) if name in disk else None
        d, local = prefixes[block], name[len(block) + 1:]
        if local == "router.weight":
            return disk.read(f"{d}.gate.weight")
        if local == "router.expert_bias":
            key = f"{d}.gate.e_score_correction_bias"
            return disk.read(key).float() if key in disk else None  # absent: starts even (the layer's init)
        if local in ("experts.w_up", "experts.w_down"):
            return self._experts(disk, d, local, rows)
        if local.startswith("shared_expert."):
            return self._shared(disk, d, local)
        return None

    def _experts(self, disk: SafetensorsDirectory, d: str, local: str, rows: list[int]) -> Tensor:
        if f"{d}.experts.gate_up_proj" in disk:
            fused = "gate_up_proj" if local == "experts.w_up" else "down_proj"
            return disk.read_rows(f"{d}.experts.{fused}", rows).transpose(1, 2)
        names = next((n for n in PER_EXPERT_NAMES if f"{d}.experts.0.{n[0]}.weight" in disk), None)
        if names is None:
            raise PretrainedError(f"{disk.directory}: no experts under {d}.experts (fused gate_up_proj/down_proj or "
                                  f"per-expert {' or '.join('/'.join(n) for n in PER_EXPERT_NAMES)})")
        gate, up, down = names
        out = []
        for e in rows:
            at = f"{d}.experts.{e}."
            if local == "experts.w_up":
                out.append(torch.cat([disk.read(f"{at}{gate}.weight").t(), disk.read(f"{at}{up}.weight").t()], 1))
            else:
                out.append(disk.read(f"{at}{down}.weight").t())
        return torch.stack(out)

    def _shared(self, disk: SafetensorsDirectory, d: str, local: str) -> Tensor | None:
        hf = next((h for h in ("shared_expert", "shared_experts") if f"{d}.{h}.gate_proj.weight" in disk), None)
        if local == "shared_expert.gate":
            key = f"{d}.shared_expert_gate.weight"
            return disk.read(key) if key in disk else None
        if hf is None:
            return None
        if local == "shared_expert.w_up":
            return torch.cat([disk.read(f"{d}.{hf}.gate_proj.weight").t(), disk.read(f"{d}.{hf}.up_proj.weight").t()], 1)
        if local == "shared_expert.w_down":
            return disk.read(f"{d}.{hf}.down_proj.weight").t()
        return None


def from_pretrained(directory: str | os.PathLike, *, dtype: torch.dtype = torch.float32, **moe_options: Any
                    ) -> nn.Module:
    """The Hugging Face MoE causal LM saved in ``directory`` (``save_pretrained``), built on
    the meta device and converted (:func:`~.hf.to_hetermoe`, ``moe_options`` as there), its
    weights read when it is materialised: by the strategy at set-up, each rank only what it
    holds (wrap it in :class:`~.lm.HFMoELanguageModel`), or whole by :func:`materialize_whole`.
    Nothing is downloaded: ``directory`` is a local path."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise ImportError("from_pretrained needs transformers: pip install 'lightning-hetermoe[hf]'") from None
    path = Path(directory)
    if not (path / "config.json").is_file():
        raise PretrainedError(f"{path} has no config.json: pass a directory written by save_pretrained")
    SafetensorsDirectory(path)  # fails now, with the reason, if there are no safetensors
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    to_hetermoe(model, **moe_options)
    blocks = [n for n, m in model.named_modules() if isinstance(m, HFMoEBlock)]
    model.hetermoe_weights = HFWeights(path, blocks)
    return model


def materialize_whole(module: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """Materialise every tensor of a meta-built model in this process (tests, export,
    single-device use outside the strategy); returns ``module``."""
    from ..model_contract import moe_layers
    from ..materialize import Holding, Materializer

    rows = [list(range(layer.num_experts)) for _, layer in moe_layers(module)]
    Materializer(torch.device(device), torch.initial_seed())(module, Holding(dense=True, rows=rows))
    return module
