"""Triton expert kernels on CPU through Triton's interpreter: outputs and every gradient
against the naive per-token reference and against the pure-torch backend.

``TRITON_INTERPRET=1`` is set per test (monkeypatch), not for the process: the kernels
pick interpreted or compiled per launch (see ``kernels/triton_src.py``), so other test
modules keep seeing ``expert_backend='triton'`` as unavailable on CPU.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch

from helpers_moe import eager_and_compiled
from lightning_hetermoe.configs import MoEConfig
from lightning_hetermoe.kernels import grouped_gemm, grouped_mlp, grouped_wgrad, triton_available
from lightning_hetermoe.moe import MoELayer, grouped_mlp_torch, resolve_backend
from lightning_hetermoe.moe.reference import reference_expert, reference_moe

RTOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.fixture(autouse=True)
def interpreter(triton_interpreter):
    """Every test here runs the kernels through Triton's interpreter (conftest)."""


def assert_close(actual, expected, what, rtol):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if expected.numel() == 0:
        return
    scale = expected.abs().max().clamp_min(1e-6)
    err = ((actual.float() - expected.float()).abs().max() / scale).item()
    assert err <= rtol, f"{what}: max relative error {err:.2e} > {rtol}"


def make_case(counts, n_tokens=23, d_model=40, d_ff=24, activation="swiglu", bias=True, seed=0):
    """An expert layer plus rows grouped by expert. 40 and 24 are not multiples of the
    interpreter blocks (16/32), and gather_idx repeats tokens as top-k routing does."""
    torch.manual_seed(seed)
    cfg = MoEConfig(num_experts=len(counts), top_k=1, d_ff=d_ff, activation=activation, bias=bias,
                    expert_backend="torch")
    layer = MoELayer(d_model, cfg)
    if bias:
        with torch.no_grad():
            layer.experts.b_up.normal_()
            layer.experts.b_down.normal_()
    counts = torch.tensor(counts, dtype=torch.long)
    gather_idx = torch.randint(0, n_tokens, (int(counts.sum()),))
    x = torch.randn(n_tokens, d_model)
    return layer, x, gather_idx, counts


def params(layer):
    ex = layer.experts
    return [ex.w_up, ex.b_up, ex.w_down, ex.b_down]


def run(fn, x, gather_idx, counts, ps, activation, upstream, recompute=False):
    x = x.detach().requires_grad_()
    ps = [p.detach().requires_grad_() if p is not None else None for p in ps]
    y = fn(x, gather_idx, counts, *ps[:2], *ps[2:], activation, recompute=recompute)
    y.backward(upstream.to(y.dtype))
    return y, [x.grad] + [p.grad if p is not None else None for p in ps]


def reference_rows(layer, x, gather_idx, counts, upstream):
    x = x.detach().requires_grad_()
    owner = torch.repeat_interleave(torch.arange(len(counts)), counts)
    rows = [reference_expert(layer, int(e), x[int(t)]) for e, t in zip(owner, gather_idx, strict=True)]
    ps = [p for p in params(layer) if p is not None]
    # No rows at all: a zero-row output that still depends on everything (zero gradients).
    y = torch.stack(rows) if rows else x.new_zeros(0, x.shape[1]) + 0 * sum(t.sum() for t in [x] + ps)
    grads = torch.autograd.grad((y * upstream).sum(), [x] + ps, allow_unused=True)
    grads = [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, [x] + ps, strict=True)]
    it = iter(grads[1:])
    return y.detach(), [grads[0]] + [next(it) if p is not None else None for p in params(layer)]


NAMES = ["x", "w_up", "b_up", "w_down", "b_down"]


def compare(got, want, dtype, label):
    (y, grads), (yr, grads_r) = got, want
    rtol = RTOL[dtype]
    assert y.dtype == dtype
    assert_close(y, yr, f"{label} output", rtol)
    for name, g, gr in zip(NAMES, grads, grads_r, strict=True):
        if gr is None:
            assert g is None, f"{label} {name}: gradient for an absent bias"
            continue
        assert g is not None and g.dtype == dtype, f"{label} {name}: missing or wrong-dtype gradient"
        assert_close(g, gr, f"{label} grad {name}", rtol)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("recompute", [False, True])
def test_grouped_mlp_fp32_matches_reference_and_torch(activation, bias, recompute):
    # Expert 1 gets no tokens; the others get counts that are not multiples of BLOCK_M.
    layer, x, idx, counts = make_case([7, 0, 19, 11], activation=activation, bias=bias)
    upstream = torch.randn(int(counts.sum()), x.shape[1])
    got = run(grouped_mlp, x, idx, counts, params(layer), activation, upstream, recompute)
    compare(got, reference_rows(layer, x, idx, counts, upstream), torch.float32, "vs reference")
    compare(got, run(grouped_mlp_torch, x, idx, counts, params(layer), activation, upstream),
            torch.float32, "vs torch backend")
    assert got[1][1][1].abs().max() == 0, "an expert without tokens must get an exact zero gradient"


