"""One tensor as this rank holds it: flat pieces of the whole.

Every layout the pack runs cuts a tensor along its flattened elements: whole expert rows
(expert and zebra parallelism hold some rows of a stacked ``[E, ...]`` tensor), one
contiguous range (data-centric ranks; optimizer state sharded over replicas), or all of it
(replicated dense weights). Written as pieces of the flattened tensor, a checkpoint saved
under any of them is read back under any other: torch.distributed.checkpoint works out
which saved pieces overlap which wanted ones (its resharding), and no process ever holds
more than its own pieces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class Pieces:
    """This rank's pieces of one tensor of ``shape``: ``(offset, flat)`` with ``flat`` a 1-D
    view of local storage holding elements ``[offset, offset + flat.numel())`` of the
    flattened whole. Empty ``parts``: this rank holds none of it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: list[tuple[int, Tensor]] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @classmethod
    def whole(cls, t: Tensor) -> "Pieces":
        return cls(tuple(t.shape), t.dtype, [(0, t.detach().reshape(-1))])

    @classmethod
    def of_rows(cls, local: Tensor, rows: list[int], shape: tuple[int, ...], merge: bool = True) -> "Pieces":
        """``local[i]`` is row ``rows[i]`` of a tensor of ``shape``; ``merge``: consecutive ids
        become one piece (else one piece per row)."""
        row = math.prod(shape[1:])
        parts: list[tuple[int, Tensor]] = []
        start = 0
        for i in range(1, len(rows) + 1):
            if i == len(rows) or rows[i] != rows[i - 1] + 1 or not merge:
                if i > start:
                    parts.append((rows[start] * row, local.detach()[start:i].reshape(-1)))
                start = i
        return cls(tuple(shape), local.dtype, parts)

    @classmethod
    def of_range(cls, flat: Tensor, offset: int, shape: tuple[int, ...]) -> "Pieces":
        return cls(tuple(shape), flat.dtype, [(offset, flat.detach().reshape(-1))] if flat.numel() else [])

    def like(self, make) -> "Pieces":
        """The same layout over other local tensors: ``make(flat)`` for each piece."""
        return Pieces(self.shape, self.dtype, [(o, make(f)) for o, f in self.parts])
