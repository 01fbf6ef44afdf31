"""The device collectives run on every torch the project supports (>= 2.4): torch 2.12 named
the single-tensor ones ``all_gather_single`` and ``reduce_scatter_single``, and every torch
before it has them only as ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` (the
GPU machines' image runs torch 2.11). Data-centric training goes through them."""

from __future__ import annotations

import warnings

import pytest
import torch

from harness import run_ranks


def gathered_and_scattered(rank: int, world: int, before_the_rename: bool) -> dict:
    import torch.distributed as dist

    from lightning_hetermoe import comm

    if before_the_rename:  # this process's torch as torch 2.11 has it
        for name in ("all_gather_single", "reduce_scatter_single"):
            if hasattr(dist, name):
                delattr(dist, name)
    dist.init_process_group("gloo")
    comm.configure(torch.device("cpu"))
    group = comm.world()
    out = torch.empty(world * 2)
    comm.all_gather_into(group, out, torch.full((2,), float(rank + 1)), what="test.gather")
    pending = torch.empty(world * 2)
    comm.all_gather_into(group, pending, torch.full((2,), float(10 * rank)), what="test.gather_async",
                         async_op=True).wait()
    mine = torch.empty(2)
    comm.reduce_scatter(group, mine, torch.arange(world * 2, dtype=torch.float32) * (rank + 1), what="test.scatter")
    comm.forget()
    return {"gathered": out.tolist(), "async": pending.tolist(), "scattered": mine.tolist(),
            "renamed_here": hasattr(dist, "all_gather_single")}


@pytest.mark.slow
@pytest.mark.parametrize("before_the_rename", [False, True], ids=["torch-2.12-names", "torch-2.11-names"])
def test_gather_and_reduce_scatter_under_either_name(before_the_rename):
    got = run_ranks(2, gathered_and_scattered, 2, before_the_rename)
    for rank, r in enumerate(got):
        assert r["gathered"] == [1.0, 1.0, 2.0, 2.0] and r["async"] == [0.0, 0.0, 10.0, 10.0]
        # the sum over ranks of arange(4) * (rank + 1) is arange(4) * 3; rank r keeps its two
        assert r["scattered"] == [3.0 * (2 * rank), 3.0 * (2 * rank + 1)]
        if before_the_rename:
            assert not r["renamed_here"]


def test_the_new_name_is_taken_where_torch_has_it_and_no_deprecation_is_raised():
    import torch.distributed as dist

    from lightning_hetermoe.comm import _single

    if not hasattr(dist, "all_gather_single"):
        pytest.skip("this torch predates the rename")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _single("all_gather_single", "all_gather_into_tensor") is dist.all_gather_single
        assert _single("reduce_scatter_single", "reduce_scatter_tensor") is dist.reduce_scatter_single
