"""The suite's own rules: the quick loop starts no process (``conftest.py``); the ranks the
harness forks start from a server that imported everything once and froze it (``harness.py``)."""

import os
import subprocess
import sys

import pytest


def test_a_quick_test_that_starts_a_process_is_told_to_mark_itself_slow():
    with pytest.raises(AssertionError, match=r"test_suite_rules\.py.* starts a process \(subprocess\): mark it "
                                             r"@pytest\.mark\.slow"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.mark.slow
def test_a_slow_test_starts_processes_freely():
    assert subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True,
                          check=True).stdout.strip() == "42"


def what_a_rank_inherited(rank: int) -> tuple[list[str], int, str | None]:
    import gc

    preloads = ["lightning", "lightning_hetermoe", "omegaconf", "reference", "helpers_zebra", "preload_end"]
    return [m for m in preloads if m in sys.modules], gc.get_freeze_count(), os.environ.get("PYTHONPATH")


@pytest.mark.slow
def test_a_rank_starts_with_every_preload_imported_and_frozen_out_of_its_collections():
    """Every preload reached the fork server (the tests' own modules too, which a bare server
    path misses), and what it imported is frozen: a rank's full collections walk only what
    the rank allocated (unfrozen, each rank's first one walked ~450,000 inherited objects)."""
    from harness import run_ranks

    (imported, frozen, path), = run_ranks(1, what_a_rank_inherited)
    assert imported == ["lightning", "lightning_hetermoe", "omegaconf", "reference", "helpers_zebra", "preload_end"], \
        imported
    assert frozen > 100_000, frozen
    assert path == os.environ.get("PYTHONPATH"), "a rank's environment is its caller's, not the server's"
