"""Tile configs: which block shape each launch takes, and autotuning only when asked for.

By default nothing autotunes at run time (the anchors do not: vLLM ships configs per GPU
as JSON with a heuristic fallback, ScatterMoE has one config per kernel). Each launch
takes :func:`tile_for`: the shipped table's entry for (device kind, dtype, kernel, row
bucket) (``tiles.json``, :mod:`.tiles`), else :func:`default_tile`, a heuristic per GPU
generation that fits the device's shared memory. The first launch of a config compiles it
(about a second per kernel variant) and nothing benchmarks.

``HETERMOE_AUTOTUNE=1`` (or :func:`enable_autotune`) turns Triton's autotuner on instead:
at most :data:`MAX_CANDIDATES` configs per kernel (:func:`autotune_candidates`, pruned by
their shared memory before anything compiles), keyed on (N, K, row bucket, dtypes), its
timings kept in Triton's disk cache. Its benchmarks synchronise the device, so the
strategy then tunes at set-up; ``bench/tune_tiles.py --write`` records the winners in the
table so that later runs need no tuning.

The row bucket (:func:`m_bucket`) is the power of two at or above the GEMM's row count M,
clamped to [M_BUCKET_MIN, M_BUCKET_MAX]: M changes every step with the routing, a bucket
lets the config follow its size without a new key per M.
"""

from __future__ import annotations

import os
from typing import ContextManager

import torch

from . import tiles
from .availability import Setting, on_rocm
from .tiles import Tile

# Below 256 rows every config is launch-bound; from 16K rows on, every candidate fills
# the GPU for several waves and the ranking no longer moves with M.
M_BUCKET_MIN = 256
M_BUCKET_MAX = 16384

# The largest bucket autotuning warmed up. Warm-up skips a bucket whose problem does not
# fit in half the free memory; a GEMM in it would then autotune inside a step, whose
# benchmarks synchronise the device in the middle of the overlap. Larger row counts take
# this bucket's tiles instead (every config is valid at any M).
_tuned_top = [M_BUCKET_MAX]


def m_bucket(m: int) -> int:
    """The row bucket of a GEMM over ``m`` rows: next power of two, clamped (to the largest
    bucket warm-up tuned, see :func:`tuned_up_to`)."""
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
# GROUP 2 there: the grouped launch order, with groups that straddle experts, runs in every
# interpreted test.
INTERPRET_BLOCKS = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP": 2}

_GROUP = Setting(None)  # launch_group's setting; None: each config's own


def launch_group(group: int) -> ContextManager[None]:
    """Launches in the block take ``group`` row tiles side by side instead of their config's
    (1: one row tile at a time, the order before grouping), interpreted or compiled, not
    under the autotuner. For side-by-side benchmarks and tests of the order."""
    if not isinstance(group, int) or isinstance(group, bool) or not 1 <= group <= tiles.MAX_GROUP:
        raise ValueError(f"launch_group({group!r}) is invalid: must be an integer in [1, {tiles.MAX_GROUP}]")
    return _GROUP(group)


def with_group(blocks: dict[str, int]) -> dict[str, int]:
    """A launch's constexprs with :func:`launch_group`'s setting, where one is set."""
    return blocks if _GROUP.value is None else {**blocks, "GROUP": _GROUP.value}

# ---- TMA operand loads -------------------------------------------------------------------
# From Hopper on, a copy engine (TMA) loads a whole tile by descriptor, bounds checked in
# hardware: no per-element address arithmetic or masks in the kernel's main loop, the
# operands straight to shared memory for wgmma. Off until a GPU has timed it beside the
# pointer loads (`bench/expert_kernels.py --ablations`, column `triton_tma`).
TMA_CAPABILITY = (9, 0)
_TMA = Setting(False)  # tma_loads's setting


def tma_loads(on: bool = True) -> ContextManager[None]:
    """Launches in the block load their operands by TMA descriptor where they can: on a
    device with TMA (sm90+), and in the interpreter (tests); weights whose last dimension is
    contiguous, rows grouped by expert (not gathered), 16-byte aligned; not under the
    autotuner."""
    return _TMA(bool(on))


def uses_tma(device_type: str, capability: tuple[int, int] | None) -> bool:
    """Whether a launch on this device loads by descriptor (:func:`tma_loads`): TMA is
    NVIDIA's copy engine, so never on ROCm, whose gfx9 parts report capability 9.x."""
    if not _TMA.value:
        return False
    if device_type == "cuda" and on_rocm():
        return False
    return device_type != "cuda" or (capability is not None and tuple(capability) >= TMA_CAPABILITY)

