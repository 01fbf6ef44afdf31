"""Thousands of ranks, nodes or lanes of a few kinds: each item as an index into the distinct
ones, so that per-kind work is done once per kind and spread back over the items."""

from __future__ import annotations

from typing import Callable, Hashable, Sequence, TypeVar

T = TypeVar("T")


def distinct(items: Sequence[T], key: Callable[[T], Hashable] = id) -> tuple[list[int], list[T]]:
    """Each item's index into the distinct items (by ``key``, first seen first), and those."""
    index: dict[Hashable, int] = {}
    kinds: list[T] = []
    codes = []
    for item in items:
        k = key(item)
        if k not in index:
            index[k] = len(kinds)
            kinds.append(item)
        codes.append(index[k])
    return codes, kinds
