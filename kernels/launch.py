"""Python entry points for the kernels: pick the variant for the device, size the grid, launch.

Nothing here reads ``counts`` on the host: grids use an upper bound on the number of row
tiles, so a launch never waits for the GPU. On CUDA a launch takes one config
(``tuning.tile_for``: the shipped table's, else the heuristic's) on a plain
``JITFunction``: nothing autotunes, a new config only compiles. With autotuning on
(``tuning.autotune_enabled``) the same kernel goes through ``triton.autotune`` over a few
candidates, keyed on the GEMM's shape and a bucket of its row count (``tuning.m_bucket``),
which the host knows from tensor shapes.

The expert count ``E`` and the row bucket are ``do_not_specialize``: Triton would otherwise
specialise an integer argument that is 1 or a multiple of 16, and compile again for a layer
or rank holding another number of experts. N and K (the model's widths) stay specialised.
"""

from __future__ import annotations

import functools
import inspect

import torch
import triton
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from . import tuning, triton_src
from .availability import TENSOR_CORE_CAPABILITY, tf32_enabled

_GEMM_KEY = ["N", "K", "M_BUCKET"]
_WGRAD_KEY = ["K", "N", "M_BUCKET"]
# Integer arguments that change between layers, ranks and launches of one model (the row
# tile map's tile count and the activations' row count change every step).
NO_SPECIALIZE = ("E", "M_BUCKET", "M_TILES", "M", "ROWS", "ROWS_PER", "S_BLOCKS")
# The row tile map's block: experts hold a few row tiles each, the surplus at most E + 1.
MAP_BLOCK = 64


@functools.cache
def _interpreted(fn):
    return InterpretedFunction(fn)


@functools.cache
def jitted(fn) -> JITFunction:
    """The compiled kernel as launched on CUDA (one per kernel function, its compile cache
    shared by every config)."""
    import inspect

    params = inspect.signature(fn).parameters
    return JITFunction(fn, do_not_specialize=[name for name in NO_SPECIALIZE if name in params])


@functools.cache
def autotuner(fn, which: str, capability: tuple[int, int], dtype: torch.dtype, smem: int | None):
    """The kernel under Triton's autotuner (autotuning on), over ``tuning.autotune_candidates``
    for this device and dtype; its ``cache`` holds the winner per key (``bench/tune_tiles.py``
    reads it)."""
    cands = [tuning.as_config(t) for t in tuning.autotune_candidates(capability, dtype, which, smem)]
    key = _GEMM_KEY if which == "gemm" else _WGRAD_KEY
    # cache_results: timings also go to Triton's on-disk cache, so a later run of the same
    # shapes (and Triton/driver/GPU) skips the benchmarks at set-up (Triton 3.4 on; before,
    # every run benchmarks again)
    cached = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
    return triton.autotune(cands, key=key, **cached)(jitted(fn))


@functools.cache
def _device(index: int) -> tuple[tuple[int, int], int | None, str]:
    """(capability, shared memory per block, kind) of a GPU: the kind keys the tile tables."""
    from .measured import device_kind

    dev = torch.device("cuda", index)
    return tuple(torch.cuda.get_device_capability(dev)), tuning.device_smem(dev), device_kind(dev)


@functools.cache
def _tile(capability: tuple[int, int], dtype: torch.dtype, which: str, bucket: int, smem: int | None, kind: str):
    return tuning.tile_for(capability, dtype, which, bucket, smem, kind=kind)


def _one_config(fn, device: torch.device, on_cuda: dict, interpreted: dict | None = None):
    """(launchable, fixed kwargs) of a kernel with one config: compiled with ``on_cuda``'s
    options on CUDA, interpreted with ``interpreted``'s (blocks only) elsewhere."""
    if device.type == "cuda":
        return jitted(fn), dict(on_cuda)
    return _interpreted(fn), dict(interpreted or {})


