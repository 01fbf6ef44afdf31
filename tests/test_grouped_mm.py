"""The ``grouped_mm`` expert backend (``torch._grouped_mm``) against the per-expert loop,
and how ``expert_backend="auto"`` picks a backend from what was measured.

Tolerances, as max |a - b| / max |b| per tensor:

- fp32, 1e-6: both backends run the same fp32 GEMMs (on CPU ``_grouped_mm`` is one ``mm``
  per group), so outputs and weight gradients agree to the last bits or nearly; what
  differs is summation order (bias gradients are an ``index_add`` over rows here, a
  column sum there; padded copies for odd widths block the products differently; the
  SwiGLU derivative is written out). That is a few fp32 ulps (2^-23 ~ 1.2e-7) of the
  largest entry; 1e-6 leaves 8 ulps.
- bf16, 2e-2 against fp32 on the same bf16-rounded inputs, the bound the loop itself is
  held to (checked below): bf16 keeps 8 bits (relative rounding 2^-9 ~ 2e-3), and an
  output is rounded at each of ~4 steps (up GEMM, bias, activation, down GEMM) and a
  gradient at ~6, each error carried through a GEMM of ~40-100 terms; the result lands at
  a few 1e-3 (measured: <= 8e-3 here, <= 1.1e-2 for the bf16 loop), so 2e-2 catches a wrong formula or a lost bias (errors
  of order 1) without flaking on rounding.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from helpers_moe import eager_and_compiled
from lightning_hetermoe import kernels
from lightning_hetermoe.configs import MoEConfig
from lightning_hetermoe.kernels import grouped_mlp_grouped_mm, measured
from lightning_hetermoe.moe import MoELayer, grouped_mlp_torch, resolve_backend
from lightning_hetermoe.kernels import chooser
from helpers_bench import load_bench

FP32_TOL = 1e-6
BF16_TOL = 2e-2
NAMES = ["y", "x", "w_up", "b_up", "w_down", "b_down"]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    if b.numel() == 0:
        return 0.0
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def make(counts, d_model=40, d_ff=24, activation="swiglu", bias=True, n_tokens=23, seed=0):
    """Weights, tokens and rows grouped by expert; gather_idx repeats tokens (top-k)."""
    g = torch.Generator().manual_seed(seed)
    E, h = len(counts), (2 * d_ff if activation == "swiglu" else d_ff)
    counts = torch.tensor(counts, dtype=torch.long)
    ps = [torch.randn(E, d_model, h, generator=g) / d_model ** 0.5,
          torch.randn(E, h, generator=g) if bias else None,
          torch.randn(E, d_ff, d_model, generator=g) / d_ff ** 0.5,
          torch.randn(E, d_model, generator=g) if bias else None]
    x = torch.randn(n_tokens, d_model, generator=g)
    idx = torch.randint(0, n_tokens, (int(counts.sum()),), generator=g)
    upstream = torch.randn(int(counts.sum()), d_model, generator=g)
    return x, idx, counts, ps, upstream


def run(fn, x, idx, counts, ps, activation, upstream, recompute=False, dtype=None, x_grad=True):
    """Output and gradients of x and of every parameter (None for an absent bias)."""
    cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
    xi = cast(x).detach().requires_grad_(x_grad)
    pi = [cast(p).detach().requires_grad_() if p is not None else None for p in ps]
    y = fn(xi, idx, counts, *pi, activation, recompute=recompute)
    if upstream is None:
        y.sum().backward()  # an expanded, stride-0 incoming gradient
    else:
        y.backward(cast(upstream).to(y.dtype))
    return [y.detach(), xi.grad] + [p.grad if p is not None else None for p in pi]


def compare(got, want, tol, label, dtype=torch.float32):
    for name, a, b in zip(NAMES, got, want, strict=True):
        if b is None:
            assert a is None, f"{label} {name}: a gradient where the loop has none"
            continue
        assert a is not None, f"{label} {name}: missing"
        assert a.dtype == dtype, f"{label} {name}: dtype {a.dtype}"
        err = rel_err(a, b)
        assert err <= tol, f"{label} {name}: relative error {err:.2e} > {tol}"


CASES = {
    "ragged+empty": [7, 0, 19, 11],
    "one-expert": [29],
    "leading-empty": [0, 0, 5],
    "trailing-empty": [6, 13, 0],
    "no-rows": [0, 0, 0],
}


@pytest.mark.parametrize("recompute", [False, True], ids=["store-h", "recompute"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_fp32_matches_loop(case, activation, bias, recompute):
    x, idx, counts, ps, upstream = make(CASES[case], activation=activation, bias=bias)
    got = run(grouped_mlp_grouped_mm, x, idx, counts, ps, activation, upstream, recompute)
    want = run(grouped_mlp_torch, x, idx, counts, ps, activation, upstream)
    compare(got, want, FP32_TOL, f"{case}/{activation}")
    for e in (i for i, n in enumerate(CASES[case]) if n == 0):
        assert got[2][e].abs().max() == 0 and got[4][e].abs().max() == 0, "an empty expert's gradient is exactly 0"


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_fp32_odd_widths_are_padded(activation):
    """Widths whose rows are no multiple of 16 bytes (10 and 6 floats), which
    ``_grouped_mm`` rejects as they are: the backend copies them into padded buffers."""
    x, idx, counts, ps, upstream = make([5, 0, 9], d_model=10, d_ff=6, activation=activation)
    with pytest.raises(RuntimeError, match="16 bytes"):
        torch._grouped_mm(x[idx], ps[0], offs=torch.cumsum(counts, 0, dtype=torch.int32))
    compare(run(grouped_mlp_grouped_mm, x, idx, counts, ps, activation, upstream),
            run(grouped_mlp_torch, x, idx, counts, ps, activation, upstream), FP32_TOL, "odd widths")


def _cuda_group_rule(calls):
    """Wrap ``torch._grouped_mm`` to check, on every call, what CUDA's kernel asserts on the
    device (``GroupMMCommon.cuh``, seen on an H200): where the grouped dimension of an
    operand is its contiguous one, every group's size there is a multiple of 16 bytes."""
    real = torch._grouped_mm

    def checked(a, b, offs=None, **kw):
        sizes = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
        grouped = [(a, -1), (b, 0)] if a.dim() == 2 and b.dim() == 2 else [(a, 0)]
        for t, dim in grouped:
            if t.stride(dim) == 1 and t.shape[dim] > 1:
                bad = [n for n in sizes if n * t.element_size() % 16]
                assert not bad, f"groups of {bad} rows along a contiguous dimension of {tuple(t.shape)}"
        calls.append((a.dim(), b.dim()))
        return real(a, b, offs=offs, **kw)

    return checked


