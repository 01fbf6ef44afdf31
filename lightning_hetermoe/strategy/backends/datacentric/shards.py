"""Where each rank's part of an expert tensor lies: one contiguous range of the flattened
``[E, ...]`` tensor per rank, the ranges in proportion to the ranks' device memory, and the
padded equal chunks the collectives move."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor
import torch

from ....apportion import apportion


@dataclass(frozen=True)
class Shard:
    """Where one expert parameter's elements live: rank ``r`` holds the flat range
    ``[starts[r], starts[r] + sizes[r])``; collectives move padded chunks of ``chunk``."""

    shape: tuple[int, ...]
    starts: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def chunk(self) -> int:
        return max(max(self.sizes), 1)

    def padded(self, part: Tensor, rank: int) -> Tensor:
        out = part.new_zeros(self.chunk)
        out[: self.sizes[rank]] = part
        return out

    @property
    def unpadded(self) -> bool:
        """Every range fills its chunk: the chunks laid end to end *are* the tensor (equal
        shares of a tensor they divide), and gathers and reduce-scatters need no copy."""
        return all(n == self.chunk for n in self.sizes)

    def unpad(self, gathered: Tensor) -> Tensor:
        """The full tensor from ``world`` padded chunks laid end to end."""
        if self.unpadded:
            return gathered.view(self.shape)
        pieces = [gathered[r * self.chunk: r * self.chunk + n] for r, n in enumerate(self.sizes)]
        return torch.cat(pieces).view(self.shape)

    def spread(self, full: Tensor) -> Tensor:
        """``full`` laid out as ``world`` padded chunks (what a reduce-scatter takes)."""
        flat = full.reshape(-1)
        if self.unpadded:
            return flat
        out = flat.new_zeros(len(self.sizes) * self.chunk)
        for r, (s, n) in enumerate(zip(self.starts, self.sizes)):
            out[r * self.chunk: r * self.chunk + n] = flat[s: s + n]
        return out

    @property
    def row(self) -> int:
        """Elements per expert (dimension 0 is the expert)."""
        return math.prod(self.shape[1:])

    def part(self, full: Tensor, rank: int, first_row: int = 0) -> Tensor:
        """Rank ``rank``'s range of ``full`` (the whole tensor, or its rows from ``first_row`` on)."""
        start = self.starts[rank] - first_row * self.row
        return full.reshape(-1)[start: start + self.sizes[rank]].clone()

    def rows_of(self, rank: int) -> tuple[int, int]:
        """The expert rows ``[a, b)`` that rank ``rank``'s range touches (empty: ``a == b``)."""
        if not self.sizes[rank]:
            return (0, 0)
        start = self.starts[rank]
        return start // self.row, (start + self.sizes[rank] - 1) // self.row + 1


def covering_rows(shards, rank: int) -> tuple[int, int]:
    """The rows ``[a, b)`` that cover rank ``rank``'s ranges of every tensor in ``shards``."""
    spans = [s.rows_of(rank) for s in shards if s.sizes[rank]]
    if not spans:
        return (0, 0)
    return min(a for a, _ in spans), max(b for _, b in spans)


def shard_ranges(shape: tuple[int, ...], weights: list[float]) -> Shard:
    """Contiguous ranges of a flattened tensor of ``shape``, in proportion to ``weights``."""
    sizes = apportion(math.prod(shape), weights)
    starts = [0]
    for n in sizes[:-1]:
        starts.append(starts[-1] + n)
    return Shard(tuple(shape), tuple(starts), tuple(sizes))
