"""What the executor keeps between the tasks of one step: typed, and dropped as soon as no
later task needs it (so a step's memory is bounded by the tasks in flight, not by depth)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

Cut = tuple[Tensor, Tensor]  # (the tensor as the model made it, the leaf the next piece of graph starts from)


@dataclass
class BlockRecord:
    """One MoE block's forward on one micro-batch, on an attention rank."""

    dispatched: bool = False  # the block's MoE layer handed its rows over
    inputs: list[Cut] | None = None  # cut at the block's entry (grad mode only)
    outputs: list[Cut] = field(default_factory=list)  # cut at the block's exit
    # the MoE layer's balance and z losses, cut where the layer made them: the model may
    # carry them to its loss by any path (returned, or kept beside the block as Hugging Face
    # blocks do), and their gradient still enters the block's own backward
    aux: list[Cut] = field(default_factory=list)
    sent: Tensor | None = None  # the dispatched rows, in the block's graph
    answer: Tensor | None = None  # leaf holding the experts' answer, as the block used it
    slot: Tensor | None = None  # each answer row's slot among the layer's [T * k] choices
    arrived: Tensor | None = None  # the answer as it arrived, before the block resumed
    answer_grads: list[Cut] = field(default_factory=list)  # (block output, its gradient) for the backward

    def tensors(self) -> list[Tensor]:
        """Every tensor the record holds (for accounting what a step keeps alive)."""
        out: list[Tensor] = []
        for pairs in (self.inputs or [], self.outputs, self.aux, self.answer_grads):
            for a, b in pairs:
                out += [a, b]
        out += [t for t in (self.sent, self.answer, self.arrived, self.slot) if t is not None]
        return out


@dataclass
class ExpertRecord:
    """One round of experts on a holder: the graph its backward runs through."""

    inputs: Tensor  # the received rows, as a leaf
    outputs: Tensor  # the experts' answer, in the order the rows came


@dataclass
class Dispatched:
    """What a holder receives on the forward dispatch of a round."""

    rows: Tensor  # [n, d] by source group rank, then by this rank's expert order
    counts: Tensor  # [G, my experts] rows per (source, local expert), on the host


def tensor_bytes(tensors: list[Any]) -> int:
    """Bytes of the distinct storages among ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, Tensor) and t.numel():
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