@pytest.mark.parametrize("counts", [[37], [0, 0, 5], [0, 0, 0]], ids=["one-expert", "leading-empty", "no-rows"])
def test_grouped_mlp_edge_counts(counts):
    layer, x, idx, counts = make_case(counts, activation="gelu", bias=True)
    upstream = torch.randn(int(counts.sum()), x.shape[1])
    got = run(grouped_mlp, x, idx, counts, params(layer), "gelu", upstream)
    compare(got, reference_rows(layer, x, idx, counts, upstream), torch.float32, "vs reference")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_grouped_mlp_half_precision(dtype, activation):
    """Low-precision inputs, fp32 accumulation: within the dtype's rounding of an fp32 run
    on the same (rounded) inputs."""
    layer, x, idx, counts = make_case([9, 0, 21], activation=activation, bias=True)
    with torch.no_grad():
        for p in layer.experts.parameters():
            p.copy_(p.to(dtype).float())  # the reference sees exactly the low-precision values
    x = x.to(dtype).float()
    upstream = torch.randn(int(counts.sum()), x.shape[1]).to(dtype).float()
    ps = [p.to(dtype) if p is not None else None for p in params(layer)]
    got = run(grouped_mlp, x.to(dtype), idx, counts, ps, activation, upstream, recompute=True)
    compare(got, reference_rows(layer, x, idx, counts, upstream), dtype, f"{dtype}")


def test_gemm_epilogues_scale_and_scatter():
    """The fused epilogues of the raw kernel: per-row weight and scatter to output rows."""
    torch.manual_seed(1)
    E, K, N, rows = 3, 40, 50, 30
    counts = torch.tensor([12, 0, 18])
    x = torch.randn(rows, K)
    w = torch.randn(E, N, K).transpose(1, 2)  # a non-contiguous [E, K, N] view, as in backward
    bias = torch.randn(E, N)
    scale = torch.rand(rows)
    dest = torch.randperm(rows + 5)[:rows]
    out = grouped_gemm(x, w, counts, bias=bias, scale=scale, out_idx=dest, out_rows=rows + 5)
    owner = torch.repeat_interleave(torch.arange(E), counts)
    dense = torch.einsum("mk,mkn->mn", x, w[owner]) + bias[owner]
    want = torch.zeros(rows + 5, N)
    want[dest] = dense * scale[:, None]
    assert_close(out, want, "scaled, scattered gemm", 1e-5)

    dy = torch.randn(rows, N)
    dw = grouped_wgrad(x, dy, counts)
    assert dw[1].abs().max() == 0
    assert_close(dw[0], x[:12].T @ dy[:12], "wgrad expert 0", 1e-5)
    assert_close(dw[2], x[12:].T @ dy[12:], "wgrad expert 2", 1e-5)