@pytest.mark.parametrize("d_ff", [12, 32])
def test_padded_operands_keep_the_grouped_dimension_strided(monkeypatch, d_ff):
    """bf16 at d_ff 12 (the weight gradient's ``rows.t()`` has a 24-byte stride and is
    copied): the copy keeps the column-major order, so no group boundary falls inside a
    contiguous dimension, and the result still equals the loop's."""
    calls = []
    monkeypatch.setattr(torch, "_grouped_mm", _cuda_group_rule(calls))
    x, idx, counts, ps, upstream = make([5, 0, 9, 3], d_model=16, d_ff=d_ff)
    rounded = lambda t: t.to(torch.bfloat16).float() if t is not None else None  # noqa: E731
    x, upstream, ps = rounded(x), rounded(upstream), [rounded(p) for p in ps]
    got = run(grouped_mlp_grouped_mm, x, idx, counts, ps, "swiglu", upstream, dtype=torch.bfloat16)
    assert (2, 2) in calls and (2, 3) in calls, calls
    compare(got, run(grouped_mlp_torch, x, idx, counts, ps, "swiglu", upstream), BF16_TOL, "bf16 d_ff 12",
            dtype=torch.bfloat16)


@pytest.mark.parametrize("shape,transposed", [((12, 7), True), ((12, 1), True), ((7, 12), False),
                                               ((3, 6, 12), True), ((5, 1), False)])