# ---- autotuning on request ----------------------------------------------------------------
ENV = "HETERMOE_AUTOTUNE"
MAX_CANDIDATES = 3
_AUTOTUNE = Setting(None)  # enable_autotune's setting; None: the env var decides


def enable_autotune(on: bool | None = True) -> None:
    """Autotune the Triton kernels (``on=True``), launch the table's or the heuristic's
    config (``False``), or follow ``HETERMOE_AUTOTUNE`` again (``None``)."""
    _AUTOTUNE.value = on


def autotune_enabled() -> bool:
    """Whether launches autotune: :func:`enable_autotune`'s setting, else ``HETERMOE_AUTOTUNE``
    (read at each call)."""
    if _AUTOTUNE.value is not None:
        return _AUTOTUNE.value
    return os.environ.get(ENV, "0").strip().lower() in ("1", "true", "on", "yes")


def autotuning(on: bool = True) -> ContextManager[None]:
    """:func:`enable_autotune` for the block, the previous setting put back after."""
    return _AUTOTUNE(on)


# ---- shared memory ------------------------------------------------------------------------
KIB = 1024
# Opt-in shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin) by compute
# capability, for when no device is at hand (tests, the compile check); a launch uses the
# device's own figure. Unknown ones get the smallest current budget (consumer parts).
SMEM_OPTIN = {(7, 0): 96 * KIB, (7, 5): 64 * KIB, (8, 0): 163 * KIB, (8, 6): 99 * KIB, (8, 7): 163 * KIB,
              (8, 9): 99 * KIB, (9, 0): 227 * KIB, (10, 0): 227 * KIB, (10, 3): 227 * KIB, (12, 0): 99 * KIB}


def smem_budget(capability: tuple[int, int]) -> int:
    return SMEM_OPTIN.get(tuple(capability), 99 * KIB)


def device_smem(device: torch.device) -> int | None:
    """``shared_memory_per_block_optin`` of a CUDA device, where torch reports it."""
    props = torch.cuda.get_device_properties(device)
    value = getattr(props, "shared_memory_per_block_optin", None)
    return int(value) if value else None


# ---- the heuristic default ----------------------------------------------------------------
# At or below this bucket a GEMM's rows are few per expert: 64-row tiles waste less on each
# expert's last, partial tile (vLLM's default config and ScatterMoE use the same split).
SMALL_BUCKET = 1024

# (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps) for 16-bit inputs per generation (the newest
# the device reaches): (small buckets, larger ones).
# Hopper: wgmma and 227 KiB favour 128-row tiles, BLOCK_K=64, 4 stages (128 KiB).
# Ampere/Ada: mma.sync, 99-163 KiB: BLOCK_K=32 keeps 4 stages in 64 KiB; the 128x128 tile on
# 8 warps (on 4, 255 registers a thread and spills in four of the expert MLP's six GEMMs;
# tests/test_kernels_compile.py reads each compiled kernel's registers and local memory).
# Volta/Turing: tl.dot on the CUDA cores; small tiles, 2 stages.
GEMM_DEFAULT = {
    (9, 0): ((64, 128, 64, 4, 4), (128, 128, 64, 4, 8)),
    (8, 0): ((64, 128, 32, 4, 4), (128, 128, 32, 4, 8)),
    (0, 0): ((64, 64, 32, 2, 4), (128, 64, 32, 2, 4)),
}
# The weight gradient: a [BLOCK_K, BLOCK_N] output tile, reducing BLOCK_M rows a step.
WGRAD_DEFAULT = {
    (9, 0): ((32, 128, 128, 4, 4), (64, 128, 128, 4, 8)),
    (8, 0): ((32, 128, 128, 4, 4), (64, 128, 64, 3, 4)),
    (0, 0): ((32, 64, 64, 2, 4), (32, 64, 64, 2, 4)),
}
# What autotuning adds to the two defaults (one more per generation: MAX_CANDIDATES in all).
GEMM_EXTRA = {(9, 0): (128, 256, 64, 3, 8), (8, 0): (128, 64, 32, 4, 4), (0, 0): (64, 128, 32, 2, 4)}
WGRAD_EXTRA = {(9, 0): (64, 256, 128, 3, 8), (8, 0): (64, 128, 128, 3, 8), (0, 0): (32, 128, 64, 2, 4)}

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def kind_of(capability: tuple[int, int]) -> str:
    """The device kind of a CUDA capability, as ``measured.device_kind`` names it."""
    return f"cuda:sm{capability[0]}{capability[1]}"