@pytest.mark.slow  # computes for seconds (the quick loop stays about a minute)
def test_launch_order_changes_no_result():
    """Row tiles launched side by side (GROUP) compute every tile as one row tile at a time
    does, to the bit, and as the per-expert products: ragged and empty experts, groups that
    straddle experts, a short last group, groups larger than the grid."""
    from lightning_hetermoe.kernels import tuning

    torch.manual_seed(2)
    # 16-row tiles: 0, 3, 1, 0, 4, 1 of them, 15 row tiles launched (9 real, 6 surplus)
    counts = torch.tensor([0, 37, 5, 0, 50, 16])
    E, K, N, tokens = len(counts), 100, 70, 61
    rows = int(counts.sum())
    x = torch.randn(tokens, K)
    idx = torch.randint(0, tokens, (rows,))
    w = torch.randn(E, K, N)
    bias = torch.randn(E, N)
    dy = torch.randn(rows, N)
    owner = torch.repeat_interleave(torch.arange(E), counts)
    want_y = torch.einsum("mk,mkn->mn", x[idx], w[owner]) + bias[owner]
    want_dw = torch.stack([x[idx][owner == e].T @ dy[owner == e] for e in range(E)])
    got = {}
    for group in (1, 2, 3, 4, 8, 64):
        with tuning.launch_group(group):
            got[group] = (grouped_gemm(x, w, counts, gather_idx=idx, bias=bias),
                          grouped_wgrad(x, dy, counts, gather_idx=idx))
        assert_close(got[group][0], want_y, f"gemm, GROUP={group}", 1e-5)
        assert_close(got[group][1], want_dw, f"wgrad, GROUP={group}", 1e-5)
        assert torch.equal(got[group][0], got[1][0]) and torch.equal(got[group][1], got[1][1]), group


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tma_loads_change_no_result(dtype, monkeypatch):
    """Operands by TMA descriptor (``tuning.tma_loads``) compute what the pointer loads do, to
    the bit: rows grouped by expert on ragged descriptors (ragged and empty experts; every
    tile, the K tail and the N tail past a bound, where the copy gives zeros), weights on a
    3-D one; gathered rows and transposed weights keep their pointers. The descriptors are
    counted: each launch that can take one does."""
    from lightning_hetermoe.kernels import launch, tuning

    made = []
    for name in ("ragged_rows_descriptor", "weight_descriptor"):
        real = getattr(launch, name)

        def counted(t, *blocks, real=real, name=name):
            desc = real(t, *blocks)
            made.append((name, tuple(t.shape), desc is not None))
            return desc

        monkeypatch.setattr(launch, name, counted)
    torch.manual_seed(4)
    counts = torch.tensor([0, 37, 5, 0, 50, 16])
    E, K, N, tokens = len(counts), 72, 40, 61  # K, N: not multiples of the blocks (32)
    rows = int(counts.sum())
    x = torch.randn(tokens, K).to(dtype)
    grouped_x = torch.randn(rows, K).to(dtype)
    idx = torch.randint(0, tokens, (rows,))
    w = torch.randn(E, K, N).to(dtype)
    w_t = torch.randn(E, N, K).to(dtype).transpose(1, 2)  # as grad_rows passes it
    dy = torch.randn(rows, N).to(dtype)

    def every_launch():
        return (grouped_gemm(x, w, counts, gather_idx=idx), grouped_gemm(grouped_x, w, counts),
                grouped_gemm(grouped_x, w_t, counts), grouped_wgrad(x, dy, counts, gather_idx=idx),
                grouped_wgrad(grouped_x, dy, counts))

    pointers = every_launch()
    assert not made, "no descriptor outside tma_loads"
    with tuning.tma_loads(True):
        by_tma = every_launch()
    for i, (a, b) in enumerate(zip(pointers, by_tma, strict=True)):
        assert torch.equal(a, b), f"launch {i}"
    owner = torch.repeat_interleave(torch.arange(E), counts)
    want = torch.einsum("mk,mkn->mn", grouped_x.double(), w[owner].double())
    assert_close(by_tma[1], want, "down-style gemm by TMA", RTOL[dtype])
    built = [(name, shape) for name, shape, ok in made if ok]
    assert built == [("weight_descriptor", (E, K, N)),  # the up GEMM: rows gathered
                     ("ragged_rows_descriptor", (rows, K)), ("weight_descriptor", (E, K, N)),
                     ("ragged_rows_descriptor", (rows, K)),  # transposed weights: pointers
                     ("ragged_rows_descriptor", (rows, N)),  # wgrad with gathered x: dy only
                     ("ragged_rows_descriptor", (rows, K)), ("ragged_rows_descriptor", (rows, N))], made
    assert ("weight_descriptor", (E, K, N), False) in made  # the transposed view refused


def test_row_tile_map_and_the_autotuners_scan_find_the_same_experts():
    """Each GEMM program finds its tile's expert from the row tile map the launch built
    (``RowTiles``), or, under the autotuner, by scanning the counts itself: both give the
    per-expert products, ragged, with empty experts and surplus tiles; the map by hand."""
    from lightning_hetermoe.kernels import launch, triton_src, tuning

    torch.manual_seed(3)
    counts = torch.tensor([0, 37, 5, 0, 50, 16, 0])
    E, K, N, rows = len(counts), 40, 50, int(counts.sum())
    tile_expert, tile_first = launch.RowTiles(counts).map(16, rows)
    # 16-row tiles: 0, 3, 1, 0, 4, 1, 0 of them; cdiv(108, 16) + 7 = 14 launched
    assert tile_expert.tolist() == [1, 1, 1, 2, 4, 4, 4, 4, 5] + [E] * 5
    assert tile_first.tolist() == [0, 0, 3, 4, 4, 8, 9]
    x, w, bias = torch.randn(rows, K), torch.randn(E, K, N), torch.randn(E, N)
    owner = torch.repeat_interleave(torch.arange(E), counts)
    want = torch.einsum("mk,mkn->mn", x, w[owner]) + bias[owner]
    assert_close(grouped_gemm(x, w, counts, bias=bias), want, "gemm on the map", 1e-5)

    scanned = torch.empty(rows, N)
    blocks = dict(tuning.INTERPRET_BLOCKS)
    launch._interpreted(triton_src.grouped_gemm_kernel)[
        (launch.gemm_grid(rows, N, E, blocks["BLOCK_M"], blocks["BLOCK_N"]))](
        x, counts, counts, launch._offsets(counts), counts, counts, w, bias, scanned, counts, counts, counts, counts,
        N, K, E, 0, x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), bias.stride(0), bias.stride(1),
        scanned.stride(0), scanned.stride(1), HAS_IDX=False, HAS_BIAS=True, HAS_OUT_IDX=False, HAS_SCALE=False,
        TILE_MAP=False, X_DESC=False, W_DESC=False, INPUT_PRECISION="ieee", UPCAST=False, **blocks)
    assert_close(scanned, want, "gemm scanning the counts", 1e-5)


