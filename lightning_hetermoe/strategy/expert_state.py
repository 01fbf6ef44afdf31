"""Expert tensors across ranks: slicing them onto holders, gathering them back, moving them.

* **Checkpoints** hold every expert once, with its optimizer state, whatever the placement:
  saving gathers into *new* dicts (live state is never touched); loading slices the full
  tensors down to what this rank holds.
* **Migration** (the rebalancer) moves experts to a new placement at a step boundary:
  weights and every per-parameter optimizer tensor (Adam moments, momentum buffers) travel
  with their expert, copies start from the same values.

Both work through the backend's :meth:`~.backend.ParallelBackend.gather_experts`, so
they mean the same under expert parallelism and under zebra.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import Tensor, nn

import lightning_hetermoe.comm as comm
from ..comm import Group
from ..model_contract import moe_layers
from ..placement import Placement


def slice_experts(layer, mine: list[int]) -> None:
    """Keep rows ``mine`` (global expert ids, in that order) of every expert tensor."""
    ex = layer.experts
    idx = torch.tensor(mine, dtype=torch.long, device=ex.expert_ids.device)
    for pname, p in list(ex.named_parameters(recurse=False)):
        setattr(ex, pname, nn.Parameter(p.detach()[idx.to(p.device)].clone(), requires_grad=p.requires_grad))
    ex.expert_ids = idx


def unslice_experts(layer, full: dict[str, Tensor]) -> None:
    """Every expert again (``full``: parameter name -> gathered ``[E, ...]`` tensor)."""
    ex = layer.experts
    for pname, p in list(ex.named_parameters(recurse=False)):
        setattr(ex, pname, nn.Parameter(full[pname], requires_grad=p.requires_grad))
    ex.expert_ids = torch.arange(layer.num_experts, device=ex.expert_ids.device)


def restore_local(layers: list, gather: Any) -> None:
    """Every expert of every layer gathered back (``gather(l, local, name) -> full``), and the
    layers dispatching locally again: the whole model on this rank."""
    from ..moe import LocalDispatcher
    from ..moe.balance import LocalBalance
    from ..moe.layer import every_token_real

    for l, layer in enumerate(layers):
        full = {pname: gather(l, p.detach(), pname) for pname, p in layer.experts.named_parameters(recurse=False)}
        unslice_experts(layer, full)
        layer.dispatcher = LocalDispatcher()
        layer.balance = LocalBalance()
        layer.real_tokens = every_token_real


def expert_tensor_names(module: nn.Module) -> list[str]:
    """Names of every MoE layer's expert tensors in ``module`` (what DDP must leave alone:
    a backend that spreads experts syncs them itself)."""
    names = []
    for prefix, layer in moe_layers(module):
        at = f"{prefix}.experts" if prefix else "experts"
        names += [f"{at}.{pname}" for pname, _ in layer.experts.named_parameters(recurse=False)]
        names.append(f"{at}.expert_ids")
    return names


def gather_experts(local: Tensor, held: list[list[int]], group: Group) -> Tensor:
    """All-gather per-holder expert slices (uneven first dims) into the full ``[E, ...]``
    tensor; ``held[r]`` lists the ids group rank ``r`` holds, in its local order."""
    most = max(len(p) for p in held)
    padded = local.new_zeros((most,) + tuple(local.shape[1:]))
    padded[: local.shape[0]] = local
    chunks = [torch.empty_like(padded) for _ in held]
    comm.all_gather(group, chunks, padded.contiguous(), what="experts.gather")
    full = local.new_empty((len({e for p in held for e in p}),) + tuple(local.shape[1:]))
    for chunk, experts in zip(chunks, held, strict=True):
        if experts:
            full[torch.tensor(experts, device=local.device)] = chunk[: len(experts)]
    return full


def _replace(opt: Any, old: nn.Parameter, new: nn.Parameter, state: dict) -> None:
    """``new`` in ``old``'s place in ``opt``'s groups, with ``state``."""
    for group in opt.param_groups:
        group["params"] = [new if q is old else q for q in group["params"]]
    opt.state.pop(old, None)
    if state:
        opt.state[new] = state


def _to_host(t: Tensor) -> Tensor:
    # Whole moments on a GPU would hold twice the whole experts' size (Adam) beside the whole
    # weights, on every rank, at the end of a run that only needed its share: after the run
    # nothing steps this optimizer (a new fit builds its own), a checkpoint only reads it, so
    # it waits in host memory, one tensor on the device at a time.
    return t.to("cpu") if t.device.type == "cuda" else t


def _params(optimizer) -> list[nn.Parameter]:
    return [p for g in getattr(optimizer, "_optimizer", optimizer).param_groups for p in g["params"]]


class ExpertState:
    """Placement-independent expert state of ``module`` under ``backend``."""

    def __init__(self, backend: Any, module: nn.Module) -> None:
        self.backend, self.module = backend, module

    def _layers(self) -> list[tuple[int, str, Any]]:
        if not self.backend.spread:
            return []
        return [(l, name, layer) for l, (name, layer) in enumerate(moe_layers(self.module))]

    # -- checkpoints --------------------------------------------------------------------
    def module_state(self, local: dict[str, Tensor] | None = None) -> dict[str, Any]:
        """The whole model's state dict (every expert gathered: a collective). ``local``: a
        state dict laid out as the module is (a weight average's copy of it) instead of the
        module's own; where it is kept in host memory (``WeightAveraging(device="cpu")``
        beside a GPU), each tensor is gathered on the compute device and comes back whole
        where it was."""
        state = dict(local) if local is not None else self.module.state_dict()
        for l, name, layer in self._layers():
            for pname, p in layer.experts.named_parameters(recurse=False):
                key = f"{name}.experts.{pname}"
                held = state[key].detach()
                state[key] = self.backend.gather_experts(l, held.to(p.device), pname).to(held.device)
        return state

    def load_module_state(self, full: dict[str, Tensor], strict: bool) -> dict[str, Tensor]:
        """A full checkpoint's state dict into the laid-out module: each rank keeps its part
        of every expert tensor; a dense tensor this rank keeps empty stays empty. Returns the
        part it loaded (:meth:`local_state`)."""
        mine = self.local_state(full)
        self.module.load_state_dict(mine, strict=strict)
        return mine

    def local_state(self, full: dict[str, Tensor]) -> dict[str, Tensor]:
        """A full state dict cut to what this rank holds, laid out as the module is."""
        local = self.module.state_dict(keep_vars=True)
        mine = dict(full)
        for l, name, layer in self._layers():
            for pname, p in layer.experts.named_parameters(recurse=False):
                key = f"{name}.experts.{pname}"
                if key in mine:
                    part = self.backend.local_part(l, pname, mine[key], p)
                    if part is None:
                        raise ValueError(f"{key}: the checkpoint's tensor of shape {list(mine[key].shape)} does not "
                                         f"match the model's experts")
                    mine[key] = part
        for key, t in local.items():
            if t.numel() == 0 and key in mine and mine[key].numel() != 0:
                mine[key] = t.detach()  # not held here (a zebra expert rank's dense part)
        return mine

    def gathered_optimizer_state(self, state: dict[str, Any], optimizer) -> dict[str, Any]:
        if not self._layers():
            return state
        # ``Optimizer.state_dict()`` hands out the optimizer's own per-parameter dicts: copy
        # them before writing gathered tensors, or the live optimizer would step on them.
        state = {**state, "state": {k: dict(v) for k, v in state["state"].items()}}
        for l, pname, p, slot in self._slots(state, optimizer):
            slot.update(self._whole_slot(l, pname, p, slot))
        return state

    def _whole_slot(self, l: int, pname: str, p: nn.Parameter, slot: dict, place=lambda t: t) -> dict:
        """An expert parameter's optimizer state with each per-element tensor (its
        parameter's shape) gathered whole (a collective, in the slot's key order) and handed
        to ``place``; scalars as they are."""
        return {key: place(self.backend.gather_experts(l, value, pname)) if _per_element(value, p) else value
                for key, value in sorted(slot.items())}

    def slice_optimizer_state(self, opt_state: dict[str, Any], optimizer) -> None:
        """A full checkpoint's optimizer state, cut down to what this rank holds (in place)."""
        if not self._layers():
            return
        for l, pname, p, slot in self._slots(opt_state, optimizer):
            for key, value in list(slot.items()):
                part = self.backend.local_part(l, pname, value, p) if torch.is_tensor(value) else None
                if part is not None:
                    slot[key] = part
        if not self.backend.holds_dense:
            # A rank without dense weights keeps no dense optimizer state either.
            for i, p in enumerate(_params(optimizer)):
                if p.numel() == 0:
                    opt_state["state"].pop(i, None)

    def _slots(self, opt_state: dict[str, Any], optimizer) -> Iterator[tuple[int, str, nn.Parameter, dict]]:
        """(layer index, parameter name, expert parameter, its per-parameter optimizer
        state) for every expert parameter that has state; optimizer state is keyed by
        parameter position."""
        index = {id(p): i for i, p in enumerate(_params(optimizer))}
        for l, _, layer in self._layers():
            for pname, p in layer.experts.named_parameters(recurse=False):
                slot = opt_state["state"].get(index.get(id(p)))
                if slot:
                    yield l, pname, p, slot

    # -- after a run: the optimizer made whole with the module ---------------------------
    def gather_optimizer_states(self, optimizers: list) -> list[tuple[Any, str, nn.Parameter, dict]]:
        """Before the backend gathers the model back whole at the end of a run: every expert
        parameter's optimizer state gathered whole (a collective, in layer and parameter
        order on every rank), ``(optimizer, parameter name, the laid-out parameter, its
        state)``, for :meth:`adopt_whole` to hand to the whole parameters once they exist."""
        out = []
        slots = [(getattr(opt, "_optimizer", opt), l, name, pname, p) for opt in optimizers
                 for l, name, layer in self._layers() for pname, p in layer.experts.named_parameters(recurse=False)]
        # Whether a parameter has state can differ between ranks: a rank holding none of a
        # layer's experts holds empty tensors, and Lightning's fine-tuning callback, which
        # tests membership by value, finds an empty tensor "already in" the optimizer and
        # leaves it out. Such a rank still takes part in every gather, with nothing.
        mine = [sorted(k for k, v in (inner.state.get(p) or {}).items() if _per_element(v, p)) or None
                for inner, _, _, _, p in slots]
        everyone = comm.gather_objects(comm.world(), mine, what="experts.optimizer_keys") \
            if comm.configured() and comm.world().size > 1 else [mine]
        for i, (inner, l, name, pname, p) in enumerate(slots):
            st = inner.state.get(p)
            if st:
                out.append((inner, f"{name}.experts.{pname}", p, self._whole_slot(l, pname, p, st, _to_host)))
                continue
            keys = next((keys[i] for keys in everyone if keys[i]), None)
            if keys is not None and p.numel() == 0:
                self._whole_slot(l, pname, p, {k: torch.empty_like(p) for k in keys})
        return out

    def adopt_whole(self, gathered: list[tuple[Any, str, nn.Parameter, dict]], names: dict[int, str]) -> None:
        """The module's whole expert parameters take the laid-out ones' places in each
        optimizer, with their gathered state: the optimizer matches the module again, so a
        checkpoint saved after the run (``trainer.save_checkpoint`` after ``fit``) holds
        every expert's moments, as one process's would. ``names`` (by ``id`` of the
        parameter an optimizer holds) records which, for :meth:`follow_module`."""
        params = dict(self.module.named_parameters())
        for opt, name, old, whole in gathered:
            _replace(opt, old, params[name], whole)
            names.pop(id(old), None)
            names[id(params[name])] = name

    def follow_module(self, optimizers: list, names: dict[int, str]) -> None:
        """A later run on the same trainer (``validate`` after ``fit``) lays the model out and
        gathers it back as new parameter objects: the optimizers' whole expert parameters
        (``names``) are pointed at the module's current ones, state and all."""
        params = dict(self.module.named_parameters())
        for opt in {id(o): getattr(o, "_optimizer", o) for o in optimizers}.values():
            for old in [q for group in opt.param_groups for q in group["params"] if id(q) in names]:
                new = params.get(names[id(old)])
                if new is not None and new is not old and new.shape == old.shape:
                    name = names.pop(id(old))
                    _replace(opt, old, new, opt.state.pop(old, {}))
                    names[id(new)] = name

    # -- migration ----------------------------------------------------------------------
    def move(self, new: Placement, optimizers: list, companions: list[dict[str, Tensor]] = ()) -> int:
        """Move experts to ``new`` on every rank (a collective: every rank passes the same
        placement). Returns the expert copies that moved. ``companions``: state dicts laid
        out as the module is (a weight average's); their expert tensors move alike, each
        entry replaced by its moved tensor, on the device it was on (gathered on the
        compute device, as :meth:`module_state` does)."""
        current = self.backend.placement()
        me = self.backend.holder_index()
        for l, name, layer in self._layers():
            if new.held[l] == current.held[l]:
                continue
            idx = torch.tensor(new.experts_of(me, l), dtype=torch.long, device="cpu")
            for pname, p in layer.experts.named_parameters(recurse=False):
                key = f"{name}.experts.{pname}"
                for companion in companions:
                    held = companion[key]
                    whole = self.backend.gather_experts(l, held.to(p.device), pname)
                    companion[key] = whole[idx.to(whole.device)].to(held.device)
                full = self.backend.gather_experts(l, p.data, pname)  # gathered with the old placement in force
                states = []
                for opt in optimizers:
                    st = opt.state.get(p)
                    for key, value in (st or {}).items():
                        if torch.is_tensor(value) and value.dim() > 0 and value.shape == p.shape:
                            states.append((st, key, self.backend.gather_experts(l, value, pname)))
                p.data = full[idx.to(full.device)].clone()
                p.grad = None
                for st, key, value in states:
                    st[key] = value[idx.to(value.device)].clone()
            layer.experts.expert_ids = idx.to(layer.experts.expert_ids.device)
        self.backend.adopt_placement(new)
        return new.moved_copies(current)


def _per_element(value: Any, p: nn.Parameter) -> bool:
    """An optimizer state entry with one value per element of ``p`` (Adam's moments, not its step)."""
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == p.shape
