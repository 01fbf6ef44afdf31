"""The Triton expert GEMMs' launch order against a GPU's L2 cache: memory traffic, modelled.

    python bench/tile_order.py                       # the four models' MoE layers on an H100
    python bench/tile_order.py --groups 1,4,8,16 --l2-mb 25
    python bench/tile_order.py --quick               # one small layer (seconds)

No GPU is needed, and none is measured: this is a model of the order in which the kernels
of ``kernels/triton_src.py`` launch their programs. Programs run in waves of ``--sms`` (one
program per SM: the Hopper tiles take 128-160 KiB of shared memory each); the programs of
a wave step through their reduction in lockstep, each step reading one block per operand
(a ``BLOCK_M x BLOCK_K`` slice of its row tile and a ``BLOCK_K x BLOCK_N`` slice of its
expert's weight; for the weight gradient, ``BLOCK_M`` rows of both operands); an LRU
cache of ``--l2-mb`` holds blocks and every miss is read from memory. Writes are left out
(every order writes the same bytes). The tiles are the package's own heuristic for the
device generation (``kernels/tuning.default_tile``), the routing even (``tokens * top_k /
experts`` rows per expert).

For each GEMM of the expert MLP's forward and backward (``kernels/algorithm.py``: up, down;
the down weight's gradient, the rows' gradient through the down weight, the up weight's
gradient, the rows' gradient through the up weight) it prints the bytes read with one row
tile launched at a time (``GROUP=1``, the order before grouping) and with each ``--groups``
value, then per order the whole layer's bytes and the time they take at ``--bandwidth``
beside the time its FLOPs take at ``--tflops``: where the first is the larger, the layer is
bound by memory, not by its tensor cores. The last line is one JSON object.

What the GPU itself says about it is ``bench/expert_kernels.py``'s ``triton_group1`` column (the
same kernels at ``GROUP=1``, timed beside the shipped order).
"""

from __future__ import annotations

import argparse
import math
from collections import OrderedDict
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple

import torch

from lightning_hetermoe.kernels import tuning
from lightning_hetermoe.kernels.tiles import DEFAULT_GROUP

ROOT = Path(__file__).resolve().parents[1]

# An H100 SXM: 132 SMs, 50 MB of L2, 3.35 TB/s of HBM3; ~798 TFLOP/s is what a bf16 8192^3
# matmul reached on the card issue #39 measured.
H100 = {"sms": 132, "l2_mb": 50.0, "bandwidth_tbs": 3.35, "tflops": 798.0}


