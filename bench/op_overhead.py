"""What a kernel call costs the host: each custom op called through ``torch.library``
beside the same body called eagerly (``kernels/eager.py``), forward and backward.

    python bench/op_overhead.py                          # the CPU: the grouped_mm expert MLP
    python bench/op_overhead.py --device cuda --json op_overhead.json

At tiny shapes (``--rows``, default 64) the device work is negligible, so the seconds per
call are the host's: what the op's Python layers add is the difference. On the CPU only
the ``grouped_mm`` expert MLP runs its real body (the Triton kernels need CUDA; Triton's
interpreter would swamp the difference), as does a stand-in op of the same shape of call
(``scale``: one multiply, registered like the kernels are) that measures the layers alone. The
torch expert loop (the ``torch`` backend, an ``autograd.Function`` and no custom op) is
compared with itself as it was: its "through op" column is the same Function with a
separate ``setup_context``, whose arguments torch binds through ``inspect.signature`` at
every call, its "eager" column the ctx-style ``LoopMLP`` it is now.
On CUDA every kernel runs: RMSNorm, rotary, SwiGLU (no autograd: called from the expert
backward) and both expert MLPs. Contenders interleaved rep by rep, medians, then the ratio
op / eager (> 1: the eager call is cheaper) and the microseconds saved per call. The last
line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch


def _stand_in() -> tuple[Callable, Callable]:
    """A one-multiply op with autograd, registered as the kernels are, and its eager call."""
    from lightning_hetermoe.kernels import eager

    def _scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * w

    op = torch.library.custom_op("hetermoe_bench::scale", mutates_args=())(_scale)
    op.register_fake(lambda x, w: torch.empty_like(x))

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0)

    op.register_autograd(backward, setup_context=setup_context)
    return op, eager.differentiable(op, _scale, setup_context, backward)


def _loop_with_setup_context() -> Callable:
    """The torch expert loop's ``autograd.Function`` with a separate ``setup_context`` (as it
    was before 2026-12-06): torch binds its arguments through ``inspect.signature`` at every
    call. Beside ``LoopMLP`` (ctx-style) it measures that binding alone."""
    from lightning_hetermoe.kernels import algorithm, loop

    setup_context, grads = algorithm.autograd(loop._backward)

    def forward(x, gather_idx, counts, w_up, b_up, w_down, b_down, activation, recompute):
        with torch.autocast(x.device.type, enabled=False):
            return algorithm.forward(loop.LoopGemms(counts), x, gather_idx, w_up, b_up, w_down, b_down, activation,
                                     recompute)

    fn = type("LoopMLPSetupContext", (torch.autograd.Function,), {
        "forward": staticmethod(forward), "setup_context": staticmethod(setup_context),
        "backward": staticmethod(grads)})
    return fn.apply


def cases(device: torch.device, rows: int) -> dict[str, tuple[Callable, Callable, list[Any], bool]]:
    """``name -> (through the op, eager, args, backward)``: each runs where ``device`` runs it."""
    from lightning_hetermoe.kernels import grouped_mm, loop, rms_norm, rotary, swiglu

    g = torch.Generator(device="cpu").manual_seed(0)

    def t(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(device, dtype)

    d, f, E = 64, 64, 4
    counts = torch.full((E,), rows // E, dtype=torch.long, device=device)
    idx = torch.arange(int(counts.sum()), device=device) % rows
    mlp_args = [t(rows, d), idx, counts, t(E, d, 2 * f) * 0.1, None, t(E, f, d) * 0.1, None, "swiglu", False]
    op, eager = _stand_in()
    out = {"stand-in scale": (op, eager, [t(rows, d), t(d)], True),
           "grouped_mm mlp": (grouped_mm.grouped_mm_mlp_op, grouped_mm.mlp_eager, mlp_args, True),
           "torch loop mlp": (_loop_with_setup_context(), loop.LoopMLP.apply, mlp_args, True)}
    if device.type == "cuda":
        from lightning_hetermoe.kernels import mlp

        half = torch.randn(rows, 16, generator=g).to(device)
        bf = torch.bfloat16
        out.update({
            "rms_norm": (rms_norm.rms_norm_op, rms_norm.rms_norm, [t(rows, d, dtype=bf), t(d), 1e-6], True),
            "rotary": (rotary.rotary_op, rotary.rotary, [t(1, 2, rows, 32, dtype=bf), half.cos(), half.sin()], True),
            "swiglu": (swiglu.swiglu_op, swiglu.swiglu, [t(rows, 2 * f, dtype=bf)], False),
            "triton mlp": (mlp.grouped_mlp_op, mlp.mlp_eager,
                           [a.to(bf) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in mlp_args],
                           True),
        })
    return out


def time_call(fn: Callable, args: list[Any], backward: bool, calls: int, sync: Callable) -> float:
    """Seconds per call of ``fn(*args)`` (and its backward), over ``calls`` calls."""
    leaves = [a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() and backward else a
              for a in args]
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        y = fn(*leaves)
        y = y[0] if isinstance(y, tuple) else y
        if backward:
            y.sum().backward()
    sync()
    return (time.perf_counter() - t0) / calls


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--rows", type=int, default=64, help="rows per call (tiny: the host's cost shows)")
    ap.add_argument("--calls", type=int, default=200, help="calls per timing")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", help="also write the last line's JSON here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    results: dict[str, Any] = {"device": str(device), "rows": args.rows, "calls": args.calls, "ops": {}}
    print(f"{'op':16} {'through op us':>14} {'eager us':>9} {'op/eager':>9} {'saved us':>9}")
    for name, (op, eager, call_args, backward) in cases(device, args.rows).items():
        for fn in (op, eager):  # warm: compile, autotune-free launches, allocator
            time_call(fn, call_args, backward, 5, sync)
        seen: dict[str, list[float]] = {"op": [], "eager": []}
        for _ in range(args.repeats):
            seen["op"].append(time_call(op, call_args, backward, args.calls, sync))
            seen["eager"].append(time_call(eager, call_args, backward, args.calls, sync))
        o, e = (statistics.median(seen[k]) * 1e6 for k in ("op", "eager"))
        results["ops"][name] = {"op_us": round(o, 2), "eager_us": round(e, 2), "op_over_eager": round(o / e, 3),
                                "saved_us": round(o - e, 2), "backward": backward}
        print(f"{name:16} {o:14.1f} {e:9.1f} {o / e:9.2f}x {o - e:9.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    from lightning_hetermoe.process_exit import run_and_exit

    run_and_exit(main)  # no finalization: its collections walk every object torch and Lightning made
