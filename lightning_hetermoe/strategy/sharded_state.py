"""Sharded checkpoints of a laid-out model: every rank writes and reads only what it holds.

The checkpoint is a directory (:mod:`lightning_hetermoe.ckpt.dcp`): each module tensor
and each per-element optimizer tensor as flat pieces, keyed by the tensor's name in the
LightningModule's ``state_dict`` (``state_dict.<name>``, ``optimizer_states.<i>.<name>.<key>``),
so nothing in it depends on the placement, the world size or the mode; plus ``meta.pt``
(Lightning's loop and callback state, every tensor's shape, the optimizers' hyper-parameters
and which parameter each of their slots is). Saving reads live tensors and writes them: it
never changes them. Loading fills this rank's pieces in place and rebuilds the optimizer
state over the parameters this rank holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn

from ..ckpt import dcp
from ..ckpt.pieces import Pieces
from ..model_contract import moe_layers

META_FILE = "meta.pt"  # Lightning's name for the non-tensor part of a sharded checkpoint
FORMAT_VERSION = 1
# a fit resumed from a checkpoint saved with ModelCheckpoint(save_weights_only=True): what
# Lightning raises for its own file, so either format fails a resume alike
WEIGHTS_ONLY_RESUME = ("Trying to restore optimizer state but checkpoint contains only the model. This is probably "
                       "due to `ModelCheckpoint.save_weights_only` being set to `True`.")


def _params(optimizer) -> list[nn.Parameter]:
    return [p for g in getattr(optimizer, "_optimizer", optimizer).param_groups for p in g["params"]]


class ShardedState:
    """This rank's pieces of ``module`` and its optimizers under ``backend``'s layout.

    ``expert_pieces(layer, name, local) -> Pieces``: how the backend holds expert tensor
    ``name`` of MoE layer ``layer`` (rows, a range, or all of it)."""

    def __init__(self, module: nn.Module, expert_pieces: Callable[[int, str, Tensor], Pieces],
                 dense_held: bool, shapes: dict[str, tuple[int, ...]] | None = None, sharding: Any = None) -> None:
        self.module = module
        # optimizer state sharded over replicas (:mod:`.zero`): the optimizers step range views
        self.sharding = sharding
        self.ranges = sharding.shard_names() if sharding is not None else {}
        self.expert_pieces = expert_pieces
        self.dense_held = dense_held
        self.experts: dict[str, tuple[int, str]] = {}  # state_dict name -> (layer, parameter name)
        for l, (prefix, layer) in enumerate(moe_layers(module)):
            at = f"{prefix}.experts" if prefix else "experts"
            for pname, _ in layer.experts.named_parameters(recurse=False):
                self.experts[f"{at}.{pname}"] = (l, pname)
        self.shapes = dict(shapes or {})  # whole shapes of tensors this rank does not hold (stripped)

    # -- layout ---------------------------------------------------------------------------
    def pieces_of(self, name: str, local: Tensor) -> Pieces | None:
        """``local`` (the module tensor ``name``, or optimizer state of its shape) as pieces;
        ``None`` where this rank holds none of it."""
        if name in self.experts:
            l, pname = self.experts[name]
            return self.expert_pieces(l, pname, local)
        if local.numel() == 0 and name in self.shapes:
            return None  # a dense tensor this rank does not hold
        return Pieces.whole(local)

    def module_tensors(self) -> Iterator[tuple[str, Tensor]]:
        yield from self.module.state_dict(keep_vars=True).items()

    def param_names(self) -> dict[int, str]:
        names: dict[int, str] = {}
        for n, p in self.module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), n)
        return names

    def whole_shape(self, name: str, local: Tensor) -> tuple[int, ...]:
        if name in self.shapes:
            return tuple(self.shapes[name])
        pieces = self.pieces_of(name, local)
        return tuple(pieces.shape) if pieces is not None else tuple(local.shape)

    def slot(self, p: Tensor, names: dict[int, str]) -> tuple[str, Callable[[Tensor], Pieces | None]] | None:
        """The name an optimizer parameter's state is saved under, and how a per-element
        tensor of it is cut into pieces (``None``: not a parameter this rank holds)."""
        if id(p) in self.ranges:
            name, lo, shape = self.ranges[id(p)]
            return name, lambda value: Pieces.of_range(value, lo, shape)
        if id(p) not in names or p.numel() == 0:
            return None
        name = names[id(p)]
        return name, lambda value: self.pieces_of(name, value)

    def group_names(self, opt) -> list[list[str | None]]:
        """Parameter names per group as the optimizer was built (before any sharding)."""
        names = self.param_names()
        groups = self.sharding.original_groups(opt) if self.sharding is not None else None
        groups = groups or [g["params"] for g in opt.param_groups]
        return [[names.get(id(p)) for p in g] for g in groups]

    # -- saving ---------------------------------------------------------------------------
    def module_state(self, local: dict[str, Tensor] | None = None) -> dict[str, Pieces]:
        """This rank's pieces of the module's tensors, or of ``local``: a state dict laid out
        as the module is (a weight average's copy of it)."""
        out: dict[str, Pieces] = {}
        for name, t in (local.items() if local is not None else self.module_tensors()):
            pieces = self.pieces_of(name, t.detach())
            if pieces is not None:
                out[name] = pieces
        return out

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        """``{"tensors": {"<name>.<key>": Pieces | scalar tensor}, "meta": ...}`` of one optimizer."""
        opt = getattr(optimizer, "_optimizer", optimizer)
        names = self.param_names()
        tensors: dict[str, Any] = {}
        scalars: dict[str, dict[str, Any]] = {}
        for p in _params(opt):
            slot = self.slot(p, names)
            if slot is None:
                continue
            name, cut = slot
            for key, value in opt.state.get(p, {}).items():
                if torch.is_tensor(value) and value.dim() > 0:
                    if value.shape != p.shape:
                        raise dcp.CheckpointFormatError(
                            f"optimizer state {key!r} of {name} has shape {list(value.shape)}, its parameter "
                            f"{list(p.shape)}: a sharded checkpoint stores per-element state and scalars only "
                            f"(save with checkpoint_format='full')")
                    pieces = cut(value.detach())
                    if pieces is not None:
                        tensors[f"{name}.{key}"] = pieces
                elif torch.is_tensor(value):
                    tensors[f"{name}.{key}"] = value.detach()
                else:
                    scalars.setdefault(name, {})[key] = value
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": params}
                  for g, params in zip(opt.param_groups, self.group_names(opt), strict=True)]
        return {"tensors": tensors, "meta": {"param_groups": groups, "scalars": scalars}}

    def shapes_meta(self) -> dict[str, tuple[int, ...]]:
        return {name: self.whole_shape(name, t) for name, t in self.module_tensors()}

    # -- loading ----------------------------------------------------------------------------
    def load(self, path: str | Path, meta: dict[str, Any], optimizers: list, process_group: Any, strict: bool,
             with_optimizers: bool, with_current: bool = False) -> dict[str, Any]:
        """Fill this rank's pieces from the checkpoint directory ``path`` (``meta``: its
        ``meta.pt``, as the caller read it); returns the rest of the checkpoint (Lightning's
        state).

        A checkpoint saved with Lightning's weight averaging holds the average as the model
        (what the module gets, as in one process) and the trained weights beside it
        (``current_model_state.*``). ``with_current`` (a resumed fit with the averaging
        callback): the trained weights come back too, laid out as the module is, for the
        callback to put back: the returned ``state_dict`` is the module's (the average,
        loaded in place) and ``current_model_state`` this rank's share of the trained
        weights (a second copy of it, only where the callback takes it)."""
        path = Path(path)
        info = meta.get("hetermoe", {})
        if info.get("version") != FORMAT_VERSION:
            raise dcp.CheckpointFormatError(f"{path} is not a lightning-hetermoe sharded checkpoint "
                                            f"(format {info.get('version')!r}, expected {FORMAT_VERSION})")
        saved = dcp.read_metadata(path).state_dict_metadata
        want: dict[str, Any] = {f"state_dict.{n}": pieces for n, pieces in self.module_state().items()}
        installs = []
        if with_optimizers:
            if len(info.get("optimizers", [])) != len(optimizers):
                raise dcp.CheckpointFormatError(f"the checkpoint has {len(info.get('optimizers', []))} optimizer(s), "
                                                f"the run {len(optimizers)}")
            for i, (opt, opt_meta) in enumerate(zip(optimizers, info["optimizers"], strict=True)):
                state, install = self._optimizer_targets(i, opt, opt_meta, saved)
                want.update(state)
                installs.append(install)
        current = None
        if with_current and "averaging_state" in meta:
            current = {n: torch.empty_like(t) for n, t in self.module_tensors()}
            for n, pieces in self.module_state(current).items():
                want[f"current_model_state.{n}"] = pieces
        dcp.load(want, path, process_group=process_group, strict=strict)
        for install in installs:
            install()
        if current is not None:
            # the callback copies the average out of these before it loads the trained
            # weights into the module: views of the module's tensors are safe to hand it
            meta["state_dict"] = {n: t.detach() for n, t in self.module_tensors()}
            meta["current_model_state"] = current
        return meta

    def _optimizer_targets(self, i: int, optimizer, opt_meta: dict, saved: dict) -> tuple[dict, Callable]:
        """Destinations for optimizer ``i``'s saved state (allocated here, shaped like this
        rank's parameters), and the step that installs them once filled."""
        opt = getattr(optimizer, "_optimizer", optimizer)
        names = self.param_names()
        groups = opt_meta["param_groups"]
        if len(groups) != len(opt.param_groups):
            raise dcp.CheckpointFormatError(f"optimizer {i}: the checkpoint has {len(groups)} parameter groups, the "
                                            f"run {len(opt.param_groups)}")
        prefix = f"optimizer_states.{i}."
        want: dict[str, Any] = {}
        per_param: list[tuple[nn.Parameter, str, dict[str, Any]]] = []
        for p in _params(opt):
            slot = self.slot(p, names)
            if slot is None:
                continue
            name, cut = slot
            slots: dict[str, Any] = {}
            at = f"{prefix}{name}."
            for key, md in saved.items():
                if not key.startswith(at) or "." in key[len(at):]:
                    continue
                slot = key[len(at):]
                dtype = md.properties.dtype
                if len(md.size) == 0:
                    slots[slot] = want[key] = torch.zeros((), dtype=dtype, device="cpu")  # read on the host
                else:
                    local = torch.zeros(p.shape, dtype=dtype, device=p.device)
                    pieces = cut(local)
                    if pieces is not None:
                        want[key] = pieces
                        slots[slot] = local
            per_param.append((p, name, slots))

        def install() -> None:
            for p, name, slots in per_param:
                state = dict(slots)
                state.update(opt_meta["scalars"].get(name, {}))
                if state:
                    if "step" in state and torch.is_tensor(state["step"]):
                        # torch keeps Adam's step on the CPU unless the optimizer is capturable/fused
                        state["step"] = state["step"].to(p.device if _step_on_device(opt) else "cpu")
                    opt.state[p] = state
            for group, saved_group in zip(opt.param_groups, groups, strict=True):
                for k, v in saved_group.items():
                    if k != "params":
                        group[k] = v

        return want, install


def _step_on_device(opt) -> bool:
    return any(g.get("capturable") or g.get("fused") for g in opt.param_groups)
