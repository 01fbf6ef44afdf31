"""Experts the user writes: any ``nn.Module`` mapping ``[n, d_model] -> [n, d_model]``.

FastMoE's interface: give the layer an expert class (or a list of expert modules) and it
holds ``num_experts`` of them. They are kept the way the pack keeps its own MLP experts:
each of the expert's parameters stacked over the experts into one ``[E, ...]`` parameter.
So everything a strategy does to experts (slice rows, move rows with their optimizer
state, gather full tensors into a placement-independent checkpoint) works on them
unchanged, because it only ever indexes dimension 0 of the experts' parameters. Each expert
runs as its module would, through ``torch.func.functional_call`` on a meta-device template
with that expert's rows: the per-expert path (the grouped kernels stay with the pack's MLP).
"""

from __future__ import annotations

import copy
import math
import pickle
from typing import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call

from ..seeded_init import derive, draw_seed, seeded_default_generator

SEPARATOR = "__"  # a stacked parameter's name is the expert's parameter name with "." -> "__"


class ExpertContractError(ValueError):
    """The expert module cannot be stacked (see :class:`ModuleExperts`)."""


def build_expert_modules(experts: Callable[[], nn.Module] | Sequence[nn.Module], num_experts: int,
                         seed: int | None = None) -> list[nn.Module]:
    """``experts``: a class or factory called with no argument once per expert, or the list
    of ``num_experts`` modules itself. A factory builds expert ``e`` with torch's default
    generator seeded from ``seed`` and ``e``, on the CPU (or on the meta device under a
    meta-device context): expert ``e`` gets the same values however many are built."""
    if isinstance(experts, (list, tuple, nn.ModuleList)):
        modules = list(experts)
        if len(modules) != num_experts:
            raise ExpertContractError(f"experts is a list of {len(modules)} modules; moe.num_experts is {num_experts}")
    elif callable(experts):
        modules = [build_expert(experts, seed, e) for e in range(num_experts)]
    else:
        raise ExpertContractError(f"experts must be an nn.Module class or factory, or a list of modules; got "
                                  f"{type(experts).__name__}")
    for i, m in enumerate(modules):
        if not isinstance(m, nn.Module):
            raise ExpertContractError(f"expert {i} is a {type(m).__name__}, not an nn.Module")
    return modules


def build_expert(factory: Callable[[], nn.Module], seed: int | None, e: int, on_meta: bool | None = None
                 ) -> nn.Module:
    """Expert ``e`` from ``factory``, its random draws from a generator of its own."""
    if on_meta is None:
        on_meta = torch.empty(0).is_meta  # the current default device
    device = torch.device("meta" if on_meta else "cpu")
    if seed is None:
        with device:
            return factory()
    with seeded_default_generator(derive(seed, e)), device:
        return factory()


