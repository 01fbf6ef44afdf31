"""What an evaluation step returns on each rank under zebra: the outputs of the rows it loaded.

Under DDP ``predict_step`` (and ``validation_step``/``test_step``) runs on the rows each
rank loaded, and Lightning pairs what it returns with that rank's own sampler indices
(prediction writers, ``return_predictions``). Zebra computes every row on the attention
ranks, in the global batch's order, cut into their shares; the per-row outputs go back to
the rank that loaded each row, in that rank's order. One all-to-all over the world's device
group carries them: the rows of every output tensor packed side by side as bytes, so any
mix of dtypes travels in one collective.

Where ragged batches were padded to one sequence length (:mod:`lightning_hetermoe.strategy.batch`), each rank's rows
come back as long as the padded batch: per-token outputs are cut back to the rank's own
length (:func:`unpad`).

Every rank first learns what every other returns (host metadata, :func:`describe`: the
structure, each tensor's dtype and per-row shape, or why the output cannot be split by
rows), so that ranks that computed nothing know what they receive, and every rank takes
the same path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

import lightning_hetermoe.comm as comm
from ...batch import global_order, map_tensors, tensors
from .executor import ZebraContractError


@dataclass(frozen=True)
class Leaf:
    """One output tensor, per row."""

    dtype: torch.dtype
    shape: tuple[int, ...]  # after the batch dimension
    on_host: bool  # the step returned it on the CPU: it goes back there

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True, eq=False)  # ranks compare layout and leaves, never the skeleton's tensors
class Spec:
    """What a rank's step returned, without the rows: enough to receive and rebuild it."""

    skeleton: Any  # the output with every tensor an empty CPU tensor (map_tensors rebuilds it)
    layout: str  # the structure written out, to compare ranks
    leaves: tuple[Leaf, ...]


@dataclass(frozen=True)
class Routes:
    """Which rows leave a rank for which, and where the returning rows go."""

    send: list[int]  # this rank's computed rows, in the order they leave (by destination)
    to_each: list[int]  # rows sent to each rank
    from_each: list[int]  # rows arriving from each rank
    own: list[int]  # for each row this rank loaded, which arriving row holds its output


def routes(counts: list[int], spans: dict[int, tuple[int, int]], rank: int) -> Routes:
    """``counts``: rows each rank loaded; ``spans``: ``(start, count)`` of the global order
    each rank computed (attention ranks; others computed none)."""
    order = global_order(counts)
    world = len(counts)
    start, count = spans.get(rank, (0, 0))
    by_dest: list[list[int]] = [[] for _ in range(world)]
    for k in range(count):
        by_dest[order[start + k][0]].append(k)
    arriving: list[int] = []  # the index, among this rank's rows, of each arriving row
    from_each = []
    for p in range(world):
        s, c = spans.get(p, (0, 0))
        mine = [i for origin, i in order[s:s + c] if origin == rank]
        from_each.append(len(mine))
        arriving += mine
    if sorted(arriving) != list(range(counts[rank])):
        raise ZebraContractError(f"rank {rank} loaded {counts[rank]} rows, the shares {spans} compute {arriving}")
    return Routes([k for dest in by_dest for k in dest], [len(d) for d in by_dest], from_each,
                  sorted(range(len(arriving)), key=arriving.__getitem__))


# -- what a rank returned ---------------------------------------------------------------
def _returned(result: Any) -> str:
    if isinstance(result, Tensor):
        return f"a tensor of shape {tuple(result.shape)}"
    return f"a {type(result).__name__}"


def describe(hook: str, results: list[tuple[int, Any]]) -> Spec | str | None:
    """What this rank's micro-batches returned (``(rows, output)`` each): a :class:`Spec`,
    ``None`` where there is nothing to give back (no rows here, or the step returns
    ``None``), or why the outputs cannot be split by rows."""
    if not results or all(out is None for _, out in results):
        return None
    specs = [_spec(hook, n, out) for n, out in results]
    first = specs[0]
    for s in specs:
        if isinstance(s, str):
            return s
        if (s.layout, s.leaves) != (first.layout, first.leaves):
            return (f"{hook} returned differently shaped outputs for two micro-batches ({first.layout} "
                    f"{list(first.leaves)} and {s.layout} {list(s.leaves)}): their rows cannot be joined")
    return first