def _kernel(fn, which: str, device: torch.device, dtype: torch.dtype, bucket: int):
    """(launchable, fixed kwargs): interpreted with fixed blocks on CPU; on CUDA the plain
    kernel with one config's blocks and launch options, or the autotuner when asked for."""
    if device.type != "cuda":
        return _interpreted(fn), tuning.with_group(dict(tuning.INTERPRET_BLOCKS))
    capability, smem, kind = _device(device.index if device.index is not None else torch.cuda.current_device())
    if tuning.autotune_enabled():
        return autotuner(fn, which, capability, dtype, smem), {}
    return jitted(fn), tuning.with_group(_tile(capability, dtype, which, bucket, smem, kind).launch_kwargs())


# ---- TMA descriptors (tuning.tma_loads) ----------------------------------------------------
_MAX_EXTENT = 0x7FFF0000  # the two leading dimensions of a ragged descriptor: never a bound
_MAX_BOX = 256  # the copy engine's largest box side (a tile table may hold larger blocks)


def _tma(device: torch.device) -> bool:
    capability = _device(device.index if device.index is not None else torch.cuda.current_device())[0] \
        if device.type == "cuda" else None
    return tuning.uses_tma(device.type, capability)


def _tma_layout_ok(t: Tensor, *box: int) -> bool:
    """A descriptor's rules: last dimension contiguous, base and every other stride on 16
    bytes, no empty dimension, box sides of at most 256."""
    elem = t.element_size()
    return (t.dim() > 0 and t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(s * elem % 16 == 0 for s in t.stride()[:-1]) and all(n > 0 for n in t.shape)
            and all(b <= _MAX_BOX for b in box))


def weight_descriptor(w: Tensor, block_k: int, block_n: int):
    """A TMA descriptor of ``w [E, K, N]`` whose boxes are one expert's ``[block_k, block_n]``
    tile; ``None`` where its layout does not allow one (a transposed view: last stride not 1)."""
    if not _tma_layout_ok(w, block_k, block_n):
        return None
    return _descriptor(w, list(w.shape), list(w.stride()), [1, block_k, block_n])


def ragged_rows_descriptor(x: Tensor, block_rows: int, block_cols: int):
    """A TMA descriptor of ``x [M, C]`` read one expert's segment of rows at a time, boxes
    ``[block_rows, block_cols]``; ``None`` where the layout does not allow one.

    The segment ``[start, start + count)`` is addressed as the last ``count`` rows of a
    dimension of ``triton_src.RAGGED_ROWS`` (coordinates ``(RAGGED_ROWS, start + count,
    RAGGED_ROWS - count + row, col)``); the two leading dimensions' strides make the
    address come out at ``start + row`` modulo 2**64, and the bounds check on the third
    stops every box at the segment's end. Triton's ``tools/ragged_tma.py`` does the same."""
    ragged = int(triton_src.RAGGED_ROWS)
    if x.dim() != 2 or x.shape[0] > ragged or not _tma_layout_ok(x, block_rows, block_cols):
        return None
    s = x.stride(0)
    return _descriptor(x, [_MAX_EXTENT, _MAX_EXTENT, ragged, x.shape[1]], [2**34 - s, s, s, 1],
                       [1, 1, block_rows, block_cols])


def _descriptor(t: Tensor, shape: list[int], strides: list[int], box: list[int]):
    try:  # host-side descriptors: triton >= 3.3
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    return TensorDescriptor(t, shape, strides, box)


def input_precision(dtype: torch.dtype, device_type: str, capability: tuple[int, int] | None, tf32: bool) -> str:
    """``tl.dot``'s ``input_precision``. On CUDA: ``"tf32"`` for fp32 inputs on a device with
    TF32 tensor cores (sm80+) when torch allows TF32 (so both backends round alike), and
    for 16-bit inputs (Triton's default, which it ignores for them); else ``"ieee"`` (exact
    fp32 products on the CUDA cores: :func:`availability.triton_runs_dtype` keeps such
    calls off Triton on CUDA). Off CUDA (the interpreter): ``"ieee"``, exact."""
    if device_type != "cuda":
        return "ieee"
    if dtype != torch.float32:
        return "tf32"
    if tf32 and capability is not None and tuple(capability) >= TENSOR_CORE_CAPABILITY:
        return "tf32"
    return "ieee"


