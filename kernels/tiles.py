"""Tile configs measured per device kind, shipped as ``tiles.json`` (package data).

The table is what ``bench/tune_tiles.py --write`` found fastest on a GPU: an object keyed
by device kind (``"cuda:sm90"``, as :func:`.measured.device_kind` names it), then the
input dtype (``"bf16"``, ``"fp16"``, ``"fp32"``), the kernel (``"gemm"``, ``"wgrad"``) and
the row-count bucket (``tuning.m_bucket``, as a string), each entry a :class:`Tile` as
``{"BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"}`` and optionally ``"GROUP"``
(the launch order's row tiles side by side, :data:`DEFAULT_GROUP` when absent). Keys starting with
``"_"`` are comments. An entry that is missing, malformed or does not fit the device's
shared memory is ignored: the launch takes ``tuning``'s heuristic default instead.

As shipped the table holds no GPU entries: nothing has been measured on a GPU with this
tuner yet, so every launch runs the heuristic. Read once per process, lazily, with
``importlib.resources`` (as ``measured.json``), so from a wheel as from the source tree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .measured import shipped_json

FILE = "tiles.json"
KERNELS = ("gemm", "wgrad")
DTYPES = ("bf16", "fp16", "fp32")
_WARPS = (1, 2, 4, 8, 16)
# Row tiles launched side by side (the kernels' GROUP): the programs running at once share
# 8 row tiles' weight tiles in L2 (Triton's matmul tutorial takes 8 too). On an H100's
# L2 it cuts a Mixtral layer's modelled memory traffic 4.4x (bench/tile_order.py).
DEFAULT_GROUP = 8
MAX_GROUP = 64

_LOADED: list[dict[str, Any]] = []  # memoised by hand, as measured._LOADED


@dataclass(frozen=True)
class Tile:
    """One launch config: block shape (constexprs) and Triton's launch options."""

    block_m: int
    block_n: int
    block_k: int
    num_stages: int
    num_warps: int
    group: int = DEFAULT_GROUP

    def launch_kwargs(self) -> dict[str, int]:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "BLOCK_K": self.block_k, "GROUP": self.group,
                "num_warps": self.num_warps, "num_stages": self.num_stages}

    def to_json(self) -> dict[str, int]:
        return self.launch_kwargs()

    def smem_bytes(self, kernel: str, elem_bytes: int) -> int:
        """Shared memory the software pipeline keeps: one operand tile pair per stage.
        gemm: x ``[BLOCK_M, BLOCK_K]`` and w ``[BLOCK_K, BLOCK_N]``; wgrad reduces over
        BLOCK_M rows: x^T ``[BLOCK_K, BLOCK_M]`` and dy ``[BLOCK_M, BLOCK_N]``."""
        if kernel == "gemm":
            per_stage = self.block_m * self.block_k + self.block_k * self.block_n
        else:
            per_stage = self.block_k * self.block_m + self.block_m * self.block_n
        return per_stage * elem_bytes * self.num_stages


def parse(entry: Any) -> Tile | None:
    """A table entry as a :class:`Tile`; ``None`` for anything malformed."""
    if not isinstance(entry, dict):
        return None
    try:
        vals = [entry[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_stages", "num_warps")]
    except KeyError:
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
        return None
    bm, bn, bk, stages, warps = vals
    group = entry.get("GROUP", DEFAULT_GROUP)
    # tl.dot needs power-of-two blocks of at least 16 on every side
    if not all(b >= 16 and b & (b - 1) == 0 for b in (bm, bn, bk)):
        return None
    if warps not in _WARPS or not 1 <= stages <= 8:
        return None
    if not isinstance(group, int) or isinstance(group, bool) or not 1 <= group <= MAX_GROUP:
        return None
    return Tile(bm, bn, bk, stages, warps, group)


def load() -> dict[str, Any]:
    """The shipped table (empty when the file is missing or unreadable)."""
    if not _LOADED:
        _LOADED.append(shipped_json(FILE))
    return _LOADED[0]


def lookup(kind: str, dtype: str, kernel: str, bucket: int, table: dict[str, Any] | None = None) -> Tile | None:
    """The table's tile for (device kind, dtype, kernel, row bucket), or ``None``."""
    node: Any = load() if table is None else table
    for key in (kind, dtype, kernel, str(int(bucket))):
        if not isinstance(node, dict):
            return None
        node = node.get(key)
    return parse(node)


def with_entries(table: dict[str, Any], kind: str, entries: dict[tuple[str, str, int], Tile]) -> dict[str, Any]:
    """``table`` with ``entries`` ((dtype, kernel, bucket) -> tile) written under ``kind``;
    every other kind's entries, and this kind's others, kept."""
    out = json.loads(json.dumps(table))  # a deep copy of plain JSON
    node = out.setdefault(kind, {})
    for (dtype, kernel, bucket), tile in sorted(entries.items()):
        node.setdefault(dtype, {}).setdefault(kernel, {})[str(int(bucket))] = tile.to_json()
    return out