def _generation(table: dict, capability: tuple[int, int]) -> tuple[int, int]:
    return max(gen for gen in table if tuple(capability) >= gen)


def _reduction_halved(t: Tile, kernel: str) -> Tile:
    # gemm reduces over BLOCK_K, wgrad over BLOCK_M
    if kernel == "gemm":
        return Tile(t.block_m, t.block_n, max(16, t.block_k // 2), t.num_stages, t.num_warps)
    return Tile(max(16, t.block_m // 2), t.block_n, t.block_k, t.num_stages, t.num_warps)


def fit(t: Tile, kernel: str, elem_bytes: int, budget: int) -> Tile:
    """``t`` shrunk until its pipeline fits ``budget`` bytes: fewer stages (down to 2), then
    a shorter reduction block (down to 16)."""
    while t.smem_bytes(kernel, elem_bytes) > budget and t.num_stages > 2:
        t = Tile(t.block_m, t.block_n, t.block_k, t.num_stages - 1, t.num_warps)
    while t.smem_bytes(kernel, elem_bytes) > budget:
        smaller = _reduction_halved(t, kernel)
        if smaller == t:
            break
        t = smaller
    return t


def default_tile(capability: tuple[int, int], dtype: torch.dtype, kernel: str, bucket: int,
                 smem: int | None = None) -> Tile:
    """The heuristic config: the generation's small- or large-bucket tile; for fp32 (TF32)
    inputs the reduction block halved, so its operands take the shared memory 16-bit ones
    do; then fitted to the device's shared memory (``smem``, default :func:`smem_budget`)."""
    table = GEMM_DEFAULT if kernel == "gemm" else WGRAD_DEFAULT
    small, large = table[_generation(table, capability)]
    t = Tile(*(small if bucket <= SMALL_BUCKET else large))
    elem = torch.empty(0, dtype=dtype).element_size()
    if elem >= 4:
        t = _reduction_halved(t, kernel)
    return fit(t, kernel, elem, smem if smem is not None else smem_budget(capability))


def tile_for(capability: tuple[int, int], dtype: torch.dtype, kernel: str, bucket: int, smem: int | None = None,
             table: dict | None = None, kind: str | None = None) -> Tile:
    """The config a launch takes: the table's entry for this (kind, dtype, kernel, bucket)
    if it has a valid one that fits the shared memory, else :func:`default_tile`. ``kind``:
    the device's (``measured.device_kind``; default: the NVIDIA kind of ``capability``)."""
    budget = smem if smem is not None else smem_budget(capability)
    name = DTYPE_NAMES.get(dtype)
    entry = tiles.lookup(kind or kind_of(capability), name, kernel, bucket, table) if name else None
    elem = torch.empty(0, dtype=dtype).element_size()
    if entry is not None and entry.smem_bytes(kernel, elem) <= budget:
        return entry
    return default_tile(capability, dtype, kernel, bucket, budget)


def autotune_candidates(capability: tuple[int, int], dtype: torch.dtype, kernel: str,
                        smem: int | None = None) -> list[Tile]:
    """At most :data:`MAX_CANDIDATES` configs for the autotuner: the two defaults (small and
    large buckets) and the generation's extra, each whose pipeline does not fit the shared
    memory dropped before anything compiles (the defaults are fitted, so one always stays)."""
    budget = smem if smem is not None else smem_budget(capability)
    elem = torch.empty(0, dtype=dtype).element_size()
    extras = GEMM_EXTRA if kernel == "gemm" else WGRAD_EXTRA
    extra = Tile(*extras[_generation(extras, capability)])
    if elem >= 4:
        extra = _reduction_halved(extra, kernel)
    out: list[Tile] = []
    for t in (default_tile(capability, dtype, kernel, M_BUCKET_MIN, budget),
              default_tile(capability, dtype, kernel, M_BUCKET_MAX, budget), extra):
        if t not in out and t.smem_bytes(kernel, elem) <= budget:
            out.append(t)
    # a budget below the smallest tile (no current GPU): the fitted default, for Triton to judge
    return out[:MAX_CANDIDATES] or [default_tile(capability, dtype, kernel, M_BUCKET_MIN, budget)]


def as_config(t: Tile) -> "triton.Config":  # noqa: F821
    import triton

    return triton.Config({"BLOCK_M": t.block_m, "BLOCK_N": t.block_n, "BLOCK_K": t.block_k, "GROUP": t.group},
                         num_stages=t.num_stages, num_warps=t.num_warps)
