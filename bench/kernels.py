"""Forward+backward of the MoE expert MLP on every expert backend, side by side.

- ``loop``:       ``grouped_mlp_torch``, one torch matmul per expert (``expert_backend=torch``).
- ``grouped_mm``: PyTorch's grouped GEMM, ``torch._grouped_mm`` (``expert_backend=grouped_mm``).
- ``triton``:     the gather-GEMM Triton kernels (``expert_backend=triton``); CUDA only.
- ``dense``:      one dense MLP over all M routed rows with a single expert's weights: the
                  same FLOPs as one large GEMM with no grouping, i.e. the ceiling; CUDA only
                  (``--dense`` adds it on CPU).

Each case (a number of experts and of tokens, top-2 routing, SwiGLU) times every backend
in one run, interleaved rep by rep so that drift in the machine's load hits all alike
(the median of CUDA event times; on CPU the minimum, as load only adds), and prints
milliseconds and ratios: ``loop/X`` is how many times faster than the per-expert loop
backend X runs (> 1: faster), ``X/dense`` the fraction of the dense GEMM's throughput it
reaches. Then one JSON line.

``--write`` records the fastest backend for this kind of device (``cpu``, ``cuda:sm90``,
...; the geometric mean over the cases of its time relative to the loop decides) in
``kernels/measured.json``, which ships in the package and which ``expert_backend=auto``
follows; entries of other device kinds are kept.

    python bench/kernels.py                # CPU: small grid; CUDA: Mixtral-like shapes
    python bench/kernels.py --write        # ... and record the winner for this device kind
    python bench/kernels.py --quick        # small shapes anywhere
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import time
from pathlib import Path

import torch

from lightning_hetermoe.kernels import grouped_mlp, grouped_mlp_grouped_mm, grouped_mm_available, triton_available
from lightning_hetermoe.kernels.measured import FILE, device_kind
from lightning_hetermoe.moe.experts import grouped_mlp_torch

MEASURED = Path(__file__).resolve().parents[1] / "kernels" / FILE
TOP_K = 2
# bench column -> expert_backend value (dense is a ceiling, not a backend)
BACKEND_OF = {"loop": "torch", "grouped_mm": "grouped_mm", "triton": "triton"}

# (d_model, d_ff, experts, tokens); d_ff = 3.5 * d_model as in Mixtral, top-2.
CUDA_SHAPES = [
    (1024, 3584, 8, 4096),
    (1024, 3584, 64, 65536),
    (2048, 7168, 16, 16384),
    (2048, 7168, 32, 32768),
    (2048, 7168, 64, 65536),
    (4096, 14336, 8, 16384),
    (4096, 14336, 8, 65536),
]
# CPU: one layer width, a grid of expert and token counts (few rows per expert up to many).
CPU_SHAPES = [(256, 512, e, t) for e in (4, 16, 64) for t in (256, 2048, 8192)]
QUICK_SHAPES = [(64, 224, 8, 512), (128, 448, 8, 1024), (128, 448, 32, 2048)]


def routed_rows(tokens: int, experts: int, top_k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform random top-k routing, grouped by expert the way the dispatcher does it."""
    choice = torch.rand(tokens, experts, device=device).topk(top_k, dim=1).indices.reshape(-1)
    order = torch.argsort(choice, stable=True)
    return order // top_k, torch.bincount(choice, minlength=experts)


def make_problem(d_model, d_ff, experts, tokens, dtype, device, top_k=TOP_K):
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, d_model, device=device, dtype=dtype, generator=g).requires_grad_()
    w_up = (torch.randn(experts, d_model, 2 * d_ff, device=device, dtype=dtype, generator=g) / d_model ** 0.5)
    w_down = (torch.randn(experts, d_ff, d_model, device=device, dtype=dtype, generator=g) / d_ff ** 0.5)
    torch.manual_seed(0)
    idx, counts = routed_rows(tokens, experts, top_k, device)
    return x, idx, counts, w_up.requires_grad_(), w_down.requires_grad_()


def flops(rows: int, d_model: int, d_ff: int) -> float:
    # Up (2*d_ff wide, SwiGLU) and down GEMMs; backward is twice the forward.
    return 3 * 2 * rows * (d_model * 2 * d_ff + d_ff * d_model)


def step_fn(kind, x, idx, counts, w_up, w_down):
    if kind == "dense":
        xs = x.detach().index_select(0, idx).requires_grad_()
        wu, wd = w_up[0].detach().requires_grad_(), w_down[0].detach().requires_grad_()

        def run():
            h = xs @ wu
            gate, up = h.chunk(2, dim=-1)
            y = (torch.nn.functional.silu(gate) * up) @ wd
            y.backward(torch.ones_like(y))
        return run
    fn = {"triton": grouped_mlp, "grouped_mm": grouped_mlp_grouped_mm, "loop": grouped_mlp_torch}[kind]
    # The torch loop reads counts on the host; the others take them on the device.
    c = counts.cpu() if kind == "loop" else counts

    def run():
        y = fn(x, idx, c, w_up, None, w_down, None, "swiglu")
        y.backward(torch.ones_like(y))
    return run


