"""``bench/tile_order.py``: the kernels' launch order, mirrored, and the L2 model it runs.

The order itself is the kernels' (``grouped_gemm_kernel``, ``grouped_wgrad_kernel``); the
interpreter tests show every ``GROUP`` computes the same tiles (``test_kernels.py``), and
the compile test that ``GROUP`` reaches the compiled kernel. Here: the mirror launches
every tile once, and the cache model counts by hand on small cases.
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers_bench import load_bench



@pytest.fixture(scope="module")
def order():
    return load_bench("tile_order")


@pytest.mark.parametrize("m_tiles,n_tiles", [(1, 1), (7, 3), (16, 5), (9, 224), (3, 1)])
@pytest.mark.parametrize("group", [1, 2, 3, 8, 64])
def test_every_tile_is_launched_once(order, m_tiles, n_tiles, group):
    tiles = [order.program_tile(pid, m_tiles, n_tiles, group) for pid in range(m_tiles * n_tiles)]
    assert sorted(tiles) == [(m, n) for m in range(m_tiles) for n in range(n_tiles)]
    if group == 1:  # one row tile at a time: its column tiles in turn
        assert tiles == [(m, n) for m in range(m_tiles) for n in range(n_tiles)]
    if group >= m_tiles:  # every row tile side by side: one column tile at a time
        assert tiles == [(m, n) for n in range(n_tiles) for m in range(m_tiles)]


def test_groups_run_their_rows_side_by_side(order):
    # 5 row tiles in groups of 2, 3 column tiles: (0,1) x 3 columns, then (2,3), then the short group 4
    got = [order.program_tile(pid, 5, 3, 2) for pid in range(15)]
    assert got == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2), (2, 0), (3, 0), (2, 1), (3, 1), (2, 2), (3, 2),
                   (4, 0), (4, 1), (4, 2)]


def test_lru_counts_misses_by_hand(order):
    a, b, c = (("a",), 10), (("b",), 20), (("c",), 30)
    steps = [[a, b], [a, c], [b]]
    assert order.bytes_read(steps, capacity=1000) == 60  # each block once
    # 30 bytes: a, b (30 held); a hit; c evicts b (LRU), then a -> 40 > 30 evicts a; b missed again
    assert order.bytes_read(steps, capacity=30) == 10 + 20 + 30 + 20
    assert order.bytes_read(steps, capacity=0) == 10 + 20 + 10 + 30 + 20


def test_a_cache_that_holds_everything_reads_each_operand_once_in_any_order(order):
    """Operand blocks are read exactly once with an unbounded cache: the rows' blocks and
    every expert's weight, by hand from the tile (dimensions multiples of it)."""
    from lightning_hetermoe.kernels import tuning

    counts, K, N = [256, 128, 0, 384], 256, 512
    rows = sum(counts)
    for kind in ("gemm", "wgrad"):
        g = order.Gemm("g", kind, K, N)
        t = tuning.default_tile((9, 0), torch.bfloat16, kind, tuning.m_bucket(rows))
        assert rows % t.block_m == 0 and K % t.block_k == 0 and N % t.block_n == 0
        if kind == "gemm":  # the rows [M, K] and the weights of the experts with rows [K, N]
            want = 2 * (rows * K + sum(1 for c in counts if c) * K * N)
        else:  # x^T [K, M] and dy [M, N]
            want = 2 * (rows * K + rows * N)
        for group in (1, 2, 8):
            assert order.gemm_bytes(counts, g, group, (9, 0), torch.bfloat16, sms=4, l2_bytes=float("inf")) == want


def test_grouping_reads_less_where_the_weights_do_not_fit(order):
    """One expert whose weight is 16x the cache: one row tile at a time reads it once per
    row tile, row tiles side by side share it."""
    counts, K, N = [1024], 512, 2048  # 8 row tiles of 128, 16 column tiles; the weight 2 MiB
    g = order.Gemm("up", "gemm", K, N)
    one = order.gemm_bytes(counts, g, 1, (9, 0), torch.bfloat16, sms=16, l2_bytes=2**17)
    eight = order.gemm_bytes(counts, g, 8, (9, 0), torch.bfloat16, sms=16, l2_bytes=2**17)
    weight, rows = 2 * K * N, 2 * sum(counts) * K
    assert one >= 8 * weight  # the whole weight for each of the 8 row tiles
    assert rows + weight <= eight < one / 2


def test_quick_run_prints_and_writes_the_same_summary(order, tmp_path, capsys):
    out = tmp_path / "order.json"
    summary = order.main(["--quick", "--groups", "1,4", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(summary))
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(json.dumps(summary))
    layer = summary["layers"][0]
    assert set(layer["gemms"]) == {"up", "down", "dW_down", "d_act", "dW_up", "d_rows"}
    assert layer["orders"]["1"]["bytes"] == sum(v["1"] for v in layer["gemms"].values())
    with pytest.raises(SystemExit):
        order.main(["--quick", "--groups", "0"])
