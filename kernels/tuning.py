"""Block shapes: autotuning candidates per GPU generation, fixed small blocks for the interpreter.

Tuning is keyed on the GEMM's (N, K) - that is (d_model, hidden) for the expert MLP -, on
a bucket of the row count M (:func:`m_bucket`) and, automatically, on the dtypes of the
tensor arguments. M itself changes at every step with the routing, so re-tuning per M
would benchmark on the hot path for the whole run; left out of the key altogether, the
first batch (often a small one) would choose the tiles for every later size. The bucket
is the power of two at or above M, clamped to [M_BUCKET_MIN, M_BUCKET_MAX]: a handful
of tunings per shape, all of which ``warm_up`` runs at set-up (``tuning_buckets``).
"""

from __future__ import annotations

import triton

# Below 256 rows every config is launch-bound; from 16K rows on, every candidate fills
# the GPU for several waves and the ranking no longer moves with M.
M_BUCKET_MIN = 256
M_BUCKET_MAX = 16384


# The largest bucket every warmed-up shape was tuned at. Warm-up skips a bucket whose
# problem does not fit in half the free memory; a GEMM in it would then autotune inside a
# step, whose benchmarks synchronise the device in the middle of the overlap. Larger row
# counts take this bucket's tiles instead (every config is valid at any M; past the top
# tuned bucket the ranking barely moves).
_tuned_top = [M_BUCKET_MAX]


def m_bucket(m: int) -> int:
    """The autotuning bucket of a GEMM over ``m`` rows: next power of two, clamped (to the
    largest bucket warm-up tuned, see :func:`tuned_up_to`)."""
    b = 1 << max(int(m) - 1, 0).bit_length()
    return min(max(b, M_BUCKET_MIN), _tuned_top[0])


def tuned_up_to(bucket: int | None) -> None:
    """Warm-up tuned every bucket up to ``bucket`` (``None``: forget every limit)."""
    _tuned_top[0] = M_BUCKET_MAX if bucket is None else max(M_BUCKET_MIN, min(_tuned_top[0], int(bucket)))


def tuning_buckets() -> list[int]:
    """Every bucket :func:`m_bucket` can return, smallest first."""
    out, b = [], M_BUCKET_MIN
    while b <= M_BUCKET_MAX:
        out.append(b)
        b *= 2
    return out

# Under TRITON_INTERPRET every program is numpy on the CPU: fewer, mid-sized tiles are
# fastest, and 16 keeps test shapes that are not multiples of the block meaningful.
INTERPRET_BLOCKS = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32}


def _cfg(bm: int, bn: int, bk: int, stages: int, warps: int) -> triton.Config:
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_stages=stages, num_warps=warps)


# Candidates per GPU generation (the newest the device reaches): (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps).
# The gather-GEMM: BLOCK_M rows of one expert x BLOCK_N output columns.
GEMM_TILES = {
    # Hopper: 228 KB of shared memory and wgmma favour 128-row tiles with BLOCK_K=64 and deep
    # pipelines; 64-row tiles stay for experts that receive few tokens.
    (9, 0): [(128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (128, 128, 64, 4, 4), (64, 256, 64, 4, 8),
             (64, 128, 64, 4, 4), (128, 64, 64, 4, 4)],
    # Ampere/Ada: ~100-164 KB of shared memory, mma.sync; BLOCK_K=32 keeps 4 stages resident.
    (8, 0): [(128, 128, 32, 4, 4), (128, 256, 32, 3, 8), (128, 128, 64, 3, 8), (64, 128, 32, 4, 4),
             (128, 64, 32, 4, 4), (64, 64, 32, 5, 2)],
    # Volta/Turing (expert ranks in the HeterMoE clusters are often V100/T4): small tiles, few stages.
    (0, 0): [(64, 64, 32, 2, 4), (128, 64, 32, 2, 4), (64, 128, 32, 2, 4)],
}
# The weight gradient: a [BLOCK_K, BLOCK_N] output tile, reducing BLOCK_M rows a step.
WGRAD_TILES = {
    (9, 0): [(64, 128, 128, 4, 8), (64, 256, 128, 3, 8), (64, 128, 128, 3, 4), (32, 128, 128, 4, 4),
             (64, 64, 64, 4, 4)],
    (8, 0): [(32, 128, 128, 4, 4), (64, 128, 128, 3, 8), (32, 64, 128, 4, 4), (32, 64, 64, 4, 4)],
    (0, 0): [(32, 64, 64, 2, 4), (32, 128, 64, 2, 4)],
}


def _for(tiles: dict[tuple[int, int], list[tuple[int, ...]]], capability: tuple[int, int]) -> list[triton.Config]:
    newest = max(gen for gen in tiles if capability >= gen)
    return [_cfg(*t) for t in tiles[newest]]


def gemm_configs(capability: tuple[int, int]) -> list[triton.Config]:
    """Candidates for the gather-GEMM on a device of ``capability``."""
    return _for(GEMM_TILES, capability)


def wgrad_configs(capability: tuple[int, int]) -> list[triton.Config]:
    """Candidates for the weight gradient on a device of ``capability``."""
    return _for(WGRAD_TILES, capability)
