"""The Triton kernels themselves, as plain (undecorated) functions.

They are left undecorated on purpose: ``triton.jit`` decides between compiling and
interpreting at decoration time from ``TRITON_INTERPRET``, which would freeze that choice
at import. :mod:`.launch` wraps each function per device instead (compiled on CUDA,
interpreted for CPU tensors), so one process can run both and the env var is only read
when deciding availability. For the same reason the kernels call no ``@jit`` helper,
including those of ``triton.language`` written in Triton itself (``tl.sum``, ``tl.zeros``,
``tl.cumsum``, ``tl.cdiv``): they were bound to one mode when triton was imported.
Only builtins are used, and ``tl.reduce`` over the combine functions below, which are
made ``JITFunction`` explicitly (not by ``triton.jit``, which would read the env var):
the compiler takes them as such, and the interpreter calls their ``.fn``.

``UPCAST`` exists for the interpreter alone: it keeps bf16 as raw uint16 and its ``tl.dot``
multiplies those bit patterns as integers. bf16 -> fp32 is exact and the GPU forms bf16
products exactly in fp32 as well, so upcasting there changes no result.

``M_BUCKET`` is never read: it is an argument only so that the autotuner (when on) can key
on it (a power-of-two bucket of the row count, see ``tuning.m_bucket``).

Rows are grouped by expert exactly as in the backend contract (``counts[e]`` consecutive
rows per expert, starting at ``offsets[e]``, the exclusive cumulative sum that the host
computes on the device). No launch reads ``counts`` on the host.
"""

import triton.language as tl
from triton.runtime.jit import JITFunction


def _add(a, b):
    return a + b


def _larger(a, b):
    return tl.maximum(a, b)


ADD = JITFunction(_add)
LARGER = JITFunction(_larger)

# A ragged TMA descriptor's row bound (``launch.ragged_rows_descriptor``): an expert's rows
# are addressed as the last ``seg_count`` of this many, so the hardware's bounds check
# stops every tile at the expert's last row and fills the rest with zeros.
RAGGED_ROWS = tl.constexpr(1 << 30)