def _precision(dtype: torch.dtype, device: torch.device) -> str:
    if device.type != "cuda":
        return "ieee"
    precision = input_precision(dtype, device.type, torch.cuda.get_device_capability(device), tf32_enabled())
    if precision == "ieee":
        raise RuntimeError(f"internal error: a Triton launch on {device} with {dtype} inputs would run tl.dot as "
                           f"plain fp32 ('ieee': CUDA cores, slow to compile, bf16-sized tiles over shared "
                           f"memory); the expert MLP should have run on the torch backend instead "
                           f"(kernels.availability.triton_runs_dtype)")
    return precision


def _upcast(dtype: torch.dtype, device: torch.device) -> bool:
    # The interpreter's dot is wrong on bf16 (see triton_src); the GPU path never upcasts.
    return device.type != "cuda" and dtype == torch.bfloat16


def gemm_grid(M: int, N: int, E: int, block_m: int, block_n: int) -> tuple[int]:
    """The grouped GEMM's launch grid: every (row tile, column tile) on axis 0, with an upper
    bound of ``cdiv(M, block_m) + E`` row tiles (surplus ones exit; see the kernel)."""
    return ((triton.cdiv(M, block_m) + E) * triton.cdiv(N, block_n),)


def _offsets(counts: Tensor) -> Tensor:
    """Exclusive cumulative sum of ``counts``: where each expert's rows start (stays on device)."""
    return torch.cumsum(counts, 0) - counts


class RowTiles:
    """The row tiles of GEMMs over rows grouped by ``counts``: each tile's expert and each
    expert's first tile (``row_tile_map_kernel``: one small launch on the device, nothing
    read on the host), built once per (``BLOCK_M``, row count) and shared by every launch
    over the same rows (the MLP's up and down GEMMs, and its backward's two)."""

    def __init__(self, counts: Tensor) -> None:
        self.counts = counts.contiguous()
        self._maps: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}

    def map(self, block_m: int, rows: int) -> tuple[Tensor, Tensor]:
        """``(tile_expert [cdiv(rows, block_m) + E], tile_first [E])``, int32."""
        key = (block_m, rows)
        if key not in self._maps:
            E = self.counts.shape[0]
            m_tiles = triton.cdiv(rows, block_m) + E
            tile_expert = torch.empty(m_tiles, dtype=torch.int32, device=self.counts.device)
            tile_first = torch.empty(E, dtype=torch.int32, device=self.counts.device)
            fn, launch_kwargs = _one_config(triton_src.row_tile_map_kernel, self.counts.device, {"num_warps": 1})
            fn[(1,)](self.counts, tile_expert, tile_first, E, m_tiles, BLOCK_M=block_m, BLOCK=MAP_BLOCK,
                     **launch_kwargs)
            self._maps[key] = (tile_expert, tile_first)
        return self._maps[key]


