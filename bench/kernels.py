"""Forward+backward of the MoE expert MLP, three ways side by side.

- ``triton``: ``lightning_hetermoe.kernels.grouped_mlp`` (gather-GEMM kernels).
- ``loop``:   ``grouped_mlp_torch``, one torch matmul per expert (what the CPU path runs).
- ``dense``:  one dense MLP over all M routed rows with a single expert's weights: the same
              FLOPs as cuBLAS-sized GEMMs with no grouping, i.e. the ceiling.

Prints TFLOP/s, ratios and (on CUDA) peak memory against the ideal bytes, then one JSON
line. Without CUDA (or with ``--quick``) it runs small shapes so it is never dead code; the
Triton column is then skipped unless TRITON_INTERPRET=1 makes it runnable on CPU.

    python bench/kernels.py            # Mixtral-like shapes on CUDA, small ones on CPU
    python bench/kernels.py --quick    # small shapes anywhere
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from lightning_hetermoe.kernels import grouped_mlp, triton_available
from lightning_hetermoe.moe.experts import grouped_mlp_torch

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
QUICK_SHAPES = [(64, 224, 8, 512), (128, 448, 8, 1024), (128, 448, 32, 2048)]


def routed_rows(tokens: int, experts: int, top_k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform random top-k routing, grouped by expert the way the dispatcher does it."""
    choice = torch.rand(tokens, experts, device=device).topk(top_k, dim=1).indices.reshape(-1)
    order = torch.argsort(choice, stable=True)
    return order // top_k, torch.bincount(choice, minlength=experts)


def make_problem(d_model, d_ff, experts, tokens, dtype, device, top_k=2):
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, d_model, device=device, dtype=dtype, generator=g).requires_grad_()
    w_up = (torch.randn(experts, d_model, 2 * d_ff, device=device, dtype=dtype, generator=g) / d_model ** 0.5)
    w_down = (torch.randn(experts, d_ff, d_model, device=device, dtype=dtype, generator=g) / d_ff ** 0.5)
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
    fn = grouped_mlp if kind == "triton" else grouped_mlp_torch

    def run():
        y = fn(x, idx, counts, w_up, None, w_down, None, "swiglu")
        y.backward(torch.ones_like(y))
    return run


def timed(run, device, reps: int) -> float:
    """Median seconds per call after warm-up (the first Triton calls also autotune)."""
    for _ in range(2):
        run()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


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


def bench_shape(shape, dtype, device, reps, kinds):
    d_model, d_ff, experts, tokens = shape
    x, idx, counts, w_up, w_down = make_problem(d_model, d_ff, experts, tokens, dtype, device)
    rows = idx.numel()
    f = flops(rows, d_model, d_ff)
    row = {"d_model": d_model, "d_ff": d_ff, "experts": experts, "tokens": tokens, "rows": rows}
    for kind in kinds:
        run = step_fn(kind, x, idx, counts, w_up, w_down)
        sec = timed(run, device, reps)
        row[f"{kind}_ms"] = round(sec * 1e3, 3)
        row[f"{kind}_tflops"] = round(f / sec / 1e12, 4)
        peak = peak_extra_bytes(run, device)
        if peak is not None:
            row[f"{kind}_peak_vs_ideal"] = round(
                peak / ideal_extra_bytes(tokens, rows, d_model, d_ff, experts, x.element_size()), 3)
        x.grad = w_up.grad = w_down.grad = None
    if "triton" in kinds:
        row["triton_vs_dense"] = round(row["triton_tflops"] / row["dense_tflops"], 3)
        row["triton_vs_loop"] = round(row["triton_tflops"] / row["loop_tflops"], 3)
    row["loop_vs_dense"] = round(row["loop_tflops"] / row["dense_tflops"], 3)
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small shapes (default when there is no CUDA)")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                    help="default bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--reps", type=int, default=None)
    args = ap.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    quick = args.quick or device.type != "cuda"
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    reps = args.reps or (20 if device.type == "cuda" else 3)
    shapes = QUICK_SHAPES if quick else CUDA_SHAPES
    # The interpreter would take minutes on these shapes; on CPU it is for tests only.
    kinds = (["triton"] if triton_available(device) and device.type == "cuda" else []) + ["loop", "dense"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# device={name} dtype={dtype} fwd+bwd SwiGLU expert MLP, top-2; contenders: {', '.join(kinds)}")
    if "triton" not in kinds:
        print("# triton column skipped: no CUDA device (the CPU interpreter is for tests)")

    cols = [c for c in ("triton", "loop", "dense") if c in kinds]
    head = f"{'d':>5} {'f':>6} {'E':>3} {'tokens':>6} | " + " ".join(f"{c + ' TF/s':>11}" for c in cols)
    head += " | " + ("triton/dense triton/loop " if "triton" in kinds else "") + "loop/dense"
    if device.type == "cuda":
        head += " | " + " ".join(f"{c + ' mem':>10}" for c in cols)
    print(head)
    results = []
    for shape in shapes:
        r = bench_shape(shape, dtype, device, reps, kinds)
        results.append(r)
        line = f"{r['d_model']:>5} {r['d_ff']:>6} {r['experts']:>3} {r['tokens']:>6} | "
        line += " ".join(f"{r[c + '_tflops']:>11.4f}" for c in cols) + " | "
        if "triton" in kinds:
            line += f"{r['triton_vs_dense']:>12.3f} {r['triton_vs_loop']:>11.3f} "
        line += f"{r['loop_vs_dense']:>10.3f}"
        if device.type == "cuda":
            line += " | " + " ".join(f"{r[c + '_peak_vs_ideal']:>9.2f}x" for c in cols)
        print(line, flush=True)
    summary = {"bench": "kernels", "device": name, "dtype": str(dtype).replace("torch.", ""),
               "quick": quick, "results": results}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