def row_tile_map_kernel(counts_ptr, tile_expert_ptr, tile_first_ptr, E, M_TILES,
                        BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    """One program: ``tile_expert[t]``, the expert of row tile ``t`` (``E`` for the surplus
    tiles of the launch bound, ``M_TILES`` of them in all), and ``tile_first[e]``, expert
    ``e``'s first row tile, for tiles of ``BLOCK_M`` rows.

    Built once per set of GEMMs over the same rows, so that each GEMM program finds its
    expert with two loads; scanning the E counts in every program instead costs a
    dependent load per expert (128 of them at Qwen3's shape) before the first product.
    """
    offs = tl.arange(0, BLOCK)
    start = tl.program_id(0) * 0  # int32 scalars: loop-carried values need a fixed type
    for e in range(0, E):
        n = (tl.load(counts_ptr + e).to(tl.int32) + BLOCK_M - 1) // BLOCK_M
        tl.store(tile_first_ptr + e, start)
        for j in range(0, (n + BLOCK - 1) // BLOCK):
            t = j * BLOCK + offs
            tl.store(tile_expert_ptr + start + t, offs * 0 + e, mask=t < n)
        start += n
    for j in range(0, (M_TILES - start + BLOCK - 1) // BLOCK):
        t = start + j * BLOCK + offs
        tl.store(tile_expert_ptr + t, offs * 0 + E, mask=t < M_TILES)


def grouped_gemm_kernel(
    x_ptr, idx_ptr, counts_ptr, offsets_ptr, tile_expert_ptr, tile_first_ptr, w_ptr, b_ptr, out_ptr, out_idx_ptr,
    scale_ptr, x_desc, w_desc,
    N, K, E, M_BUCKET,
    stride_xm, stride_xk,
    stride_we, stride_wk, stride_wn,
    stride_be, stride_bn,
    stride_om, stride_on,
    HAS_IDX: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_OUT_IDX: tl.constexpr, HAS_SCALE: tl.constexpr,
    TILE_MAP: tl.constexpr, X_DESC: tl.constexpr, W_DESC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """out[o(m)] = s(m) * (x[idx[m]] @ w[e(m)] + b[e(m)]) for the BLOCK_M rows of one tile.

    One grid axis of (row tile, column tile) programs. Row tiles run over all experts back
    to back (expert e owns cdiv(counts[e], BLOCK_M) of them); the host launches an upper
    bound of cdiv(M, BLOCK_M) + E row tiles so it never has to read ``counts``; surplus
    tiles exit. Axis 0 takes 2^31 - 1 programs (axes 1 and 2 only 65535: row tiles there
    would stop launching near 4.2M rows).

    Launch order is grouped (``bench/tile_order.py`` mirrors it): ``GROUP`` row tiles
    side by side, their column tiles in turn. The programs running at once then share a
    few weight tiles and a few row tiles, both in L2; one row tile at a time (``GROUP=1``)
    would read each expert's whole weight from memory once per row tile (Mixtral's
    up-projection: 30 GB a step on an H100's L2 against 3.9 GB, ``bench/tile_order.py``).

    ``X_DESC`` / ``W_DESC`` (Hopper on, see ``launch.tma_loads``): the rows (grouped, not
    gathered) and the weight tiles come by TMA descriptor instead of pointers: no per-element
    addresses or masks, the bounds checked by the copy engine (zeros past them).
    """
    n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    pid = tl.program_id(0)
    if GROUP > 1:
        per_group = GROUP * n_tiles
        first = (pid // per_group) * GROUP
        rest = tl.num_programs(0) // n_tiles - first
        size = tl.where(rest < GROUP, rest, GROUP)
        tile = first + (pid % per_group) % size
        pid_n = (pid % per_group) // size
    else:
        tile = pid // n_tiles
        pid_n = pid % n_tiles

    if TILE_MAP:  # the launch built the map for its BLOCK_M (row_tile_map_kernel)
        e = tl.load(tile_expert_ptr + tile).to(tl.int32)
        if e >= E:
            return  # surplus tile of the upper-bound grid
        first_tile = tl.load(tile_first_ptr + e).to(tl.int32)
    else:
        # Under the autotuner BLOCK_M is the config's, unknown to the launch: the expert of
        # this tile is the number of experts whose tiles all come before it, E scalar loads.
        e = tl.program_id(0) * 0  # int32 scalars: loop-carried values need a fixed type
        first_tile = e
        tiles_seen = e
        for i in range(0, E):
            tiles_seen += (tl.load(counts_ptr + i).to(tl.int32) + BLOCK_M - 1) // BLOCK_M
            before = tiles_seen <= tile
            e += before.to(tl.int32)
            first_tile = tl.where(before, tiles_seen, first_tile)
        if e >= E:
            return  # surplus tile of the upper-bound grid
    seg_start = tl.load(offsets_ptr + e).to(tl.int64)
    seg_count = tl.load(counts_ptr + e).to(tl.int32)

    local = (tile - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = local < seg_count
    rows = seg_start + local
    if HAS_IDX:
        # The gather is fused into the load: rows of x are read where they are.
        src = tl.load(idx_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    else:
        src = rows

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + src[:, None] * stride_xm + offs_k[None, :] * stride_xk
    # Cast before multiplying: E * K * N overflows int32 for large expert stacks.
    w_base = w_ptr + e.to(tl.int64) * stride_we
    b_ptrs = w_base + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn

    if X_DESC:  # the tile's rows as the last of RAGGED_ROWS rows ending at the expert's end
        seg_end = (seg_start + seg_count).to(tl.int32)
        x_row = RAGGED_ROWS - seg_count + (tile - first_tile) * BLOCK_M

    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        k_mask = offs_k < K - k0 * BLOCK_K
        if X_DESC:
            a = tl.reshape(x_desc.load([RAGGED_ROWS, seg_end, x_row, k0 * BLOCK_K]), (BLOCK_M, BLOCK_K))
        else:
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if W_DESC:
            b = tl.reshape(w_desc.load([e, k0 * BLOCK_K, pid_n * BLOCK_N]), (BLOCK_K, BLOCK_N))
        else:
            b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_xk
        b_ptrs += BLOCK_K * stride_wk

    if HAS_BIAS:
        bias = tl.load(b_ptr + e.to(tl.int64) * stride_be + offs_n * stride_bn, mask=n_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if HAS_SCALE:
        s = tl.load(scale_ptr + rows, mask=row_mask, other=0.0)
        acc *= s.to(tl.float32)[:, None]
    if HAS_OUT_IDX:
        dst = tl.load(out_idx_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    else:
        dst = rows
    o_ptrs = out_ptr + dst[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def grouped_wgrad_kernel(
    x_ptr, idx_ptr, dy_ptr, counts_ptr, offsets_ptr, dw_ptr, x_desc, dy_desc,
    K, N, E, M_BUCKET,
    stride_xm, stride_xk,
    stride_dym, stride_dyn,
    stride_we, stride_wk, stride_wn,
    HAS_IDX: tl.constexpr, X_DESC: tl.constexpr, DY_DESC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """dw[e] = x[idx[rows of e]]^T @ dy[rows of e]: one [BLOCK_K, BLOCK_N] tile of one expert.

    The reduction runs over the expert's rows, whose number only the device knows, so the
    loop bound is read from ``counts`` inside the kernel. An expert with no rows writes
    zeros, which is its exact gradient.

    One expert's tiles on axis 0, in the gemm's grouped order: ``GROUP`` row blocks of
    ``x^T`` side by side, their column blocks of ``dy`` in turn, so the programs running
    at once stream the expert's rows of a few blocks of each from L2.

    ``X_DESC`` (rows not gathered) / ``DY_DESC``: the expert's rows by ragged TMA descriptor,
    as in the gemm kernel; past the expert's last row the copy engine gives zeros.
    """
    pid = tl.program_id(0)
    e = tl.program_id(1).to(tl.int64)
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    if GROUP > 1:
        per_group = GROUP * num_n
        first = (pid // per_group) * GROUP
        rest = (K + BLOCK_K - 1) // BLOCK_K - first
        size = tl.where(rest < GROUP, rest, GROUP)
        pid_k = first + (pid % per_group) % size
        pid_n = (pid % per_group) // size
    else:
        pid_k = pid // num_n
        pid_n = pid % num_n

    seg_start = tl.load(offsets_ptr + e).to(tl.int64)
    seg_count = tl.load(counts_ptr + e).to(tl.int32)

    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask = offs_k < K
    n_mask = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)

    seg_end = (seg_start + seg_count).to(tl.int32)  # the ragged descriptors' coordinates (gemm kernel)
    # Gathered rows: each block's row indices are loaded one iteration ahead. Loaded in the
    # iteration that reads the rows, they made the rows' load indirect within the iteration,
    # and Triton's pipeliner then kept two buffers and waited on every copy each iteration
    # (half the shared memory of the same kernel without the gather, sm80 and sm90 alike;
    # tests/test_kernels_compile.py compiles both as a launch does and compares).
    if HAS_IDX:
        src_next = tl.load(idx_ptr + seg_start + offs_m, mask=offs_m < seg_count, other=0).to(tl.int64)
    acc = tl.full((BLOCK_K, BLOCK_N), 0.0, tl.float32)
    for m0 in range(0, (seg_count + BLOCK_M - 1) // BLOCK_M):
        local = m0 * BLOCK_M + offs_m
        row_mask = local < seg_count
        rows = seg_start + local
        ragged_row = RAGGED_ROWS - seg_count + m0 * BLOCK_M
        if X_DESC:
            xt = tl.trans(tl.reshape(x_desc.load([RAGGED_ROWS, seg_end, ragged_row, pid_k * BLOCK_K]),
                                     (BLOCK_M, BLOCK_K)))
        else:
            if HAS_IDX:
                src = src_next
                ahead = local + BLOCK_M
                src_next = tl.load(idx_ptr + seg_start + ahead, mask=ahead < seg_count, other=0).to(tl.int64)
            else:
                src = rows
            # x is loaded already transposed ([K, M]) so the product needs no tl.trans.
            xt = tl.load(x_ptr + src[None, :] * stride_xm + offs_k[:, None] * stride_xk,
                         mask=k_mask[:, None] & row_mask[None, :], other=0.0)
        if DY_DESC:
            dy = tl.reshape(dy_desc.load([RAGGED_ROWS, seg_end, ragged_row, pid_n * BLOCK_N]), (BLOCK_M, BLOCK_N))
        else:
            dy = tl.load(dy_ptr + rows[:, None] * stride_dym + offs_n[None, :] * stride_dyn,
                         mask=row_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:
            xt = xt.to(tl.float32)
            dy = dy.to(tl.float32)
        acc = tl.dot(xt, dy, acc, input_precision=INPUT_PRECISION)

    w_ptrs = dw_ptr + e * stride_we + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    tl.store(w_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=k_mask[:, None] & n_mask[None, :])


def swiglu_forward_kernel(h_ptr, out_ptr, M, F, stride_hm, stride_om,
                          BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr):
    """``out[m, j] = silu(h[m, j]) * h[m, F + j]`` (gate columns first, then up), formed in
    fp32 and rounded once: one read of ``h``, one write of ``out``."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows < M)[:, None] & (cols < F)[None, :]
    h = h_ptr + rows.to(tl.int64)[:, None] * stride_hm + cols[None, :]
    gate = tl.load(h, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h + F, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask)


def swiglu_backward_kernel(h_ptr, g_ptr, out_ptr, M, F, stride_hm, stride_gm, stride_om,
                           BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr):
    """The gradient of ``silu(gate) * up`` at ``h`` under ``g`` (``[M, F]``), written as
    ``[d_gate | d_up]`` (``[M, 2F]``): ``d_gate = g * up * s * (1 + gate * (1 - s))``
    (``s = sigmoid(gate)``), ``d_up = g * silu(gate)``, in fp32, one read of ``h`` and
    ``g`` and one write."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows < M)[:, None] & (cols < F)[None, :]
    r = rows.to(tl.int64)[:, None]
    h = h_ptr + r * stride_hm + cols[None, :]
    gate = tl.load(h, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h + F, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + r * stride_gm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-gate))
    d_gate = g * up * s * (1.0 + gate * (1.0 - s))
    d_up = g * gate * s
    out = out_ptr + r * stride_om + cols[None, :]
    tl.store(out, d_gate.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + F, d_up.to(out_ptr.dtype.element_ty), mask=mask)


def cross_entropy_rows_kernel(logits_ptr, targets_ptr, loss_ptr, V, stride_row,
                              WRITE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr):
    """Row ``r`` (one program): ``loss[r] = logsumexp(logits[r]) - logits[r, targets[r]]`` in
    fp32; with ``WRITE_GRAD`` the row is then overwritten, in its own dtype, by
    ``softmax(logits[r]) - onehot(targets[r])``. Two reads of the row and one write, where
    torch's ops (an fp32 log-softmax, its exponential, a cast) move it five times over.

    The first pass keeps a running maximum and sum of exponentials per lane (the online
    softmax); lanes that have seen only masked columns stay at -inf and add nothing."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    offs = tl.arange(0, BLOCK_V)
    m = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    s = tl.full((BLOCK_V,), 0.0, tl.float32)
    for b in range(0, (V + BLOCK_V - 1) // BLOCK_V):
        cols = b * BLOCK_V + offs
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        seen = m_new != float("-inf")
        s = tl.where(seen, s * tl.exp(m - m_new) + tl.exp(x - m_new), 0.0)
        m = m_new
    row_max = tl.reduce(m, 0, LARGER)
    # log-probabilities as (x - max) - log(sum), as torch's log-softmax forms them: x - max is
    # exact where x is near the maximum, x - logsumexp would round at the logits' magnitude
    log_sum = tl.log(tl.reduce(s * tl.exp(m - row_max), 0, ADD))
    target = tl.load(targets_ptr + row).to(tl.int64)
    tl.store(loss_ptr + row, log_sum - (tl.load(base + target).to(tl.float32) - row_max))
    if WRITE_GRAD:
        for b in range(0, (V + BLOCK_V - 1) // BLOCK_V):
            cols = b * BLOCK_V + offs
            x = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32)
            g = tl.exp((x - row_max) - log_sum) - tl.where(cols == target, 1.0, 0.0)
            tl.store(base + cols, g.to(logits_ptr.dtype.element_ty), mask=cols < V)


def rms_norm_forward_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, D, stride_x, stride_y, eps,
                            ROUND: tl.constexpr, BLOCK_D: tl.constexpr):
    """Row ``r`` (one program): ``n = x * rsqrt(mean(x^2) + eps)`` in fp32, rounded to
    ``x``'s dtype (``ROUND``, as the model's ``.to(x.dtype)``), times the weight, stored in
    ``y``'s dtype; ``rstd[r]`` kept for the backward. One read of ``x``, one write of ``y``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.reduce(x * x, 0, ADD) / D + eps)
    n = x * r
    if ROUND:
        n = n.to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (n * w).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, r)


def rms_norm_backward_kernel(g_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_part_ptr, ROWS, D, ROWS_PER,
                             stride_g, stride_x, stride_dx, ROUND: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows ``[p * ROWS_PER, (p + 1) * ROWS_PER)`` of program ``p``: ``dx`` of each, and the
    program's part of the weight's gradient (``dw_part[p]``, fp32; the parts are summed
    after). The gradient autograd forms through the forward: ``ga = g * w``, rounded to
    ``x``'s dtype where the forward rounded ``n`` (``ROUND``), then
    ``dx = r * ga - r^3 / D * x * sum(ga * x)``; ``dw += g * n`` (``n`` rounded alike)."""
    p = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.full((BLOCK_D,), 0.0, tl.float32)
    for i in range(0, ROWS_PER):
        row = (p * ROWS_PER + i).to(tl.int64)
        m = mask & (cols * 0 + row < ROWS)  # a vector mask: the last program's rows past the end
        x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * stride_g + cols, mask=m, other=0.0).to(tl.float32)
        r = tl.load(rstd_ptr + tl.where(row < ROWS, row, 0))  # past the end: x and g are 0, r unused
        n = x * r
        ga = g * w
        if ROUND:
            n = n.to(x_ptr.dtype.element_ty).to(tl.float32)
            ga = ga.to(x_ptr.dtype.element_ty).to(tl.float32)
        dw += g * n
        dot = tl.reduce(ga * x, 0, ADD)
        dx = r * ga - (r * r * r / D) * x * dot
        tl.store(dx_ptr + row * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=m)
    tl.store(dw_part_ptr + p.to(tl.int64) * D + cols, dw, mask=mask)


def rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, S, H, HALF, S_BLOCKS,
                  stride_xb, stride_xh, stride_xs, stride_ob, stride_oh, stride_os, stride_cb, stride_cs,
                  SIGN: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotary position embedding of ``x`` ``[B, H, S, 2 * HALF]`` (any strides but the last):
    ``[x1 * cos - x2 * sin, x1 * sin + x2 * cos]`` in fp32, rounded once to ``out``'s dtype;
    ``cos``/``sin`` ``[S, HALF]`` or one table per sequence (``stride_cb``). ``SIGN=-1``
    rotates back: the gradient. One program is ``BLOCK_S`` positions of one (sequence,
    head); all on grid axis 0."""
    pid = tl.program_id(0)
    bh = pid // S_BLOCKS
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    s = ((pid % S_BLOCKS) * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    mask = (s < S)[:, None] & (j < HALF)[None, :]
    x = x_ptr + b * stride_xb + h * stride_xh + s[:, None] * stride_xs + j[None, :]
    x1 = tl.load(x, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x + HALF, mask=mask, other=0.0).to(tl.float32)
    table = b * stride_cb + s[:, None] * stride_cs + j[None, :]
    c = tl.load(cos_ptr + table, mask=mask, other=0.0)
    sn = tl.load(sin_ptr + table, mask=mask, other=0.0) * SIGN
    out = out_ptr + b * stride_ob + h * stride_oh + s[:, None] * stride_os + j[None, :]
    tl.store(out, (x1 * c - x2 * sn).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + HALF, (x1 * sn + x2 * c).to(out_ptr.dtype.element_ty), mask=mask)
