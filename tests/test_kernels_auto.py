"""``expert_backend="auto"`` from the shipped measurements on a GPU kind this machine does not
have: the device's identity is mocked (CUDA present, its compute capability), never the
engine: ``auto_backend`` reads the real ``kernels/measured.json`` and its real rule.

On an H100 (sm90) the shipped entry, from issue #39's bf16 measurement at Mixtral's layer
shape (transformers' grouped_mm path 37.3 ms, this pack's Triton 52.6 ms), makes auto run
``grouped_mm``; a kind with no entry (sm80) falls to the rule (Triton from sm80 up)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_hetermoe import kernels
from lightning_hetermoe.kernels import chooser, measured


@pytest.fixture
def cuda_of(monkeypatch):
    """A CUDA device of a chosen compute capability as backend selection sees it; the
    shipped measurements read afresh, auto's memo empty."""
    state = {"capability": (9, 0)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: state["capability"])
    monkeypatch.setattr(measured, "_LOADED", [])
    monkeypatch.setattr(chooser, "_AUTO", {})
    monkeypatch.setattr(chooser, "_WARNED", set())
    return state


def test_shipped_sm90_entry_is_the_h200_measurement():
    """The sm90 entry is bench/expert_kernels.py's run on an H200 (2026-12-04), at the four real
    models' layer shapes; its winner is consistent with its own figures at every shape and
    beats transformers' grouped_mm path (which was not a candidate) at every shape."""
    entry = measured.load()["cuda:sm90"]
    assert entry["best"] == "grouped_mm" and entry["dtype"] == "bfloat16"
    assert entry["device"] == "NVIDIA H200" and entry["torch"] == "2.11.0+cu130"
    assert [c["name"] for c in entry["cases"]] == ["mixtral_8x7b", "olmoe_1b_7b", "qwen3_30b_a3b", "deepseek_v2_lite"]
    for case in entry["cases"]:
        ours = {k: v for k, v in case["ms"].items() if k != "hf_grouped_mm"}
        assert min(ours, key=ours.get) == "grouped_mm", case["name"]
        assert case["ms"]["grouped_mm"] < case["ms"]["hf_grouped_mm"], case["name"]


def test_auto_on_sm90_runs_grouped_mm(cuda_of):
    cuda = torch.device("cuda", 0)
    assert measured.device_kind(cuda) == "cuda:sm90"
    assert chooser.auto_backend(cuda) == "grouped_mm"
    assert chooser.backend_for("auto", cuda, torch.bfloat16) == "grouped_mm"
    # torch._grouped_mm is sync-free on CUDA for bf16 only: fp16 and fp32 take the rule
    # (Triton; its own fp32 path goes to the torch loop without TF32)
    rule = "triton" if kernels.triton_available(cuda) else "torch"
    assert chooser.backend_for("auto", cuda, torch.float16) == rule
    assert chooser.backend_for("auto", cuda, torch.float32) == rule
    # the function auto hands the layer chooses per call, from the inputs' dtype
    assert chooser.resolve_backend("auto", cuda) is chooser._auto_by_dtype


def test_auto_on_sm80_without_entry_follows_the_rule(cuda_of):
    """No measurement for A100: the rule (Triton where it emits tensor-core code)."""
    cuda_of["capability"] = (8, 0)
    cuda = torch.device("cuda", 0)
    assert "cuda:sm80" not in measured.load()
    assert chooser.auto_backend(cuda) == ("triton" if kernels.triton_available(cuda) else "torch")
    # with triton importable here the rule's answer is Triton
    if kernels.triton_available(cuda):
        assert chooser.backend_for("auto", cuda, torch.bfloat16) == "triton"


def test_auto_on_sm90_falls_back_where_grouped_mm_cannot_run(cuda_of, monkeypatch):
    """A torch without ``_grouped_mm`` on that H100: the measured winner cannot run, the rule decides."""
    monkeypatch.setattr(chooser, "grouped_mm_available", lambda device: False)
    want = "triton" if kernels.triton_available(torch.device("cuda", 0)) else "torch"
    assert chooser.auto_backend(torch.device("cuda", 0)) == want


def test_auto_memo_is_per_device(cuda_of):
    """auto is memoised per device and dtype: cleared here, so each case above saw the file."""
    cuda = torch.device("cuda", 0)
    chooser.backend_for("auto", cuda, torch.bfloat16)
    chooser.backend_for("auto", cuda, torch.float16)
    rule = "triton" if kernels.triton_available(cuda) else "torch"
    assert chooser._AUTO == {"cuda:0:torch.bfloat16": "grouped_mm", "cuda:0:torch.float16": rule}


@pytest.fixture
def rocm_of(cuda_of, monkeypatch):
    """An AMD GPU as a ROCm build of torch shows it: a ``cuda`` device whose capability is
    its gfx version (MI250X, gfx90a: (9, 0), what an H100 reports) and whose properties name
    the arch with its feature flags."""
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")
    props = SimpleNamespace(gcnArchName="gfx90a:sramecc+:xnack-", shared_memory_per_block_optin=64 * 1024)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    return cuda_of


def test_an_amd_gpu_reporting_9_0_is_not_taken_for_an_h100(rocm_of):
    """An MI250X reads as sm90 to a capability test: auto must not hand it the H100's
    measured winner, a sync-free torch._grouped_mm or TMA loads, all NVIDIA's."""
    from lightning_hetermoe.kernels import availability, tuning

    cuda = torch.device("cuda", 0)
    assert torch.cuda.get_device_capability(cuda) == (9, 0)
    assert measured.device_kind(cuda) == "rocm:gfx90a"
    assert measured.measured_backend("rocm:gfx90a") is None  # nothing was measured on AMD
    assert not availability.grouped_mm_sync_free(torch.bfloat16, (9, 0))
    rule = "triton" if kernels.triton_available(cuda) else "torch"
    assert chooser.auto_backend(cuda) == rule
    assert chooser.backend_for("auto", cuda, torch.bfloat16) == rule
    with tuning.tma_loads(True):
        assert not tuning.uses_tma("cuda", (9, 0))
        assert tuning.uses_tma("cpu", None)  # the interpreter still runs them (tests)


def test_the_same_capability_on_nvidia_keeps_the_h100_s_answers(cuda_of):
    """The control: without ROCm the same (9, 0) is an H100 (the shipped entry, sync-free
    bf16 grouped_mm, TMA when asked for)."""
    from lightning_hetermoe.kernels import availability, tuning

    assert torch.version.hip is None, "this torch is a CUDA/CPU build"
    cuda = torch.device("cuda", 0)
    assert measured.device_kind(cuda) == "cuda:sm90"
    assert availability.grouped_mm_sync_free(torch.bfloat16, (9, 0))
    assert chooser.backend_for("auto", cuda, torch.bfloat16) == "grouped_mm"
    with tuning.tma_loads(True):
        assert tuning.uses_tma("cuda", (9, 0))