def test_launch_group_is_checked_and_put_back():
    from lightning_hetermoe.kernels import tuning

    for bad in (0, 65, True, 2.0):
        with pytest.raises(ValueError, match="launch_group"):
            with tuning.launch_group(bad):
                pass
    blocks = {"BLOCK_M": 16, "GROUP": 8}
    with tuning.launch_group(1):
        assert tuning.with_group(blocks) == {"BLOCK_M": 16, "GROUP": 1}
        with tuning.launch_group(4):
            assert tuning.with_group(blocks)["GROUP"] == 4
        assert tuning.with_group(blocks)["GROUP"] == 1
    assert tuning.with_group(blocks) is blocks


def layer_pair(cfg: MoEConfig, d_model=24, seed=0):
    torch.manual_seed(seed)
    tri = MoELayer(d_model, cfg)
    if cfg.bias:
        with torch.no_grad():
            tri.experts.b_up.normal_()
            tri.experts.b_down.normal_()
    ref_cfg = MoEConfig(**{**cfg.__dict__, "expert_backend": "torch"})
    ref = MoELayer(d_model, ref_cfg)
    ref.load_state_dict(tri.state_dict())
    return tri, ref


@pytest.mark.parametrize("top_k,activation,bias,capacity_factor", [
    (1, "gelu", True, 0.0),
    (2, "swiglu", False, 0.0),
    (2, "gelu", False, 0.5),  # capacity drops choices; some experts end up with few or no rows
])
def test_moe_layer_triton_backend(top_k, activation, bias, capacity_factor):
    cfg = MoEConfig(num_experts=5, top_k=top_k, d_ff=20, activation=activation, bias=bias,
                    capacity_factor=capacity_factor, jitter_eps=0.0, expert_backend="triton")
    tri, ref = layer_pair(cfg)
    x = torch.randn(19, 24)
    upstream = torch.randn(19, 24)
    results = []
    for layer in (tri, ref):
        xi = x.clone().requires_grad_()
        y, aux = layer(xi)
        loss = (y * upstream).sum() + aux.balance_loss + aux.z_loss
        grads = torch.autograd.grad(loss, [xi] + list(layer.parameters()))
        results.append((y, grads))
    xr = x.clone().requires_grad_()
    yr, balance, z = reference_moe(ref, xr)
    grads_r = torch.autograd.grad((yr * upstream).sum() + balance + z, [xr] + list(ref.parameters()))
    names = ["x"] + [n for n, _ in tri.named_parameters()]
    assert "router.weight" in names
    (y, grads), (yt, grads_t) = results
    assert_close(y, yr, "layer output vs reference", 1e-5)
    assert_close(y, yt, "layer output vs torch backend", 1e-5)
    for name, g, gr, gt in zip(names, grads, grads_r, grads_t, strict=True):
        assert_close(g, gr, f"grad {name} vs reference", 1e-5)
        assert_close(g, gt, f"grad {name} vs torch backend", 1e-5)


def tiny_lm(backend: str):
    """The language model both trajectory tests train: SwiGLU experts on ``backend``."""
    from lightning_hetermoe.configs import ModelConfig, OptimConfig
    from lightning_hetermoe.model.lm import MoELanguageModel

    torch.manual_seed(0)
    moe = MoEConfig(num_experts=4, top_k=2, d_ff=16, activation="swiglu", jitter_eps=0.0, expert_backend=backend)
    cfg = ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, max_seq_len=16, moe=moe)
    return MoELanguageModel(cfg, OptimConfig(lr=1e-2, warmup_steps=0))


def assert_one_trajectory(model, ref, during=lambda model: contextlib.nullcontext(), steps: int = 3):
    """``model`` and ``ref`` trained ``steps`` AdamW steps on the same batches (each forward
    and backward under ``during(model)``): the same loss at every step, every parameter's
    gradient at the first, every parameter after the last."""
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        tokens = torch.randint(0, 64, (2, 9), generator=gen)
        batch = (tokens[:, :-1], tokens[:, 1:])
        losses, grads = [], []
        for m, opt in zip((model, ref), opts, strict=True):
            with during(m):
                opt.zero_grad()
                loss = m.losses(batch)["loss"]
                loss.backward()
            losses.append(loss.detach())
            grads.append([p.grad.clone() for p in m.parameters()])
            opt.step()
        assert_close(losses[0], losses[1], f"step {step} loss", 1e-5)
        if step == 0:
            for (name, _), g, h in zip(model.named_parameters(), *grads, strict=True):
                assert_close(g, h, f"{name}'s gradient", 1e-4)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert_close(p.detach(), q.detach(), f"{name} after {steps} steps", 1e-4)


def test_full_model_backends_agree_over_training_steps():
    """The language model trained a few AdamW steps on each backend stays on one trajectory."""
    tri, ref = tiny_lm("triton"), tiny_lm("torch")
    ref.load_state_dict(tri.state_dict())
    assert_one_trajectory(tri, ref)