class ModuleExperts(nn.Module):
    """``num_experts`` copies of a user's expert module, stored stacked (see module doc).

    Contract: every expert has the same parameter names and shapes, at least one
    parameter, no buffers (running statistics would be per expert state the strategy
    cannot see), and maps ``[n, d_model]`` rows to ``[n, d_model]``.
    """

    backend = "torch"  # what the strategy's kernel set-up reads: nothing to tune here

    def __init__(self, experts: Callable[[], nn.Module] | Sequence[nn.Module], num_experts: int, d_model: int
                 ) -> None:
        super().__init__()
        self.init_seed = draw_seed()
        # kept to re-create any expert's initial values (a rank materialises only its own)
        self._factory = experts if callable(experts) and not isinstance(experts, (list, tuple, nn.Module)) else None
        modules = build_expert_modules(experts, num_experts, self.init_seed)
        first = modules[0]
        names = [n for n, _ in first.named_parameters()]
        if not names:
            raise ExpertContractError(f"the expert module {type(first).__name__} has no parameters")
        buffers = [n for n, _ in first.named_buffers()]
        if buffers:
            raise ExpertContractError(f"the expert module {type(first).__name__} has buffers {buffers}: experts may "
                                      f"hold parameters only (a strategy moves experts by their parameters)")
        for i, m in enumerate(modules[1:], start=1):
            shapes = {n: p.shape for n, p in m.named_parameters()}
            if shapes != {n: p.shape for n, p in first.named_parameters()}:
                raise ExpertContractError(f"expert {i} has parameters {shapes}, expert 0 has "
                                          f"{ {n: p.shape for n, p in first.named_parameters()} }: every expert must "
                                          f"have the same parameter names and shapes")
        self.d_model = d_model
        self.names = names
        device = torch.empty(0).device  # the factory built on the CPU: the stack goes where the caller builds
        for n in names:
            stacked = torch.stack([dict(m.named_parameters())[n].detach() for m in modules])
            self.register_parameter(n.replace(".", SEPARATOR), nn.Parameter(stacked.to(device).clone()))
        # the module's code, without storage: each call runs it on one expert's rows
        template = copy.deepcopy(first).to("meta")
        object.__setattr__(self, "_template", template)  # not a submodule: its (meta) parameters are not the model's
        self.register_buffer("expert_ids", torch.arange(num_experts), persistent=False)

    @property
    def num_local_experts(self) -> int:
        return getattr(self, self.names[0].replace(".", SEPARATOR)).shape[0]

    def counts_on_device(self, device: torch.device, dtype: torch.dtype) -> bool:
        """No: the experts run one by one, over segment bounds read on the host."""
        return False

    def __getstate__(self) -> dict:
        # a factory that cannot be pickled (a lambda) stays behind: the values travel anyway
        state = dict(self.__dict__)
        try:
            pickle.dumps(state.get("_factory"))
        except Exception:
            state["_factory"] = None
        return state

    def reset_parameters(self) -> None:
        self.reset_experts(self.expert_ids.tolist())

    @torch.no_grad()
    def reset_experts(self, rows: list[int]) -> None:
        """Local row ``i`` re-created as global expert ``rows[i]`` by the user's factory, with
        the generator the constructor gave that expert: equal to the eager build."""
        if self._factory is None:
            raise ExpertContractError("these experts were given as a list of modules: their values are the list's, "
                                      "and an expert built on the meta device cannot be re-created; pass the expert "
                                      "class or a factory, or load the weights from a checkpoint")
        for i, e in enumerate(rows):
            params = dict(build_expert(self._factory, self.init_seed, e, on_meta=False).named_parameters())
            for n in self.names:
                getattr(self, n.replace(".", SEPARATOR))[i].copy_(params[n])

    @property
    def params_per_expert(self) -> int:
        return sum(math.prod(p.shape[1:]) for p in self.parameters(recurse=False))

    def expert(self, e: int) -> dict[str, Tensor]:
        """Local expert ``e``'s parameters under the module's own names."""
        return {n: getattr(self, n.replace(".", SEPARATOR))[e] for n in self.names}

    def forward(self, x: Tensor, gather_idx: Tensor, counts: Tensor) -> Tensor:
        """The pack's expert contract (see :mod:`.experts`): rows ``gather_idx`` of ``x``,
        grouped by local expert, ``counts[e]`` rows each."""
        xs = x.index_select(0, gather_idx)
        stacked = [getattr(self, n.replace(".", SEPARATOR)) for n in self.names]
        # one view per expert taken once (as the MLP's torch path): indexing per expert would
        # build a full [E, ...] gradient for each
        per_expert = [t.unbind(0) for t in stacked]
        outs, start = [], 0
        for e, n in enumerate(counts.tolist()):
            if n:
                params = {name: views[e] for name, views in zip(self.names, per_expert, strict=True)}
                y = functional_call(self._template, params, (xs[start:start + n],))
                if y.shape != (n, self.d_model):
                    raise ExpertContractError(f"expert {e} returned shape {tuple(y.shape)} for {n} rows: an expert "
                                              f"maps [n, d_model={self.d_model}] to [n, d_model]")
                outs.append(y)
            start += n
        if not outs:  # keep every parameter in the graph, as the MLP paths do
            anchor = sum(t.sum() for t in stacked)
            return xs.new_zeros(0, self.d_model) + 0 * anchor
        return torch.cat(outs)
