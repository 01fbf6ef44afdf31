"""When Triton's interpreter can run the kernels on the CPU, and what it says when it cannot.

Triton before 3.7 hands a kernel's scalar arguments to its interpreter as 1-element numpy
arrays and takes their index with ``int()``, which numpy 2.4 refuses: every loop over a
runtime bound fails with a bare TypeError (triton 3.6 is what torch 2.11 pins). The kernels
are then reported unavailable on the CPU, with the fix, instead."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import numpy  # noqa: E402

from lightning_hetermoe.kernels import availability, launch  # noqa: E402
from lightning_hetermoe.moe import resolve_backend  # noqa: E402

FIX = "install triton>=3.7 or numpy<2.4"


@pytest.fixture
def versions(monkeypatch):
    """``versions(triton, numpy)``: the versions the availability check reads, memo emptied."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")

    def set_to(triton_version: str, numpy_version: str) -> str:
        monkeypatch.setattr(triton, "__version__", triton_version)
        monkeypatch.setattr(numpy, "__version__", numpy_version)
        monkeypatch.setattr(availability, "_INTERPRETER_ERROR", [])
        return availability.unavailable_reason("cpu")

    return set_to


@pytest.mark.parametrize("triton_version,numpy_version,broken", [
    ("3.6.0", "2.4.6", True), ("3.0.0", "2.4.0", True), ("3.6.0", "2.3.5", False), ("3.7.0", "2.4.6", False),
    ("3.9.0+git1a2b3c", "2.5.0.dev0", False), ("3.3.1", "1.26.4", False)])
def test_the_interpreter_is_unavailable_only_on_the_broken_pairs(versions, triton_version, numpy_version, broken):
    why = versions(triton_version, numpy_version)
    assert bool(why) == broken, why
    if broken:
        assert triton_version in why and numpy_version in why and FIX in why


def test_asking_for_triton_on_the_cpu_names_the_fix(versions):
    versions("3.6.0", "2.4.6")
    with pytest.raises(ValueError, match=f"expert_backend='triton' cannot run on cpu: .*{FIX}"):
        resolve_backend("triton", torch.device("cpu"))


def test_the_rule_matches_what_this_environment_does(monkeypatch):
    """The installed pair, for real: a kernel with a loop over a runtime bound (the row tile
    map) runs through the interpreter exactly where the check says the interpreter can."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(availability, "_INTERPRETER_ERROR", [])
    why = availability.unavailable_reason("cpu")
    counts = torch.tensor([3, 0, 17, 1])
    try:
        tile_expert, tile_first = launch.RowTiles(counts).map(16, int(counts.sum()))
    except Exception as err:  # triton.runtime.errors.InterpreterError
        assert why and "0-dimensional" in str(err), (why, err)
    else:
        assert why == "", why
        assert tile_first.tolist() == [0, 1, 1, 3]
        assert tile_expert.tolist()[:4] == [0, 2, 2, 3]