def grouped_gemm(
    x: Tensor,
    w: Tensor,
    counts: Tensor,
    *,
    gather_idx: Tensor | None = None,
    bias: Tensor | None = None,
    out_idx: Tensor | None = None,
    out_rows: int | None = None,
    scale: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    row_tiles: RowTiles | None = None,
) -> Tensor:
    """Row ``m`` (grouped by expert per ``counts``) is ``x[gather_idx[m]] @ w[e(m)] (+ bias[e(m)])``.

    ``w`` is ``[E, K, N]`` with any strides, so ``w.transpose(1, 2)`` is the transposed GEMM
    without a copy. Without ``gather_idx`` the rows of ``x`` are already grouped. Epilogues:
    ``scale [M]`` multiplies each row, ``out_idx [M]`` writes row ``m`` to ``out[out_idx[m]]``
    of a zero-initialised ``[out_rows, N]`` result (``out_idx`` must not repeat).
    ``row_tiles`` (of these ``counts``) shares its row tile maps with other launches over
    the same rows; without it the launch builds its own.
    """
    E, K, N = w.shape
    M = gather_idx.shape[0] if gather_idx is not None else x.shape[0]
    if x.shape[1] != K:
        raise ValueError(f"x has {x.shape[1]} columns, w expects {K}")
    if out_idx is not None:
        out = torch.zeros(out_rows if out_rows is not None else M, N, device=x.device, dtype=out_dtype or x.dtype)
    else:
        out = torch.empty(M, N, device=x.device, dtype=out_dtype or x.dtype)
    if M == 0 or N == 0:
        return out
    bucket = tuning.m_bucket(M)
    fn, blocks = _kernel(triton_src.grouped_gemm_kernel, "gemm", x.device, x.dtype, bucket)
    counts = counts.contiguous()
    dummy = counts  # never read: the matching HAS_* flag is off
    # Under the autotuner BLOCK_M is unknown until it picks: each program finds its tile's
    # expert itself (see the kernel); otherwise from the map built for the launch's blocks.
    tile_map = "BLOCK_M" in blocks
    if tile_map:
        tile_expert, tile_first = (row_tiles if row_tiles is not None else RowTiles(counts)).map(blocks["BLOCK_M"], M)
    else:
        tile_expert = tile_first = dummy
    x_desc = w_desc = None  # the block shapes are the descriptors' boxes: not under the autotuner
    if tile_map and _tma(x.device):
        if gather_idx is None:
            x_desc = ragged_rows_descriptor(x, blocks["BLOCK_M"], blocks["BLOCK_K"])
        w_desc = weight_descriptor(w, blocks["BLOCK_K"], blocks["BLOCK_N"])
    grid = lambda meta: gemm_grid(M, N, E, meta["BLOCK_M"], meta["BLOCK_N"])  # noqa: E731
    fn[grid](
        x, gather_idx.contiguous() if gather_idx is not None else dummy, counts, _offsets(counts),
        tile_expert, tile_first, w, bias if bias is not None else dummy, out,
        out_idx.contiguous() if out_idx is not None else dummy,
        scale.contiguous() if scale is not None else dummy,
        x_desc if x_desc is not None else dummy, w_desc if w_desc is not None else dummy,
        N, K, E, bucket,
        x.stride(0), x.stride(1),
        w.stride(0), w.stride(1), w.stride(2),
        bias.stride(0) if bias is not None else 0, bias.stride(1) if bias is not None else 0,
        out.stride(0), out.stride(1),
        HAS_IDX=gather_idx is not None, HAS_BIAS=bias is not None,
        HAS_OUT_IDX=out_idx is not None, HAS_SCALE=scale is not None, TILE_MAP=tile_map,
        X_DESC=x_desc is not None, W_DESC=w_desc is not None,
        INPUT_PRECISION=_precision(x.dtype, x.device), UPCAST=_upcast(x.dtype, x.device),
        **blocks,
    )
    return out