def program_tile(pid: int, m_tiles: int, n_tiles: int, group: int) -> tuple[int, int]:
    """``(row tile, column tile)`` of program ``pid`` in the kernels' launch order: ``group``
    row tiles side by side, their column tiles in turn (``group=1``: one row tile at a time).
    The same arithmetic as ``grouped_gemm_kernel`` and ``grouped_wgrad_kernel``."""
    if group <= 1:
        return pid // n_tiles, pid % n_tiles
    per_group = group * n_tiles
    first = (pid // per_group) * group
    size = min(m_tiles - first, group)
    return first + (pid % per_group) % size, (pid % per_group) // size


class Gemm(NamedTuple):
    """One grouped GEMM of the layer: ``kind`` gemm (rows x [K, N] per expert, row tiles
    over the experts back to back) or wgrad (per expert ``[K, rows] @ [rows, N]``)."""
    name: str
    kind: str
    K: int
    N: int


def layer_gemms(d_model: int, d_ff: int) -> list[Gemm]:
    """The six grouped GEMMs of a SwiGLU expert MLP's forward and backward."""
    h = 2 * d_ff
    return [Gemm("up", "gemm", d_model, h), Gemm("down", "gemm", d_ff, d_model),
            Gemm("dW_down", "wgrad", d_ff, d_model), Gemm("d_act", "gemm", d_model, d_ff),
            Gemm("dW_up", "wgrad", d_model, h), Gemm("d_rows", "gemm", h, d_model)]


def gemm_steps(counts: list[int], g: Gemm, block_m: int, block_n: int, block_k: int, group: int, sms: int,
               elem: int) -> Iterator[list[tuple[tuple, int]]]:
    """The blocks each lockstep step of each wave reads, as ``(key, bytes)``."""
    owner = [e for e, c in enumerate(counts) for _ in range(math.ceil(c / block_m))]
    n_tiles = math.ceil(g.N / block_n)
    # the launch bound cdiv(M, BLOCK_M) + E, as launch.gemm_grid; surplus tiles exit at once
    m_tiles = math.ceil(sum(counts) / block_m) + len(counts)
    order = [program_tile(pid, m_tiles, n_tiles, group) for pid in range(m_tiles * n_tiles)]
    order = [(m, n) for m, n in order if m < len(owner)]
    a_bytes, b_bytes = block_m * block_k * elem, block_k * block_n * elem
    for w0 in range(0, len(order), sms):
        wave = order[w0:w0 + sms]
        for k in range(math.ceil(g.K / block_k)):
            yield [(("a", m, k), a_bytes) for m, _ in wave] + [(("w", owner[m], k, n), b_bytes) for m, n in wave]


def wgrad_steps(counts: list[int], g: Gemm, block_m: int, block_n: int, block_k: int, group: int, sms: int,
                elem: int) -> Iterator[list[tuple[tuple, int]]]:
    k_tiles, n_tiles = math.ceil(g.K / block_k), math.ceil(g.N / block_n)
    order = [(e, *program_tile(pid, k_tiles, n_tiles, group)) for e in range(len(counts))
             for pid in range(k_tiles * n_tiles)]
    x_bytes, dy_bytes = block_m * block_k * elem, block_m * block_n * elem
    for w0 in range(0, len(order), sms):
        wave = order[w0:w0 + sms]
        for r in range(max(math.ceil(counts[e] / block_m) for e, _, _ in wave)):
            live = [(e, k, n) for e, k, n in wave if r * block_m < counts[e]]
            yield [(("x", e, r, k), x_bytes) for e, k, _ in live] + [(("dy", e, r, n), dy_bytes) for e, _, n in live]


def bytes_read(steps: Iterable[list[tuple[tuple, int]]], capacity: float) -> int:
    """Bytes missed by an LRU cache of ``capacity`` bytes over the blocks read, in order."""
    cache: OrderedDict[tuple, int] = OrderedDict()
    held = read = 0
    for step in steps:
        for key, size in step:
            if key in cache:
                cache.move_to_end(key)
                continue
            read += size
            cache[key] = size
            held += size
            while held > capacity:
                held -= cache.popitem(last=False)[1]
    return read


def gemm_bytes(counts: list[int], g: Gemm, group: int, capability: tuple[int, int], dtype: torch.dtype,
               sms: int, l2_bytes: float) -> int:
    rows = sum(counts)
    tile = tuning.default_tile(capability, dtype, g.kind, tuning.m_bucket(rows))
    elem = torch.empty(0, dtype=dtype).element_size()
    make = gemm_steps if g.kind == "gemm" else wgrad_steps
    return bytes_read(make(counts, g, tile.block_m, tile.block_n, tile.block_k, group, sms, elem), l2_bytes)


def layer_flops(rows: int, d_model: int, d_ff: int) -> float:
    """The six GEMMs: forward 2 * rows * d * 3f, backward twice that."""
    return 3 * 2 * rows * d_model * 3 * d_ff


def model_layer(case, groups: list[int], device: dict, capability=(9, 0), dtype=torch.bfloat16) -> dict:
    rows = case.tokens * case.top_k
    counts = [rows // case.experts + (1 if e < rows % case.experts else 0) for e in range(case.experts)]
    out = {"name": case.name, "d_model": case.d_model, "d_ff": case.d_ff, "experts": case.experts,
           "top_k": case.top_k, "tokens": case.tokens, "gemms": {}, "orders": {}}
    compute_ms = layer_flops(rows, case.d_model, case.d_ff) / (device["tflops"] * 1e12) * 1e3
    for g in layer_gemms(case.d_model, case.d_ff):
        out["gemms"][g.name] = {str(grp): gemm_bytes(counts, g, grp, capability, dtype, device["sms"],
                                                     device["l2_mb"] * 2**20) for grp in groups}
    for grp in groups:
        total = sum(v[str(grp)] for v in out["gemms"].values())
        memory_ms = total / (device["bandwidth_tbs"] * 1e12) * 1e3
        out["orders"][str(grp)] = {"bytes": total, "memory_ms": round(memory_ms, 3), "compute_ms": round(compute_ms, 3),
                                   "bound": "memory" if memory_ms > compute_ms else "compute"}
    return out


def print_layer(r: dict, groups: list[int]) -> None:
    print(f"\n{r['name']}: d {r['d_model']}, f {r['d_ff']}, {r['experts']} experts, top-{r['top_k']}, "
          f"{r['tokens']} tokens")
    print(f"  {'GEMM':8} " + " ".join(f"{'GROUP=' + str(g) + ' MB':>13}" for g in groups)
          + f" {'GROUP=1 / GROUP=' + str(groups[-1]):>18}")
    for name, by in r["gemms"].items():
        ratio = by[str(groups[0])] / max(by[str(groups[-1])], 1)
        print(f"  {name:8} " + " ".join(f"{by[str(g)] / 1e6:>13.1f}" for g in groups) + f" {ratio:>17.2f}x")
    for g in groups:
        o = r["orders"][str(g)]
        print(f"  GROUP={g}: {o['bytes'] / 1e6:.1f} MB read, {o['memory_ms']:.3f} ms of memory beside "
              f"{o['compute_ms']:.3f} ms of tensor cores: {o['bound']}-bound")


def kernels_bench():
    """``bench/expert_kernels.py`` as a module (loaded by path: ``bench/`` is no package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_kernels", ROOT / "bench" / "expert_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", default=f"1,{DEFAULT_GROUP}",
                    help=f"launch orders to compare (row tiles side by side; default 1 and the shipped "
                         f"{DEFAULT_GROUP})")
    ap.add_argument("--sms", type=int, default=H100["sms"], help="programs running at once")
    ap.add_argument("--l2-mb", type=float, default=H100["l2_mb"], help="the L2 cache, MiB")
    ap.add_argument("--bandwidth", type=float, default=H100["bandwidth_tbs"], help="memory bandwidth, TB/s")
    ap.add_argument("--tflops", type=float, default=H100["tflops"], help="dense bf16 GEMM throughput, TFLOP/s")
    ap.add_argument("--quick", action="store_true", help="one small layer (the tests' case)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the summary here")
    args = ap.parse_args(argv)
    groups = [int(g) for g in args.groups.split(",")]
    if not groups or any(g < 1 for g in groups):
        ap.error(f"--groups={args.groups!r} is invalid: comma-separated integers >= 1")
    layers = kernels_bench()  # bench/expert_kernels.py's four layers
    cases = layers.QUICK_SHAPES[:1] if args.quick else layers.model_cases()
    device = {"sms": args.sms, "l2_mb": args.l2_mb, "bandwidth_tbs": args.bandwidth, "tflops": args.tflops}
    print(f"# modelled, not measured: {args.sms} programs at once, {args.l2_mb:g} MiB LRU L2, "
          f"{args.bandwidth:g} TB/s, {args.tflops:g} TFLOP/s; sm90 bf16 tiles (kernels/tuning.py); even routing")
    results = []
    for case in cases:
        results.append(model_layer(case, groups, device))
        print_layer(results[-1], groups)
    summary = {"bench": "tile_order", "modelled": True, "device": device, "groups": groups, "layers": results,
               "bytes_ratio": {r["name"]: r["orders"][str(groups[0])]["bytes"] / r["orders"][str(groups[-1])]["bytes"]
                               for r in results}}
    return layers.emit(summary, args.json)


if __name__ == "__main__":
    main()
