"""``bench/expert_kernels.py``: its columns compute the same thing, and its table has the shape the
GPU run reads (not how long anything took).

Every column of a case (the pack's loop, grouped_mm and Triton backends, transformers'
``MixtralExperts`` on grouped_mm and eager) takes the same weights and the same routing
(the same top-k choices and weights), so outputs and gradients (input and both expert
weights) must agree. Tolerance fp32 1e-5, as max |a - b| / max |b|: the products are the
same but summed in other orders (grouped vs per-expert GEMMs, index_add vs a [T, k] sum,
Triton's tiles), a few fp32 ulps (1.2e-7) of the largest entry per step over ~4 steps;
a wrong layout or a lost weight is an error of order 1.
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers_bench import load_bench
from lightning_hetermoe.kernels import triton_available

TOL = 1e-5
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bench():
    return load_bench("expert_kernels")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("top_k,experts", [(2, 5), (3, 16)])
def test_every_column_computes_the_same(bench, monkeypatch, top_k, experts):
    """On one tiny case (ragged groups; at 16 experts some get no row), every column's
    output and gradients equal the loop backend's at identical routing; Triton through
    its interpreter where triton is installed and its interpreter runs here."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    case = bench.Case("tiny", 24, 20, experts, top_k, 11)
    prob = bench.make_problem(case, torch.float32, torch.device("cpu"))
    assert (experts < 16) or (prob.counts == 0).any()
    upstream = torch.randn(case.tokens, case.d_model, generator=torch.Generator().manual_seed(1))
    kinds = ["grouped_mm", "hf_grouped_mm", "hf_eager"]
    if triton_available("cpu"):
        kinds.append("triton")
    kinds += [k for k, ab in bench.ABLATIONS.items() if ab.base in kinds]
    want = bench.case_outputs("loop", prob, upstream)
    # the loop against a naive per-token reference: each token through its k experts
    y = torch.zeros(case.tokens, case.d_model)
    for t in range(case.tokens):
        for j in range(top_k):
            e = prob.choice[t, j]
            gate, up = (prob.x[t] @ prob.w_up[e]).detach().chunk(2)
            y[t] += prob.weights[t, j] * ((torch.nn.functional.silu(gate) * up) @ prob.w_down[e]).detach()
    assert rel_err(want["y"], y) <= TOL
    for kind in kinds:
        got = bench.case_outputs(kind, prob, upstream)
        for name in ("y", "x", "w_up", "w_down"):
            assert rel_err(got[name], want[name]) <= TOL, (kind, name, rel_err(got[name], want[name]))


def test_model_cases_come_from_the_model_configs(bench):
    """The four layer shapes, as conf/model/*.yaml defines the models (top-k per case)."""
    got = {c.name: c[1:] for c in bench.model_cases()}
    assert got == {"mixtral_8x7b": (4096, 14336, 8, 2, 8192), "olmoe_1b_7b": (2048, 1024, 64, 8, 8192),
                   "qwen3_30b_a3b": (2048, 768, 128, 8, 8192), "deepseek_v2_lite": (2048, 1408, 64, 6, 8192)}
    # the quick cases are small cases of the same kinds: expert count and top-k as theirs
    assert [(c.experts, c.top_k) for c in bench.QUICK_SHAPES] == [(c.experts, c.top_k) for c in bench.model_cases()]


def test_flops_of_the_expert_gemms(bench):
    """6 * tokens * top_k * d * f * 3: at Mixtral's shape and 37.3 ms, the issue's 464 TFLOP/s."""
    f = bench.flops(8192 * 2, 4096, 14336)
    assert f == 6 * 8192 * 2 * 4096 * 14336 * 3
    assert round(f / 37.3e-3 / 1e12) == 464


def test_quick_table_and_json(bench, monkeypatch, tmp_path):
    """--quick --json on one tiny case: every column timed, the ratios and the contender's
    column present, the file the same object as the JSON line."""
    monkeypatch.setattr(bench, "QUICK_SHAPES", [bench.Case("tiny", 16, 8, 4, 2, 24)])
    out = tmp_path / "kernels.json"
    summary = bench.main(["--quick", "--reps", "1", "--passes", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(summary))
    assert summary["columns"] == ["grouped_mm", "loop", "hf_grouped_mm", "dense"]
    row = summary["results"][0]
    assert row["top_k"] == 2 and row["rows"] == 48
    for key in ("hf_grouped_mm_ms", "hf_grouped_mm_tflops", "hf_grouped_mm/dense", "loop/hf_grouped_mm",
                "grouped_mm/dense", "fastest/hf_grouped_mm"):
        assert key in row, key
    assert row["fastest"] in ("torch", "grouped_mm")


def test_ablations_are_ratios_beside_their_backend_never_the_fastest(bench):
    """An ablation column (e.g. GROUP=1) is set against the backend it takes apart and never
    counts as a backend, however fast."""
    case = bench.Case("c", 64, 128, 4, 2, 100)
    kinds = ["triton", "grouped_mm", *bench.ABLATIONS, "loop"]
    secs = {"triton": 2.0, "grouped_mm": 3.0, "triton_group1": 1.0, "grouped_mm_unfused": 4.5, "triton_tma": 1.6,
            "loop": 5.0}
    row = bench.case_row(case, secs, {}, kinds, 2)
    assert row["triton_group1/triton"] == 0.5 and row["grouped_mm_unfused/grouped_mm"] == 1.5
    assert row["triton_tma/triton"] == 0.8
    assert row["fastest"] == "triton"
    assert set(bench.summarise([row], kinds)) == {"triton", "grouped_mm", "torch"}