def grouped_wgrad(
    x: Tensor,
    dy: Tensor,
    counts: Tensor,
    *,
    gather_idx: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """``dw[e] = x[gather_idx[rows of e]]^T @ dy[rows of e]``, ``[E, K, N]``, fp32 accumulation."""
    E = counts.shape[0]
    K, N = x.shape[1], dy.shape[1]
    dw = torch.empty(E, K, N, device=dy.device, dtype=out_dtype or dy.dtype)
    if dw.numel() == 0:
        return dw
    bucket = tuning.m_bucket(dy.shape[0])
    fn, blocks = _kernel(triton_src.grouped_wgrad_kernel, "wgrad", dy.device, dy.dtype, bucket)
    counts = counts.contiguous()
    x_desc = dy_desc = None
    if "BLOCK_M" in blocks and _tma(dy.device):
        if gather_idx is None:
            x_desc = ragged_rows_descriptor(x, blocks["BLOCK_M"], blocks["BLOCK_K"])
        dy_desc = ragged_rows_descriptor(dy, blocks["BLOCK_M"], blocks["BLOCK_N"])
    grid = lambda meta: (triton.cdiv(K, meta["BLOCK_K"]) * triton.cdiv(N, meta["BLOCK_N"]), E)  # noqa: E731
    fn[grid](
        x, gather_idx.contiguous() if gather_idx is not None else counts, dy, counts, _offsets(counts), dw,
        x_desc if x_desc is not None else counts, dy_desc if dy_desc is not None else counts,
        K, N, E, bucket,
        x.stride(0), x.stride(1),
        dy.stride(0), dy.stride(1),
        dw.stride(0), dw.stride(1), dw.stride(2),
        HAS_IDX=gather_idx is not None, X_DESC=x_desc is not None, DY_DESC=dy_desc is not None,
        INPUT_PRECISION=_precision(dy.dtype, dy.device), UPCAST=_upcast(dy.dtype, dy.device),
        **blocks,
    )
    return dw


def segment_sum(rows: Tensor, counts: Tensor) -> Tensor:
    """Per-expert column sums of grouped rows, ``[E, N]`` in fp32 (the bias gradient).

    ``output_size`` lets ``repeat_interleave`` run without reading ``counts`` on the host.
    """
    E = counts.shape[0]
    owner = torch.repeat_interleave(torch.arange(E, device=rows.device), counts, output_size=rows.shape[0])
    return rows.new_zeros(E, rows.shape[1], dtype=torch.float32).index_add_(0, owner, rows.float())


# The SwiGLU kernels' blocks: 4096 elements a program, 32 per thread of 4 warps; in the
# interpreter small ones, so that test shapes cross block edges.
ELEMENTWISE = {"BLOCK_M": 32, "BLOCK_F": 128, "num_warps": 4}
INTERPRET_ELEMENTWISE = {"BLOCK_M": 8, "BLOCK_F": 16}


def _elementwise(fn, device: torch.device):
    return _one_config(fn, device, ELEMENTWISE, INTERPRET_ELEMENTWISE)


def _unit_last_stride(t: Tensor) -> Tensor:
    """``t``, or a contiguous copy where its last dimension is strided (the elementwise
    kernels index that dimension by position)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def swiglu(h: Tensor) -> Tensor:
    """``silu(gate) * up`` of ``h = [gate | up]`` (``[M, 2F]`` -> ``[M, F]``), one pass."""
    h = _unit_last_stride(h)
    M, F = h.shape[0], h.shape[1] // 2
    out = h.new_empty(M, F)
    if out.numel():
        fn, blocks = _elementwise(triton_src.swiglu_forward_kernel, h.device)
        grid = (triton.cdiv(M, blocks["BLOCK_M"]), triton.cdiv(F, blocks["BLOCK_F"]))
        fn[grid](h, out, M, F, h.stride(0), out.stride(0), **blocks)
    return out


def swiglu_backward(h: Tensor, grad: Tensor) -> Tensor:
    """``[d_gate | d_up]`` (``h``'s shape and dtype) of ``silu(gate) * up`` under ``grad``, one pass."""
    h, grad = _unit_last_stride(h), _unit_last_stride(grad)
    M, F = h.shape[0], h.shape[1] // 2
    out = torch.empty_like(h, memory_format=torch.contiguous_format)
    if out.numel():
        fn, blocks = _elementwise(triton_src.swiglu_backward_kernel, h.device)
        grid = (triton.cdiv(M, blocks["BLOCK_M"]), triton.cdiv(F, blocks["BLOCK_F"]))
        fn[grid](h, grad, out, M, F, h.stride(0), grad.stride(0), out.stride(0), **blocks)
    return out


# The cross-entropy's rows: 4096 columns a step over 8 warps (16 per thread); small in the
# interpreter, so that test vocabularies span several steps and a partial one.
CROSS_ENTROPY = {"BLOCK_V": 4096, "num_warps": 8}
INTERPRET_CROSS_ENTROPY = {"BLOCK_V": 32}


def cross_entropy_rows(logits: Tensor, targets: Tensor, write_grad: bool) -> Tensor:
    """Each row's ``logsumexp - logit[target]`` (fp32, ``[n]``); with ``write_grad`` the
    logits are overwritten in place by ``softmax - onehot(target)``. ``logits`` ``[n, V]``
    with unit column stride; ``targets`` ``[n]``, every one in ``[0, V)``."""
    if logits.stride(-1) != 1:
        raise ValueError("cross_entropy_rows needs logits with unit column stride")
    n, V = logits.shape
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n:
        fn, blocks = _one_config(triton_src.cross_entropy_rows_kernel, logits.device, CROSS_ENTROPY,
                                 INTERPRET_CROSS_ENTROPY)
        fn[(n,)](logits, targets.contiguous(), loss, V, logits.stride(0), WRITE_GRAD=write_grad, **blocks)
    return loss


def _norm_warps(block_d: int) -> int:
    return 4 if block_d <= 1024 else 8 if block_d <= 4096 else 16


NORM_PROGRAMS = 1024  # the backward's programs at most: each sums its rows' weight gradient


def rms_norm_forward(x: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(y, rstd)`` of :func:`triton_src.rms_norm_forward_kernel` over the rows of ``x``
    (``[rows, D]``)."""
    x = _unit_last_stride(x)
    rows, D = x.shape
    y = torch.empty(rows, D, dtype=out_dtype, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(D)
        fn, launch_kwargs = _one_config(triton_src.rms_norm_forward_kernel, x.device,
                                        {"num_warps": _norm_warps(block)})
        fn[(rows,)](x, weight, y, rstd, D, x.stride(0), y.stride(0), eps, ROUND=x.dtype != torch.float32,
                    BLOCK_D=block, **launch_kwargs)
    return y, rstd


def rms_norm_backward(g: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """``(dx, dw)`` of :func:`rms_norm_forward` under ``g`` (``y``'s shape); ``dw`` in fp32."""
    g, x = _unit_last_stride(g), _unit_last_stride(x)
    rows, D = x.shape
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    programs = max(1, min(NORM_PROGRAMS, rows))
    per = triton.cdiv(rows, programs) if rows else 0
    parts = torch.zeros(programs, D, dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(D)
        fn, launch_kwargs = _one_config(triton_src.rms_norm_backward_kernel, x.device,
                                        {"num_warps": _norm_warps(block)})
        fn[(programs,)](g, x, weight, rstd, dx, parts, rows, D, per, g.stride(0), x.stride(0), dx.stride(0),
                        ROUND=x.dtype != torch.float32, BLOCK_D=block, **launch_kwargs)
    return dx, parts.sum(0)


ROTARY = {"BLOCK_S": 16, "num_warps": 4}
INTERPRET_ROTARY = {"BLOCK_S": 4}


def rotary(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
    """:func:`triton_src.rotary_kernel` over ``x`` ``[B, H, S, D]``, into a contiguous result of
    ``x``'s dtype; ``cos``/``sin`` fp32 ``[S, D/2]`` or ``[B, 1, S, D/2]``."""
    x = _unit_last_stride(x)
    B, H, S, D = x.shape
    half = D // 2
    out = torch.empty(B, H, S, D, dtype=x.dtype, device=x.device)
    if out.numel():
        cos, sin = cos.contiguous(), sin.contiguous()
        per_sequence = cos.dim() == 4
        fn, blocks = _one_config(triton_src.rotary_kernel, x.device, ROTARY, INTERPRET_ROTARY)
        s_blocks = triton.cdiv(S, blocks["BLOCK_S"])
        fn[(B * H * s_blocks,)](x, cos, sin, out, S, H, half, s_blocks, x.stride(0), x.stride(1), x.stride(2),
                                out.stride(0), out.stride(1), out.stride(2),
                                cos.stride(0) if per_sequence else 0, cos.stride(-2),
                                SIGN=-1.0 if inverse else 1.0, BLOCK_HALF=triton.next_power_of_2(half), **blocks)
    return out