def test_backend_resolution(monkeypatch):
    from lightning_hetermoe import kernels
    from lightning_hetermoe.kernels import chooser

    cpu = torch.device("cpu")
    monkeypatch.setattr(chooser, "_AUTO", {})
    assert resolve_backend("auto", cpu) is not kernels.grouped_mlp, "auto never picks the interpreter"
    assert triton_available(cpu)
    assert resolve_backend("triton", cpu) is kernels.grouped_mlp
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not triton_available(cpu)
    with pytest.raises(ValueError, match="expert_backend='triton' cannot run on cpu: .*TRITON_INTERPRET.*use "
                                         "expert_backend=auto"):
        resolve_backend("triton", cpu)


def test_row_buckets():
    """Power of two at or above M, clamped: the first small batch keys its own configs."""
    from lightning_hetermoe.kernels.tuning import M_BUCKET_MAX, M_BUCKET_MIN, m_bucket, tuning_buckets

    assert [m_bucket(m) for m in (0, 1, 256, 257, 1000, 1024, 1025)] == [256, 256, 256, 512, 1024, 1024, 2048]
    assert m_bucket(10 ** 7) == M_BUCKET_MAX
    buckets = tuning_buckets()
    assert buckets[0] == M_BUCKET_MIN and buckets[-1] == M_BUCKET_MAX
    assert all(b == 2 * a for a, b in itertools.pairwise(buckets))
    assert {m_bucket(m) for m in range(0, 40000, 97)} == set(buckets)


def test_the_autotuner_caches_on_disk_where_triton_can_and_builds_where_it_cannot(monkeypatch):
    """``cache_results`` came with Triton 3.4; the project takes Triton 3.0 on, whose
    ``autotune`` refuses the keyword."""
    import triton

    from lightning_hetermoe.kernels import launch, triton_src

    real, seen = triton.autotune, []

    def before_3_4(configs, key, prune_configs_by=None, reset_to_zero=None, restore_value=None, warmup=None,
                   rep=None, use_cuda_graph=False, do_bench=None):
        seen.append("3.0")
        return real(configs, key)

    def from_3_4(configs, key, cache_results=False, **kwargs):
        seen.append(cache_results)
        return real(configs, key)

    for autotune in (before_3_4, from_3_4):
        monkeypatch.setattr(triton, "autotune", autotune)
        tuned = launch.autotuner.__wrapped__(triton_src.grouped_gemm_kernel, "gemm", (9, 0), torch.bfloat16, None)
        assert "M_BUCKET" in tuned.keys
    assert seen == ["3.0", True]


@pytest.mark.parametrize("which", ["gemm", "wgrad"])
def test_autotune_key_has_row_bucket(which, monkeypatch):
    """The autotuner is keyed on the row bucket, and each launch passes the bucket of its M."""
    import inspect

    from lightning_hetermoe.kernels import launch, triton_src

    fn = triton_src.grouped_gemm_kernel if which == "gemm" else triton_src.grouped_wgrad_kernel
    tuned = launch.autotuner(fn, which, (9, 0), torch.bfloat16, None)
    assert "M_BUCKET" in tuned.keys and 1 <= len(tuned.configs) <= 3
    calls = []

    class Recorder:
        def __getitem__(self, grid):
            # positional arguments name the kernel's first parameters (not strict: the rest come as keywords)
            return lambda *args, **kwargs: calls.append(dict(zip(inspect.signature(fn).parameters, args)) | kwargs)

    monkeypatch.setattr(launch, "_kernel", lambda fn, which, device, dtype, bucket: (Recorder(), {}))
    counts = torch.tensor([600, 0, 400])
    x, w = torch.randn(1000, 8), torch.randn(3, 8, 16)
    if which == "gemm":
        grouped_gemm(x, w, counts)
        grouped_gemm(x[:300], w, torch.tensor([100, 100, 100]))
    else:
        grouped_wgrad(x, torch.randn(1000, 16), counts)
        grouped_wgrad(x[:300], torch.randn(300, 16), torch.tensor([100, 100, 100]))
    assert [c["M_BUCKET"] for c in calls] == [1024, 512]