def _once(run, device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def time_case(runs: dict, device, reps: int, warmup: int) -> dict:
    """Seconds of each of ``reps`` calls per run, after ``warmup`` calls each (the first
    Triton calls also autotune), the runs interleaved rep by rep."""
    for run in runs.values():
        for _ in range(warmup):
            run()
    times = {k: [] for k in runs}
    for _ in range(reps):
        for k, run in runs.items():
            times[k].append(_once(run, device))
    return times


def peak_extra_bytes(run, device) -> int | None:
    """Peak memory a fwd+bwd allocates on top of what already exists (CUDA only)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(device) - base


def ideal_extra_bytes(tokens, rows, d_model, d_ff, experts, elem) -> int:
    """What fwd+bwd cannot avoid holding at once at its peak (start of backward): the output
    and its gradient [M, d], the saved pre-activation [M, 2f], the hidden gradient [M, 2f],
    dx [T, d] and both weight gradients. Everything else is scratch a fused design reuses."""
    return elem * (2 * rows * d_model + 2 * rows * 2 * d_ff + tokens * d_model + experts * 3 * d_model * d_ff)


def bench_shapes(shapes, dtype, device, reps, passes, kinds) -> list[dict]:
    """Time every backend on every case. The grid is swept ``passes`` times (each pass
    rebuilds the same seeded problem, so only one case is in memory at a time), so that a
    burst of load on the machine hits every backend alike and no case entirely. Per case
    and backend: the median of CUDA event times; on CPU the minimum, as other load only
    ever adds time."""
    times = [{k: [] for k in kinds} for _ in shapes]
    peaks = [{} for _ in shapes]
    for p in range(passes):
        if passes > 1:
            print(f"# pass {p + 1}/{passes}", flush=True)
        for i, shape in enumerate(shapes):
            prob = make_problem(*shape, dtype, device)
            runs = {kind: step_fn(kind, *prob) for kind in kinds}
            for k, v in time_case(runs, device, reps, warmup=2 if p == 0 else 1).items():
                times[i][k].extend(v)
            if p == passes - 1:
                peaks[i] = {k: peak_extra_bytes(run, device) for k, run in runs.items()}
            del prob, runs
    pick = statistics.median if device.type == "cuda" else min
    all_secs = [{k: pick(v) for k, v in t.items()} for t in times]
    results = []
    for shape, peak_of, secs in zip(shapes, peaks, all_secs):
        d_model, d_ff, experts, tokens = shape
        rows = tokens * TOP_K
        elem = torch.empty(0, dtype=dtype).element_size()
        f = flops(rows, d_model, d_ff)
        row = {"d_model": d_model, "d_ff": d_ff, "experts": experts, "tokens": tokens, "rows": rows}
        for kind in kinds:
            row[f"{kind}_ms"] = round(secs[kind] * 1e3, 3)
            row[f"{kind}_tflops"] = round(f / secs[kind] / 1e12, 4)
            if peak_of.get(kind) is not None:
                row[f"{kind}_peak_vs_ideal"] = round(
                    peak_of[kind] / ideal_extra_bytes(tokens, rows, d_model, d_ff, experts, elem), 3)
        for kind in kinds:
            if kind != "loop":
                row[f"loop/{kind}"] = round(secs["loop"] / secs[kind], 3)
        if "dense" in kinds:
            for kind in kinds:
                if kind != "dense":
                    row[f"{kind}/dense"] = round(secs["dense"] / secs[kind], 3)
        contenders = [k for k in kinds if k in BACKEND_OF]
        row["fastest"] = BACKEND_OF[min(contenders, key=lambda k: secs[k])]
        results.append(row)
    return results


def summarise(results: list[dict], kinds: list[str]) -> dict:
    """Per backend, the geometric mean over the cases of (loop time / its time)."""
    speedup = {}
    for kind in kinds:
        if kind not in BACKEND_OF:
            continue
        logs = [math.log(r["loop_ms"] / r[f"{kind}_ms"]) for r in results]
        speedup[BACKEND_OF[kind]] = round(math.exp(sum(logs) / len(logs)), 3)
    return speedup


def write_measured(path: Path, kind: str, entry: dict) -> None:
    """Merge this device kind's entry into the JSON file (other kinds kept), kinds sorted,
    one line per field and per case."""
    data = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    data[kind] = entry
    blocks = []
    for name in sorted(data):
        fields = dict(data[name])
        cases = fields.pop("cases", None)
        body = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in fields.items()]
        if cases is not None:
            body.append('  "cases": [\n' + ",\n".join(f"   {json.dumps(c)}" for c in cases) + "\n  ]")
        blocks.append(f" {json.dumps(name)}: {{\n" + ",\n".join(body) + "\n }")
    text = "{\n" + ",\n".join(blocks) + "\n}\n"
    json.loads(text)  # well-formed before it replaces anything
    path.write_text(text, encoding="utf-8")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small shapes anywhere")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                    help="default bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--reps", type=int, default=None, help="timed calls per backend, case and pass")
    ap.add_argument("--passes", type=int, default=None, help="sweeps over the grid (default 1 on CUDA, 3 on CPU)")
    ap.add_argument("--dense", action="store_true", help="time the dense ceiling on CPU too")
    ap.add_argument("--write", nargs="?", const=str(MEASURED), default=None, metavar="PATH",
                    help=f"record the fastest backend for this device kind (default file: {MEASURED})")
    args = ap.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    reps = args.reps or (20 if device.type == "cuda" else 3)
    passes = args.passes or (1 if device.type == "cuda" else 3)
    shapes = QUICK_SHAPES if args.quick else (CUDA_SHAPES if device.type == "cuda" else CPU_SHAPES)
    kinds = []
    # The interpreter would take minutes on these shapes; on CPU it is for tests only.
    if device.type == "cuda" and triton_available(device):
        kinds.append("triton")
    if grouped_mm_available(device):
        kinds.append("grouped_mm")
    kinds.append("loop")
    if device.type == "cuda" or args.dense:
        kinds.append("dense")
    kind_name = device_kind(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    print(f"# device={name} kind={kind_name} dtype={str(dtype).replace('torch.', '')} torch={torch.__version__} "
          f"fwd+bwd SwiGLU expert MLP, top-2; contenders: {', '.join(kinds)}; "
          f"{'median' if device.type == 'cuda' else 'minimum'} of {reps * passes} reps ({passes} passes)")
    if "triton" not in kinds:
        print("# triton column skipped: " + ("no CUDA device (the CPU interpreter is for tests)"
                                             if device.type != "cuda" else "triton unavailable"))

    ratios = [f"loop/{k}" for k in kinds if k != "loop"] + [f"{k}/dense" for k in kinds if "dense" in kinds and k != "dense"]
    head = f"{'d':>5} {'f':>6} {'E':>3} {'tokens':>6} {'rows':>6} | " + " ".join(f"{k + ' ms':>13}" for k in kinds)
    head += " | " + " ".join(f"{r:>15}" for r in ratios) + " | fastest"
    if device.type == "cuda":
        head += " | " + " ".join(f"{k + ' mem':>10}" for k in kinds)
    results = bench_shapes(shapes, dtype, device, reps, passes, kinds)
    print(head)
    for r in results:
        line = f"{r['d_model']:>5} {r['d_ff']:>6} {r['experts']:>3} {r['tokens']:>6} {r['rows']:>6} | "
        line += " ".join(f"{r[k + '_ms']:>13.3f}" for k in kinds) + " | "
        line += " ".join(f"{r[q]:>15.3f}" for q in ratios) + f" | {r['fastest']}"
        if device.type == "cuda":
            line += " | " + " ".join(f"{r[k + '_peak_vs_ideal']:>9.2f}x" for k in kinds)
        print(line, flush=True)
    speedup = summarise(results, kinds)
    best = max(speedup, key=speedup.get)
    print("# geometric mean over the cases of loop time / backend time: "
          + ", ".join(f"{b} {s:.3f}x" for b, s in speedup.items()) + f" -> fastest on {kind_name}: {best}")
    summary = {"bench": "kernels", "device": name, "kind": kind_name, "dtype": str(dtype).replace("torch.", ""),
               "torch": torch.__version__, "results": results, "speedup_vs_torch": speedup, "best": best}
    if args.write:
        entry = {
            "best": best,
            "speedup_vs_torch": speedup,
            "device": name,
            "dtype": summary["dtype"],
            "torch": torch.__version__,
            "date": datetime.date.today().isoformat(),
            "workload": "fwd+bwd SwiGLU expert MLP, top-2, uniform routing",
            "cases": [{"d_model": r["d_model"], "d_ff": r["d_ff"], "experts": r["experts"], "tokens": r["tokens"],
                       "ms": {BACKEND_OF[k]: r[f"{k}_ms"] for k in kinds if k in BACKEND_OF}} for r in results],
        }
        path = Path(args.write)
        write_measured(path, kind_name, entry)
        print(f"# wrote {kind_name}: best={best} to {path}")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
