"""Fixtures shared by the test modules. Plain helpers live beside them: the naive
reference and its builders in ``reference.py``, real multi-process runs in ``harness.py``,
the rest in ``helpers_*.py``; no test module imports another."""

from __future__ import annotations

import compileall
import os
from pathlib import Path

import pytest

from helpers_clock import VirtualClock


ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    """Byte-compile the checkout's own code once, before any test starts a process: most of
    the suite's time is processes it starts (gloo ranks, recipes), each importing the pack
    and its recipes anew, and where ``PYTHONDONTWRITEBYTECODE`` is set (as on the machines
    the suite is timed on) no import leaves a ``.pyc`` behind, so every process compiled
    ~29,000 lines again (1.5-2 s of CPU each). Python still reads a ``.pyc`` it finds, and
    checks it against the source's timestamp; the installed packages got theirs from pip."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        _a_share_of_the_cores()
        return  # the controller compiled them before starting the workers
    for folder in ("lightning_hetermoe", "kernels", "recipes", "tests", "bench"):
        compileall.compile_dir(ROOT / folder, quiet=1, workers=1)


def _a_share_of_the_cores() -> None:
    """A worker computes in its own process beside the others: at torch's default (a thread
    per core) the workers' OpenMP teams outnumber the cores and spin waiting on each other
    (the quick loop ran 5% longer on 2 cores). Each takes its share; the ranks and recipes
    a test starts set their own."""
    import torch

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@pytest.fixture
def virtual_clock(monkeypatch):
    """``virtual_clock(module, ...)``: a :class:`VirtualClock` standing in for those
    modules' ``time`` for the test's duration."""

    def install(*modules) -> VirtualClock:
        clock = VirtualClock()
        for module in modules:
            monkeypatch.setattr(module, "time", clock)
        return clock

    return install


@pytest.fixture
def triton_interpreter(monkeypatch):
    """Triton's interpreter on for the test (``TRITON_INTERPRET=1``, per test: other modules
    keep seeing the kernels as unavailable on CPU); skipped, with the reason, where triton is
    missing or its interpreter cannot run in this environment."""
    pytest.importorskip("triton")
    from lightning_hetermoe.kernels.availability import unavailable_reason

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    why = unavailable_reason("cpu")
    if why:
        pytest.skip(why)


@pytest.fixture(autouse=True)
def on_the_standin(request, monkeypatch):
    """``@pytest.mark.standin``: the test's ranks compute on the stand-in device
    (``lightning_hetermoe/standin.py``; the harness forwards ``HETERMOE_STANDIN`` to every
    rank and fails the run if a rank never computed there), so its assertions hold where
    device traffic is not host memory, as on a GPU."""
    if request.node.get_closest_marker("standin") is not None:
        from lightning_hetermoe import standin

        monkeypatch.setenv(standin.ENV, "1")


@pytest.fixture(autouse=True)
def quick_tests_start_no_process(request, monkeypatch):
    """The quick loop (``-m "not slow"``) is the tests that start no process: one that does
    (gloo ranks, a recipe, a compiler's subprocess) fails here, naming the mark it lacks."""
    if request.node.get_closest_marker("slow") is not None:
        return
    import subprocess

    import torch.multiprocessing as torch_mp

    def refuse(what):
        def start(*args, **kwargs):
            raise AssertionError(f"{request.node.nodeid} starts a process ({what}): mark it @pytest.mark.slow")
        return start

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse("subprocess"))
    monkeypatch.setattr(torch_mp, "start_processes", refuse("torch.multiprocessing"))
    import multiprocessing.process

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse("multiprocessing"))