def test_fp32_dots_follow_torch_tf32_setting(monkeypatch):
    """Under 32-true, tl.dot uses TF32 exactly when torch's fp32 CUDA matmuls do (new and
    legacy APIs), and only on GPUs with TF32 tensor cores; a CUDA launch never gets plain
    fp32 ("ieee": an internal error, the MLP routes such calls to the torch loop); 16-bit
    inputs take Triton's default; the interpreter stays exact."""
    from lightning_hetermoe.kernels import launch

    cuda, cap = torch.device("cuda", 0), {"v": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap["v"])
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    try:
        matmul.fp32_precision = "ieee"
        assert not launch.tf32_enabled()
        with pytest.raises(RuntimeError, match="internal error.*triton_runs_dtype"):
            launch._precision(torch.float32, cuda)
        matmul.fp32_precision = "tf32"
        assert launch.tf32_enabled() and launch._precision(torch.float32, cuda) == "tf32"
        assert launch._precision(torch.bfloat16, cuda) == "tf32"
        assert launch._precision(torch.float32, torch.device("cpu")) == "ieee"
        cap["v"] = (7, 5)  # Turing: no TF32
        with pytest.raises(RuntimeError, match="internal error"):
            launch._precision(torch.float32, cuda)
        assert launch._precision(torch.float16, cuda) == "tf32"
        cap["v"] = (8, 0)
        matmul.fp32_precision = before
        torch.set_float32_matmul_precision("high")  # the legacy API
        assert launch._precision(torch.float32, cuda) == "tf32"
        torch.set_float32_matmul_precision("highest")
        with pytest.raises(RuntimeError, match="internal error"):
            launch._precision(torch.float32, cuda)
    finally:
        torch.set_float32_matmul_precision("highest")
        matmul.fp32_precision = before
    assert launch.input_precision(torch.float32, "cuda", (8, 6), True) == "tf32"
    assert launch.input_precision(torch.float32, "cuda", (7, 0), True) == "ieee"
    assert launch.input_precision(torch.float16, "cuda", (9, 0), True) == "tf32"
    assert launch.input_precision(torch.float32, "cpu", None, True) == "ieee"


def test_warm_up_runs_every_bucket(monkeypatch):
    """warm_up(rows=None), the strategy's call, runs the MLP forward and backward once per
    row bucket; explicit rows run once per distinct bucket."""
    from lightning_hetermoe import kernels
    from lightning_hetermoe.kernels import mlp
    from lightning_hetermoe.kernels.tuning import tuning_buckets

    seen = []

    def fake(x, gather_idx, counts, w_up, b_up, w_down, b_down, activation, recompute=False):
        seen.append((x.shape[0], int(counts.sum()), w_up.shape, b_up is not None))
        return grouped_mlp_torch(x, gather_idx, counts, w_up, b_up, w_down, b_down, activation)

    monkeypatch.setattr(mlp, "grouped_mlp", fake)
    ran = kernels.warm_up(8, 4, "swiglu", True, torch.float32, device=torch.device("cpu"))
    assert ran == tuning_buckets() == [s[0] for s in seen] == [s[1] for s in seen]
    assert all(s[2] == (2, 8, 8) and s[3] for s in seen)
    seen.clear()
    assert kernels.warm_up(8, 4, "gelu", False, torch.float32, torch.device("cpu"), rows=[100, 200, 3000]) == [100, 3000]
    seen.clear()
    # a rank holding one expert of the layer warms with one expert (E is the real local count)
    assert kernels.warm_up(8, 4, "gelu", False, torch.float32, torch.device("cpu"), rows=300, experts=1) == [300]
    assert seen == [(300, 300, (1, 8, 4), False)]


def test_custom_op_traces_under_torch_compile():
    """The MoE MLP is one opaque op for dynamo/AOTAutograd: fullgraph compiles, grads match."""
    layer, x, idx, counts = make_case([5, 0, 8], activation="swiglu", bias=True)
    ps = params(layer)

    def f(x, *ps):
        return grouped_mlp(x, idx, counts, *ps[:2], *ps[2:], "swiglu")

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    outs = []
    for fn in (f, compiled):
        xi = x.clone().requires_grad_()
        pi = [p.detach().clone().requires_grad_() for p in ps]
        y = fn(xi, *pi)
        y.square().sum().backward()
        outs.append([y, xi.grad] + [p.grad for p in pi])
    for name, a, b in zip(["y"] + NAMES, *outs, strict=True):
        assert_close(b, a, f"compiled {name}", 1e-6)


def test_moe_layer_compiles_with_triton_backend():
    """torch.compile over the whole layer: the expert op traces (graph breaks, if any, come
    from the data-dependent routing), and output and gradients match eager."""
    for a, b in zip(*eager_and_compiled("triton"), strict=True):
        assert_close(b, a, "compiled layer", 1e-6)