def test_operand_copies_keep_their_major_order(shape, transposed):
    from lightning_hetermoe.kernels.grouped_mm import _acceptable, _operand

    base = torch.randn(*shape[:-2], shape[-1], shape[-2]).to(torch.bfloat16).transpose(-1, -2) if transposed \
        else torch.randn(*shape).to(torch.bfloat16)
    out = _operand(base)
    assert _acceptable(out) and torch.equal(out, base) and out.shape == base.shape
    assert (out.stride(-2) == 1 and out.stride(-1) != 1) == (base.stride(-2) == 1 and base.stride(-1) != 1)


def test_stride0_upstream_and_no_input_grad():
    """``y.sum().backward()`` (torch's own _grouped_mm derivative fails on it) and an input
    that needs no gradient (the dx GEMM is skipped)."""
    x, idx, counts, ps, _ = make([4, 0, 8])
    got = run(grouped_mlp_grouped_mm, x, idx, counts, ps, "swiglu", None)
    compare(got, run(grouped_mlp_torch, x, idx, counts, ps, "swiglu", None), FP32_TOL, "sum()")
    x, idx, counts, ps, _ = make([4, 0, 8], activation="gelu")
    got = run(grouped_mlp_grouped_mm, x, idx, counts, ps, "gelu", None, x_grad=False)
    want = run(grouped_mlp_torch, x, idx, counts, ps, "gelu", None, x_grad=False)
    assert got[1] is None
    compare(got, want, FP32_TOL, "no dx")


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("case", ["ragged+empty", "one-expert", "no-rows"])
def test_bf16_runs_on_cpu_within_rounding(case, activation):
    """bf16 in, bf16 out and gradients; against fp32 on the same rounded values, held to
    the same bound as the bf16 loop (which is checked here too)."""
    x, idx, counts, ps, upstream = make(CASES[case], activation=activation, d_model=48, d_ff=32)
    rounded = lambda t: t.to(torch.bfloat16).float() if t is not None else None  # noqa: E731
    x, upstream, ps = rounded(x), rounded(upstream), [rounded(p) for p in ps]
    want = run(grouped_mlp_torch, x, idx, counts, ps, activation, upstream)
    got = run(grouped_mlp_grouped_mm, x, idx, counts, ps, activation, upstream, dtype=torch.bfloat16)
    compare(got, want, BF16_TOL, "grouped_mm bf16", dtype=torch.bfloat16)
    loop = run(grouped_mlp_torch, x, idx, counts, ps, activation, upstream, dtype=torch.bfloat16)
    compare(loop, want, BF16_TOL, "loop bf16", dtype=torch.bfloat16)