def _spec(hook: str, n: int, out: Any) -> Spec | str:
    """One micro-batch's output of ``n`` rows, or why its rows cannot be told apart."""
    why = (f"zebra computes each rank's rows elsewhere and gives every row's output back to the rank that loaded "
           f"it, so every tensor the step returns needs the rows ({n}) as its first dimension (tensors, or "
           f"tuples/lists/dicts of them, e.g. per-row logits [{n}, ...]); reduce over rows in a callback or "
           f"on_predict_epoch_end, or run mode='ep'")
    try:
        found = tensors(out, strict=True)
    except TypeError:
        found = []
    if not found:
        return f"{hook} returned {_returned(out)} for a micro-batch of {n} rows: {why}"
    for t in found:
        if t.dim() == 0 or t.shape[0] != n:
            within = "" if t is out else f" (in {_returned(out)})"
            return f"{hook} returned {_returned(t)}{within} for a micro-batch of {n} rows: {why}"
    return Spec(map_tensors(out, lambda t: torch.empty(0, dtype=t.dtype, device="cpu")),
                repr(map_tensors(out, lambda t: "<rows>")),
                tuple(Leaf(t.dtype, tuple(t.shape[1:]), t.device.type == "cpu") for t in found))


def agree(hook: str, specs: list[Spec | str | None]) -> Spec | str | None:
    """Every rank's :func:`describe`, in rank order, to what all of them do: one spec, nothing
    to give back, or the reason (naming the rank) why the rows cannot go back."""
    for rank, s in enumerate(specs):
        if isinstance(s, str):
            return f"rank {rank}: {s}"
    given = [(rank, s) for rank, s in enumerate(specs) if s is not None]
    if not given:
        return None
    (r0, first), *rest = given
    for rank, s in rest:
        if (s.layout, s.leaves) != (first.layout, first.leaves):
            return (f"{hook} returned {s.layout} {list(s.leaves)} on rank {rank} and {first.layout} "
                    f"{list(first.leaves)} on rank {r0}: the ranks' rows cannot be joined")
    return first


# -- the rows back --------------------------------------------------------------------------
def _pack(leaves: list[Tensor], spec: Spec, device: torch.device) -> Tensor:
    """``[rows, bytes]``: every leaf's row as bytes, side by side."""
    n = leaves[0].shape[0]
    cols = [t.to(device).contiguous().reshape(n, -1).view(torch.uint8) if leaf.row_bytes else
            t.new_empty((n, 0), dtype=torch.uint8, device=device) for t, leaf in zip(leaves, spec.leaves)]
    return torch.cat(cols, 1)


def _unpack(packed: Tensor, spec: Spec) -> list[Tensor]:
    out, at, n = [], 0, packed.shape[0]
    for leaf in spec.leaves:
        width = leaf.row_bytes
        # a copy of its own: a slice's offset need not be a multiple of the dtype's size
        t = packed[:, at:at + width].clone().view(leaf.dtype).reshape((n,) + leaf.shape)
        out.append(t.cpu() if leaf.on_host else t)
        at += width
    return out


def _index(order: list[int], device: torch.device) -> Tensor | None:
    if order == list(range(len(order))):
        return None  # already in order: no copy
    return comm.to_device(torch.tensor(order, dtype=torch.long, device="cpu"), device)


def give_back(spec: Spec, leaves: list[Tensor] | None, route: Routes, device: torch.device) -> Any:
    """The outputs of this rank's own rows, in its order, shaped as the step returned them.
    ``leaves``: every output tensor of this rank's computed rows (joined over its
    micro-batches, in global order), or ``None`` where it computed none."""
    width = sum(leaf.row_bytes for leaf in spec.leaves)
    if leaves is None:
        packed = torch.empty((0, width), dtype=torch.uint8, device=device)
    else:
        packed = _pack(leaves, spec, device)
    send = _index(route.send, device)
    sent = packed.index_select(0, send) if send is not None else packed
    arrived = torch.empty((sum(route.from_each), width), dtype=torch.uint8, device=device)
    if width:  # nothing to carry where every output is empty per row (all ranks know it alike)
        comm.all_to_all(comm.world(), arrived, sent, route.from_each, route.to_each, what="zebra.outputs")
    own = _index(route.own, device)
    rows = _unpack(arrived.index_select(0, own) if own is not None else arrived, spec)
    it = iter(rows)
    return map_tensors(spec.skeleton, lambda _: next(it))


def join(results: list[tuple[int, Any]]) -> list[Tensor] | None:
    """Every output tensor of this rank's micro-batches, joined over them (rows in order)."""
    if not results:
        return None
    per_mb = [tensors(out, strict=True) for _, out in results]
    return [torch.cat(parts) if len(parts) > 1 else parts[0] for parts in zip(*per_mb)]


def unpad(result: Any, length: int, width: int) -> Any:
    """The outputs of this rank's rows where ragged batches were padded from its own
    sequence ``length`` to ``width``: every tensor as long as the padded batch in dimension 1
    (per-token outputs, e.g. logits ``[rows, seq, vocab]``) cut back to ``length``, as the
    rank alone computes them (attention is causal: no real position saw the padding)."""
    if length == width:
        return result
    return map_tensors(result, lambda t: t[:, :length].contiguous() if t.dim() > 1 and t.shape[1] == width else t)