def test_opcheck_registration():
    from lightning_hetermoe.kernels.mlp import grouped_mlp_op

    layer, x, idx, counts = make_case([3, 0, 4], n_tokens=5, d_model=8, d_ff=8, activation="gelu", bias=True)
    ps = [p.detach().requires_grad_() for p in params(layer)]
    torch.library.opcheck(grouped_mlp_op, (x.requires_grad_(), idx, counts, *ps, "gelu", False),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_row_tiles_launch_on_the_grid_axis_without_the_65535_limit():
    """4.5M rows in tiles of 16 are 281K row tiles: on grid axis 1 or 2 (65535 at most) the
    launch would fail; every (row tile, column tile) goes on axis 0 (2^31 - 1)."""
    from lightning_hetermoe.kernels.launch import gemm_grid

    M, N, E, bm, bn = 4_500_000, 1024, 8, 16, 64
    grid = gemm_grid(M, N, E, bm, bn)
    assert len(grid) == 1 and grid[0] == (-(-M // bm) + E) * (N // bn) < 2 ** 31 - 1
    assert -(-M // bm) > 65535  # the old axis-1 layout could not have launched this


def test_row_counts_past_the_largest_tuned_bucket_take_its_tiles():
    from lightning_hetermoe.kernels import tuning

    try:
        assert tuning.m_bucket(100_000) == tuning.M_BUCKET_MAX
        tuning.tuned_up_to(2048)  # warm-up found no memory for 4096 rows and up
        assert tuning.m_bucket(100_000) == 2048 and tuning.m_bucket(3000) == 2048
        assert tuning.m_bucket(1000) == 1024  # buckets it did tune stay as they were
    finally:
        tuning.tuned_up_to(None)
    assert tuning.m_bucket(100_000) == tuning.M_BUCKET_MAX


def swiglu_reference(h: torch.Tensor, grad: torch.Tensor):
    """``silu(gate) * up`` and its gradient by torch's autograd, in float64."""
    h64 = h.double().requires_grad_()
    gate, up = h64.chunk(2, dim=-1)
    a = torch.nn.functional.silu(gate) * up
    (dh,) = torch.autograd.grad(a, h64, grad.double())
    return a.detach(), dh


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_swiglu_matches_autograd(dtype):
    """The fused SwiGLU kernels (forward and gradient) against torch's autograd in float64
    and against the torch ops the CPU runs, on shapes that cross every block edge, a
    row-strided input and no rows at all."""
    from lightning_hetermoe.kernels import activation, launch

    torch.manual_seed(4)
    M, F = 37, 45
    wide = (torch.randn(M, 2 * F + 6) * 3).to(dtype)
    for h in (wide[:, :2 * F].contiguous(), wide[:, :2 * F]):  # the second: row stride 96
        grad = torch.randn(M, F).to(dtype)
        want_a, want_dh = swiglu_reference(h, grad)
        a, dh = launch.swiglu(h), launch.swiglu_backward(h, grad)
        assert a.dtype == dh.dtype == dtype and dh.shape == h.shape
        assert_close(a, want_a, f"swiglu {dtype}", RTOL[dtype])
        assert_close(dh, want_dh, f"swiglu backward {dtype}", RTOL[dtype])
        assert_close(a, activation.forward(h, "swiglu"), f"swiglu against torch's ops {dtype}", RTOL[dtype])
        assert_close(dh, activation.backward(h, grad, "swiglu"), f"gradient against torch's ops {dtype}",
                     RTOL[dtype])
    empty = torch.empty(0, 2 * F, dtype=dtype)
    assert launch.swiglu(empty).shape == (0, F) and launch.swiglu_backward(empty, empty[:, :F]).shape == (0, 2 * F)


def test_fused_swiglu_runs_only_where_it_should():
    """CUDA only (the interpreter is for tests), never under an autograd recording through
    its input (the shared expert's MLP), and off inside ``fused(False)``."""
    from lightning_hetermoe.kernels import swiglu

    h = torch.randn(4, 8)
    assert not swiglu.runs_fused(h)  # on CPU even with TRITON_INTERPRET=1
    meta_cuda = torch.empty(4, 8, device="meta")
    assert not swiglu.runs_fused(meta_cuda)
    torch.library.opcheck(swiglu.swiglu_op, (h,), test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(swiglu.swiglu_backward_op, (h, torch.randn(4, 4)), test_utils=("test_schema", "test_faketensor"))
    with swiglu.fused(False):
        assert not swiglu.fused.value
        with swiglu.fused(True):
            assert swiglu.fused.value
        assert not swiglu.fused.value
    assert swiglu.fused.value


@pytest.mark.parametrize("recompute", [False, True])
def test_every_backend_on_the_fused_swiglu(monkeypatch, recompute):
    """With the fused activation taken wherever it may be (here the CPU, through the
    interpreter, as CUDA takes it), the Triton, grouped_mm and loop backends still match
    the per-token reference: outputs and every gradient; the shared expert's MLP, which
    torch differentiates, keeps torch's ops."""
    from lightning_hetermoe.kernels import grouped_mlp_grouped_mm, grouped_mm_available, swiglu

    calls = []

    def cpu_too(h):
        fused = not (h.requires_grad and torch.is_grad_enabled())
        calls.append(fused)
        return fused

    monkeypatch.setattr(swiglu, "runs_fused", cpu_too)
    layer, x, idx, counts = make_case([7, 0, 19, 11], activation="swiglu", bias=True)
    upstream = torch.randn(int(counts.sum()), x.shape[1])
    want = reference_rows(layer, x, idx, counts, upstream)
    backends = {"triton": grouped_mlp, "torch": grouped_mlp_torch}
    if grouped_mm_available("cpu"):
        backends["grouped_mm"] = grouped_mlp_grouped_mm
    for name, fn in backends.items():
        calls.clear()
        compare(run(fn, x, idx, counts, params(layer), "swiglu", upstream, recompute), want, torch.float32, name)
        assert calls and all(calls), (name, calls)  # forward, backward (and the recomputed forward)
    calls.clear()
    h = torch.randn(3, 8, requires_grad=True)
    from lightning_hetermoe.kernels.activation import forward

    forward(h, "swiglu").sum().backward()
    assert calls == [False] and h.grad is not None


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                             (torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_fused_rms_norm_matches_torchs_ops(monkeypatch, x_dtype, w_dtype):
    """The model's RMSNorm on the kernels (the CPU here, through the interpreter, as CUDA
    takes them) against torch's ops: the output (its dtype the product's) and the gradients
    of the input and the weight, at a width that is no power of two and rows that do not
    fill the backward's programs evenly."""
    from lightning_hetermoe.kernels import rms_norm
    from lightning_hetermoe.model.transformer import RMSNorm

    torch.manual_seed(5)
    norm = RMSNorm(40, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(40) + 0.5)
    norm = norm.to(w_dtype)
    x = (torch.randn(3, 7, 40) * 2).to(x_dtype)
    up = torch.randn(3, 7, 40)

    def run():
        xx = x.clone().requires_grad_()
        norm.weight.grad = None
        y = norm(xx)
        y.backward(up.to(y.dtype))
        return y.detach(), xx.grad, norm.weight.grad.clone()

    want = run()
    monkeypatch.setattr(rms_norm, "runs_fused", lambda x, w: True)
    monkeypatch.setattr(launch_module(), "NORM_PROGRAMS", 4)  # 21 rows over 4 programs: 6, 6, 6, 3
    got = run()
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}[x_dtype]
    for name, a, b in zip(("output", "input gradient", "weight gradient"), got, want, strict=True):
        assert a.dtype == b.dtype, (name, a.dtype, b.dtype)
        assert_close(a, b, f"{name} {x_dtype}/{w_dtype}", tol)
    torch.library.opcheck(rms_norm.rms_norm_op, (x.float(), norm.weight.detach().float(), 1e-6),
                          test_utils=("test_schema", "test_faketensor"))


def launch_module():
    from lightning_hetermoe.kernels import launch

    return launch


@pytest.mark.slow  # computes for seconds (the quick loop stays about a minute)
def test_the_model_on_every_fused_kernel_stays_with_torchs_ops(monkeypatch):
    """The language model with its RMSNorms, rotary embeddings, expert SwiGLU and head's
    cross-entropy on the fused kernels (through the interpreter, as CUDA takes them) against torch's ops: the
    loss and every parameter's gradient, then three AdamW steps on one trajectory."""
    from lightning_hetermoe.kernels import cross_entropy, rms_norm, rotary, swiglu

    fused, ref = tiny_lm("torch"), tiny_lm("torch")
    ran = {"norm": 0, "swiglu": 0, "rows": 0, "rotary": 0}

    def count(name, when=lambda *a: True):
        def decide(*args):
            ok = when(*args)
            ran[name] += ok
            return ok
        return decide

    @contextlib.contextmanager
    def on_kernels(model):
        with monkeypatch.context() as m:
            if model is fused:
                m.setattr(rms_norm, "runs_fused", count("norm"))
                m.setattr(swiglu, "runs_fused", count("swiglu", lambda h: not (h.requires_grad
                                                                             and torch.is_grad_enabled())))
                m.setattr(cross_entropy, "runs_fused", count("rows"))
                m.setattr(rotary, "runs_fused", count("rotary"))
            yield

    assert_one_trajectory(fused, ref, on_kernels)
    assert all(ran.values()), ran


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True])
def test_fused_rotary_matches_torchs_ops(monkeypatch, dtype, packed):
    """Rotary embedding on its kernel (the CPU here, through the interpreter) against torch's
    ops: queries laid out as the attention lays them ([B, H, S, D] from [B, S, H, D], not
    contiguous), one table for every row or one per packed row; the output and the gradient."""
    from lightning_hetermoe.kernels import rotary
    from lightning_hetermoe.model.transformer import apply_rotary, rotary_tables

    torch.manual_seed(6)
    B, S, H, D = 2, 11, 3, 12
    positions = torch.randint(0, S, (B, S)) if packed else None
    cos, sin = rotary_tables(S, D, torch.device("cpu"), positions=positions)
    x = torch.randn(B, S, H, D).to(dtype)
    up = torch.randn(B, H, S, D)

    def run():
        xx = x.clone().requires_grad_()
        y = apply_rotary(xx.transpose(1, 2), cos, sin)
        y.backward(up.to(y.dtype))
        return y.detach(), xx.grad

    want = run()
    monkeypatch.setattr(rotary, "runs_fused", lambda x, cos: True)
    got = run()
    tol = {torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    for name, a, b in zip(("output", "gradient"), got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert_close(a, b, f"rotary {name} {dtype}", tol)