def test_autocast_casts_like_a_matmul():
    x, idx, counts, ps, upstream = make([6, 0, 10])
    outs = []
    for fn in (grouped_mlp_grouped_mm, grouped_mlp_torch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = run(fn, x, idx, counts, ps, "swiglu", upstream)
        outs.append(got)
    # bf16 like a matmul (and the Triton backend); the loop's fp32 bias add promotes its y.
    assert outs[0][0].dtype == torch.bfloat16
    for name, a, b in zip(NAMES, *outs, strict=True):
        if name != "y":
            assert a.dtype == b.dtype == torch.float32, name  # gradients in the parameters' dtype
        assert rel_err(a, b) <= BF16_TOL, name


def test_traces_under_torch_compile():
    """One opaque op for dynamo: fp32 compiles fullgraph (torch's own fake kernel for
    _grouped_mm admits bf16 only), and output and gradients match eager."""
    x, idx, counts, ps, _ = make([5, 0, 8])

    def f(x, *ps):
        return grouped_mlp_grouped_mm(x, idx, counts, *ps, "swiglu")

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    outs = []
    for fn in (f, compiled):
        xi = x.clone().requires_grad_()
        pi = [p.clone().requires_grad_() for p in ps]
        y = fn(xi, *pi)
        y.square().sum().backward()
        outs.append([y, xi.grad] + [p.grad for p in pi])
    for name, a, b in zip(NAMES, *outs, strict=True):
        assert rel_err(b, a) <= 1e-6, f"compiled {name}"


def test_opcheck_registration():
    from lightning_hetermoe.kernels.grouped_mm import grouped_mm_mlp_op

    x, idx, counts, ps, _ = make([3, 0, 4], n_tokens=5, d_model=8, d_ff=8, activation="gelu")
    ps = [p.requires_grad_() for p in ps]
    torch.library.opcheck(grouped_mm_mlp_op, (x.requires_grad_(), idx, counts, *ps, "gelu", False),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("top_k,activation,bias,capacity_factor", [
    (2, "swiglu", False, 0.0),
    (1, "gelu", True, 0.5),  # capacity drops choices: some experts get few or no rows
])
def test_moe_layer_grouped_mm_backend(top_k, activation, bias, capacity_factor):
    cfg = MoEConfig(num_experts=5, top_k=top_k, d_ff=20, activation=activation, bias=bias,
                    capacity_factor=capacity_factor, jitter_eps=0.0, expert_backend="grouped_mm")
    torch.manual_seed(0)
    layer = MoELayer(24, cfg)
    ref = MoELayer(24, MoEConfig(**{**cfg.__dict__, "expert_backend": "torch"}))
    ref.load_state_dict(layer.state_dict())
    x, upstream = torch.randn(19, 24), torch.randn(19, 24)
    results = []
    for mod in (layer, ref):
        xi = x.clone().requires_grad_()
        y, aux = mod(xi)
        grads = torch.autograd.grad((y * upstream).sum() + aux.balance_loss + aux.z_loss, [xi] + list(mod.parameters()))
        results.append([y] + list(grads))
    names = ["y", "x"] + [n for n, _ in layer.named_parameters()]
    for name, a, b in zip(names, *results, strict=True):
        assert rel_err(a, b) <= FP32_TOL, name


def test_moe_layer_compiles_with_grouped_mm_backend():
    """torch.compile over the whole layer (graph breaks, if any, come from the routing):
    output and gradients match eager."""
    for a, b in zip(*eager_and_compiled("grouped_mm"), strict=True):
        assert rel_err(b, a) <= 1e-6


def test_config_and_explicit_resolution():
    assert MoEConfig(expert_backend="grouped_mm").expert_backend == "grouped_mm"
    assert resolve_backend("grouped_mm", torch.device("cpu")) is kernels.grouped_mlp_grouped_mm
    assert kernels.grouped_mm_available("cpu")
    with pytest.raises(ValueError, match="grouped_mm.*cannot run on meta"):
        resolve_backend("grouped_mm", torch.device("meta"))


# -- auto: what was measured, else the tensor-core rule ---------------------------------------

@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device of a chosen compute capability, as far as backend selection asks,
    and a chosen measured.json; auto's memo starts empty."""
    state = {"capability": (9, 0), "measured": {}}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: state["capability"])
    monkeypatch.setattr(measured, "_LOADED", [state["measured"]])
    monkeypatch.setattr(chooser, "_AUTO", {})
    monkeypatch.setattr(chooser, "_WARNED", set())
    return state


@pytest.mark.parametrize("capability,want", [((7, 0), "torch"), ((7, 5), "torch"), ((8, 0), "triton"),
                                             ((8, 9), "triton"), ((9, 0), "triton")],
                         ids=["V100", "T4", "A100", "L40S", "H100"])
def test_auto_rule_without_measurements(fake_gpu, capability, want):
    """Triton only where it emits tensor-core code (sm80+); explicit triton still resolves
    on sm70/sm75 (without tensor cores)."""
    fake_gpu["capability"] = capability
    cuda = torch.device("cuda", 0)
    assert chooser.auto_backend(cuda) == want
    assert chooser.backend_for("auto", cuda, torch.bfloat16) == want
    if capability >= (8, 0):
        assert resolve_backend("triton", cuda) is kernels.grouped_mlp
    else:  # asked for explicitly it runs, with a warning that it misses the tensor cores
        with pytest.warns(UserWarning, match="runs Triton's dots on the CUDA cores"):
            assert resolve_backend("triton", cuda) is kernels.grouped_mlp
    assert kernels.triton_uses_tensor_cores(cuda) == (capability >= (8, 0))


def test_auto_follows_measurements(fake_gpu, monkeypatch):
    fake_gpu["measured"].update({
        "cuda:sm90": {"best": "grouped_mm"},
        "cuda:sm75": {"best": "triton"},  # measured beats the rule
        "cuda:sm80": {"best": "torch"},
        "cpu": {"best": "triton"},        # never the interpreter: falls back to the rule
    })
    for cap, want in [((9, 0), "grouped_mm"), ((7, 5), "triton"), ((8, 0), "torch"), ((8, 6), "triton")]:
        fake_gpu["capability"] = cap
        assert chooser.auto_backend(torch.device("cuda", 0)) == want, cap
    assert chooser.auto_backend(torch.device("cpu")) == "torch"
    # A measured backend that cannot run here falls back to the rule.
    fake_gpu["capability"] = (9, 0)
    monkeypatch.setattr(chooser, "grouped_mm_available", lambda device: False)
    assert chooser.auto_backend(torch.device("cuda", 0)) == "triton"
    fake_gpu["measured"]["cpu"] = {"best": "grouped_mm"}
    monkeypatch.setattr(chooser, "grouped_mm_available", lambda device: torch.device(device).type == "cpu")
    assert resolve_backend("auto", torch.device("cpu")) is kernels.grouped_mlp_grouped_mm


@pytest.fixture
def cuda_autocast_bf16():
    """CUDA's autocast on in bf16, as Lightning's bf16-mixed sets it (the state alone: a
    CPU build of torch keeps the flag without running CUDA)."""
    was = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", torch.bfloat16)
    yield
    torch.set_autocast_enabled("cuda", was[0])
    torch.set_autocast_dtype("cuda", was[1])


def test_auto_chooses_by_the_dtype_the_gemms_run_in(fake_gpu, cuda_autocast_bf16):
    """Under bf16 autocast fp32 activations multiply in bf16: on sm90, where grouped_mm was
    measured fastest, auto runs it for them (it ran Triton on an H200, 1.25x slower there)."""
    fake_gpu["measured"].update({"cuda:sm90": {"best": "grouped_mm"}})
    cuda = torch.device("cuda", 0)
    assert chooser.compute_dtype(torch.float32, cuda) == torch.bfloat16
    assert chooser.backend_for("auto", cuda, chooser.compute_dtype(torch.float32, cuda)) == "grouped_mm"
    assert not chooser.runs_on_host_counts("auto", cuda, torch.float32)
    torch.set_autocast_enabled("cuda", False)
    assert chooser.compute_dtype(torch.float32, cuda) == torch.float32


@pytest.mark.parametrize("name,dtype,host", [("auto", torch.float32, True), ("triton", torch.float32, True),
                                             ("auto", torch.bfloat16, False), ("triton", torch.bfloat16, False),
                                             ("torch", torch.bfloat16, True), ("grouped_mm", torch.float32, False)])
def test_experts_that_run_the_loop_get_host_counts(fake_gpu, name, dtype, host):
    """Plain fp32 on CUDA (no TF32) runs Triton's fallback, the torch loop: it reads its
    counts on the host, so the experts are handed host counts and the dispatch reads them
    once (on an H200 the loop read device counts in its forward and its backward: 3 host
    syncs per (layer, micro-batch) where the design allows 1)."""
    from lightning_hetermoe.moe.experts import Experts

    fake_gpu["measured"].update({"cuda:sm90": {"best": "grouped_mm"}})
    cuda = torch.device("cuda", 0)
    assert chooser.runs_on_host_counts(name, cuda, dtype) is host
    assert Experts(4, 8, 16, "swiglu", False, backend=name).counts_on_device(cuda, dtype) is not host


def test_shipped_measurements_drive_auto_on_cpu(monkeypatch):
    """measured.json is package data read with importlib.resources; its CPU entry is what
    auto runs on this machine."""
    monkeypatch.setattr(measured, "_LOADED", [])
    monkeypatch.setattr(chooser, "_AUTO", {})
    monkeypatch.setattr(chooser, "_WARNED", set())
    data = measured.load()
    assert "cpu" in data, "bench/expert_kernels.py --write has not recorded this device kind"
    entry = data["cpu"]
    assert entry["best"] in measured.BACKENDS and entry["cases"]
    assert entry["best"] == max(entry["speedup_vs_torch"], key=entry["speedup_vs_torch"].get)
    assert measured.device_kind("cpu") == "cpu"
    want = {"torch": grouped_mlp_torch, "grouped_mm": kernels.grouped_mlp_grouped_mm}[entry["best"]]
    assert resolve_backend("auto", torch.device("cpu")) is want


def test_bench_records_winner_per_device_kind(tmp_path, monkeypatch):
    """bench/expert_kernels.py --write on a tiny grid: every backend timed, the winner recorded
    under this device kind, other kinds kept."""
    bench = load_bench("expert_kernels")
    monkeypatch.setattr(bench, "QUICK_SHAPES", [bench.Case("a", 16, 32, 4, 2, 24), bench.Case("b", 16, 32, 8, 3, 40)])
    out = tmp_path / "measured.json"
    out.write_text(json.dumps({"cuda:sm90": {"best": "triton"}}))
    summary = bench.main(["--quick", "--reps", "1", "--write", str(out)])
    data = json.loads(out.read_text())
    assert data["cuda:sm90"] == {"best": "triton"}
    assert data["cpu"]["best"] == summary["best"] in ("torch", "grouped_mm")
    # transformers' grouped_mm is timed and kept beside them, never a candidate for best
    assert set(data["cpu"]["cases"][0]["ms"]) == {"torch", "grouped_mm", "hf_grouped_mm"}
    assert [c["top_k"] for c in data["cpu"]["cases"]] == [2, 3]
    assert all("loop/grouped_mm" in r for r in summary["results"])


def test_bench_records_a_run_made_on_another_machine(tmp_path, monkeypatch):
    """--record: a lent GPU's bench/gpu.py report (the --json summary of its kernels step)
    becomes that device kind's entry here, with the run's own torch and date; a file with
    no kernels summary is refused, naming it."""
    bench = load_bench("expert_kernels")
    monkeypatch.setattr(bench, "QUICK_SHAPES", [bench.Case("a", 16, 32, 4, 2, 24)])
    summary_path = tmp_path / "kernels.json"
    summary = bench.main(["--quick", "--reps", "1", "--json", str(summary_path)])
    remote = dict(json.loads(summary_path.read_text()), kind="cuda:sm90", torch="2.11.0+cu130", best="grouped_mm")
    report = tmp_path / "h200.json"
    report.write_text(json.dumps({"date": "2026-12-04", "steps": {"kernels": {"result": remote}}}))
    out = tmp_path / "measured.json"
    out.write_text(json.dumps({"cpu": {"best": "torch"}}))
    bench.main(["--record", str(report), "--write", str(out)])
    data = json.loads(out.read_text())
    assert data["cpu"] == {"best": "torch"}
    entry = data["cuda:sm90"]
    assert (entry["best"], entry["torch"], entry["date"]) == ("grouped_mm", "2.11.0+cu130", "2026-12-04")
    assert [c["name"] for c in entry["cases"]] == [r["name"] for r in summary["results"]]
    report.write_text(json.dumps({"date": "2026-12-04", "steps": {"kernels": {"result": None}}}))
    with pytest.raises(SystemExit, match="h200.json: no bench/expert_kernels.py summary"):
        bench.main(["--record", str(report), "--write", str(out)])


@pytest.mark.slow
def test_import_stays_light():
    """``import lightning_hetermoe`` loads neither kernel implementation nor the measurements."""
    probe = ("import sys, lightning_hetermoe; "
             "print(sorted(m for m in sys.modules if m.startswith('lightning_hetermoe.kernels')))")
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout
    loaded = set(eval(out))  # noqa: S307 - our own repr of a list of str
    assert not loaded & {"lightning_hetermoe.kernels.launch", "lightning_hetermoe.kernels.mlp",
                         "lightning_hetermoe.kernels.grouped_mm", "lightning_hetermoe.kernels.measured"}, loaded
