"""Forward+backward of the MoE expert MLP on every expert backend, beside transformers' own.

Columns (each a contender computing the same thing from the same weights and routing:
token rows through their top-k experts' SwiGLU MLPs, weighted and summed per token):

- ``loop``:          ``grouped_mlp_torch``, one torch matmul per expert (``expert_backend=torch``).
- ``grouped_mm``:    PyTorch's grouped GEMM, ``torch._grouped_mm`` (``expert_backend=grouped_mm``).
- ``triton``:        the gather-GEMM Triton kernels (``expert_backend=triton``); CUDA only.
- ablations (``--ablations``, CUDA only; off by default: their kernels compile again, and
  ``bench/gpu.py``'s deadline counts on one set), each a column of this pack beside the
  backend it takes apart, as ``<ablation>/<backend>`` (> 1: what was taken out pays):
  ``triton_group1``, the Triton kernels launched one row tile at a time (``GROUP=1``, the
  order before the grouped launch order; ``bench/tile_order.py`` models both orders'
  memory traffic); ``grouped_mm_unfused``, grouped_mm with SwiGLU on torch's ops instead
  of the fused kernels (``kernels/swiglu.py``).
- ``hf_grouped_mm``: transformers' experts module (``MixtralExperts``) with
                     ``config._experts_implementation="grouped_mm"``, loaded with the same
                     weights: the path issue #39 measured at 464 TFLOP/s on an H100. Not a
                     backend of this pack: the bar ``auto`` must clear. Skipped, with the
                     reason printed, where it cannot run (no transformers, no grouped_mm).
- ``hf_eager``:      (``--hf-eager``) the same module's eager per-expert loop.
- ``dense``:         one dense MLP over all M routed rows with a single expert's weights: the
                     expert GEMMs' FLOPs as large GEMMs with no grouping, i.e. the ceiling
                     (no weighting, no combine); CUDA and ``--quick`` (``--dense`` adds it on
                     CPU's default grid).

The pack's columns time what the layer runs on rows already grouped by expert: the
grouped MLP, then each row times its routing weight, summed per token (``index_add``);
transformers' time its whole experts forward from the token-level routing (its sort by
expert included: an ``argsort`` of ``tokens * top_k`` integers, small beside the GEMMs).

Throughput is of the expert GEMMs alone, defined once (:func:`flops`): forward
``2 * rows * d_model * 2 d_ff`` (up and gate, SwiGLU) ``+ 2 * rows * d_ff * d_model``
(down), backward twice that, ``rows = tokens * top_k``: ``6 * tokens * top_k * d_model *
d_ff * 3``. ``X/dense`` is the fraction of the dense GEMM's throughput X reaches,
``loop/X`` how many times faster than the per-expert loop X runs (> 1: faster).

Cases: the MoE layer shapes of Mixtral-8x7B, OLMoE-1B-7B, Qwen3-30B-A3B and DeepSeek-V2-Lite
(routed experts only), read from ``conf/model/<name>.yaml`` at 8192 tokens (CUDA default);
``--quick``: small shapes of the same kinds (tens of seconds on 2 CPU cores); CPU default:
one width, a grid of expert and token counts. Every backend of a case runs in one loop,
interleaved rep by rep so that drift in the machine's load hits all alike (the median of
CUDA event times; on CPU the minimum, as load only adds). Then one JSON line (``--json
PATH`` writes the same object to a file).

``--write`` records the fastest of this pack's backends for this kind of device (``cpu``,
``cuda:sm90``, ...; the geometric mean over the cases of its time relative to the loop
decides) in ``kernels/measured.json``, which ships in the package and which
``expert_backend=auto`` follows; entries of other device kinds are kept.

    python bench/expert_kernels.py                # CPU: small grid; CUDA: the four models' shapes
    python bench/expert_kernels.py --write        # ... and record the winner for this device kind
    python bench/expert_kernels.py --quick        # small shapes anywhere
    python bench/expert_kernels.py --json out.json
    python bench/expert_kernels.py --record docs/gpu/h200-2026-12-04.json   # a lent GPU's run, recorded here
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import statistics
import time
from pathlib import Path
from typing import Callable, ContextManager, NamedTuple

import torch

from lightning_hetermoe.kernels import (grouped_mlp, grouped_mlp_grouped_mm, grouped_mm_available, swiglu,
                                        triton_available, tuning)
from lightning_hetermoe.kernels.measured import FILE, device_kind
from lightning_hetermoe.kernels import grouped_mlp_torch

ROOT = Path(__file__).resolve().parents[1]
MEASURED = ROOT / "kernels" / FILE
# bench column -> expert_backend value (dense and transformers' columns are bars, not backends)
BACKEND_OF = {"loop": "torch", "grouped_mm": "grouped_mm", "triton": "triton"}
PACK_FN = {"triton": grouped_mlp, "grouped_mm": grouped_mlp_grouped_mm, "loop": grouped_mlp_torch}
HF_IMPL = {"hf_grouped_mm": "grouped_mm", "hf_eager": "eager"}


class Ablation(NamedTuple):
    base: str  # the backend's column it takes apart
    what: str
    under: Callable[[], ContextManager]  # what its forward and backward run under


# Columns that take one of this pack's backends apart (or try a change on it before it is
# the default). Not backends of their own, so never the fastest nor written to measured.json.
ABLATIONS = {"triton_group1": Ablation("triton", "one row tile at a time", lambda: tuning.launch_group(1)),
             "grouped_mm_unfused": Ablation("grouped_mm", "SwiGLU on torch's ops", lambda: swiglu.fused(False)),
             "triton_tma": Ablation("triton", "operands by TMA descriptor (sm90+; off by default until this says)",
                                    lambda: tuning.tma_loads(True))}


class Case(NamedTuple):
    name: str
    d_model: int
    d_ff: int
    experts: int
    top_k: int
    tokens: int


MODELS = ("mixtral_8x7b", "olmoe_1b_7b", "qwen3_30b_a3b", "deepseek_v2_lite")
MODEL_TOKENS = 8192  # the issue's case: 2048 rows per expert at Mixtral's shape


def model_cases(tokens: int = MODEL_TOKENS) -> list[Case]:
    """The MoE layer of each model in :data:`MODELS`, as ``conf/model/<name>.yaml`` defines
    it (``d_model``, ``moe.d_ff``, ``moe.num_experts`` routed, ``moe.top_k``)."""
    from omegaconf import OmegaConf

    out = []
    for name in MODELS:
        cfg = OmegaConf.load(ROOT / "conf" / "model" / f"{name}.yaml")
        out.append(Case(name, cfg.d_model, cfg.moe.d_ff, cfg.moe.num_experts, cfg.moe.top_k, tokens))
    return out


# CPU: one layer width, a grid of expert and token counts (few rows per expert up to many).
CPU_SHAPES = [Case(f"grid_e{e}_t{t}", 256, 512, e, 2, t) for e in (4, 16, 64) for t in (256, 2048, 8192)]
# The four models' kinds, small: expert count and top-k as theirs, widths / 32 to / 64.
QUICK_SHAPES = [Case("mixtral-like", 64, 224, 8, 2, 512), Case("olmoe-like", 64, 32, 64, 8, 256),
                Case("qwen3-like", 64, 24, 128, 8, 256), Case("deepseek_v2_lite-like", 64, 44, 64, 6, 256)]


def routed_rows(tokens: int, experts: int, top_k: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                          torch.Tensor]:
    """Uniform random top-k routing: ``(choice [T, k], order, idx, counts)``; ``order`` sorts
    the flat choices by expert (stable), ``idx`` is the token of each grouped row, the
    way the dispatcher groups them."""
    choice = torch.rand(tokens, experts, device=device).topk(top_k, dim=1).indices
    order = torch.argsort(choice.reshape(-1), stable=True)
    return choice, order, order // top_k, torch.bincount(choice.reshape(-1), minlength=experts)


class Problem(NamedTuple):
    x: torch.Tensor  # [T, d], requires grad
    choice: torch.Tensor  # [T, k] expert ids
    weights: torch.Tensor  # [T, k] routing weights (softmax-like, in x's dtype)
    idx: torch.Tensor  # [M] token of each grouped row
    counts: torch.Tensor  # [E]
    row_weight: torch.Tensor  # [M] routing weight of each grouped row
    w_up: torch.Tensor  # [E, d, 2f] (gate columns, then up), requires grad
    w_down: torch.Tensor  # [E, f, d], requires grad


def make_problem(case: Case, dtype, device) -> Problem:
    _, d_model, d_ff, experts, top_k, tokens = case
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, d_model, device=device, dtype=dtype, generator=g).requires_grad_()
    w_up = (torch.randn(experts, d_model, 2 * d_ff, device=device, dtype=dtype, generator=g) / d_model ** 0.5)
    w_down = (torch.randn(experts, d_ff, d_model, device=device, dtype=dtype, generator=g) / d_ff ** 0.5)
    torch.manual_seed(0)
    choice, order, idx, counts = routed_rows(tokens, experts, top_k, device)
    weights = torch.rand(tokens, top_k, device=device).softmax(-1).to(dtype)
    return Problem(x, choice, weights, idx, counts, weights.reshape(-1)[order], w_up.requires_grad_(),
                   w_down.requires_grad_())


def flops(rows: int, d_model: int, d_ff: int) -> float:
    """FLOPs of the expert GEMMs, forward+backward: up (2*d_ff wide, SwiGLU) and down GEMMs
    of ``rows`` routed rows (tokens * top_k), backward twice the forward:
    ``6 * rows * d_model * d_ff * 3``."""
    return 3 * 2 * rows * (d_model * 2 * d_ff + d_ff * d_model)


def hf_unavailable_reason(device: torch.device) -> str:
    """Why transformers' grouped_mm experts cannot run here; empty when they can."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts  # noqa: F401
    except Exception as exc:  # not installed, or a version without the experts interface
        return f"transformers' experts interface is not importable ({type(exc).__name__}: {exc})"
    if "grouped_mm" not in ALL_EXPERTS_FUNCTIONS:
        return "this transformers has no grouped_mm experts implementation"
    if not grouped_mm_available(device):
        return f"torch._grouped_mm cannot run on {device}"
    return ""


def hf_experts(prob: Problem, implementation: str) -> torch.nn.Module:
    """transformers' ``MixtralExperts`` holding ``prob``'s weights (its layout: ``gate_up_proj
    [E, 2f, d]``, ``down_proj [E, d, f]``, contiguous as a loaded model's), running
    ``implementation`` (``grouped_mm`` or ``eager``)."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    experts, d_model, two_f = prob.w_up.shape
    config = MixtralConfig(hidden_size=d_model, intermediate_size=two_f // 2, num_local_experts=experts,
                           num_experts_per_tok=prob.choice.shape[1], hidden_act="silu")
    config._experts_implementation = implementation
    with torch.device("meta"):
        module = MixtralExperts(config)
    module.gate_up_proj = torch.nn.Parameter(prob.w_up.detach().transpose(1, 2).contiguous())
    module.down_proj = torch.nn.Parameter(prob.w_down.detach().transpose(1, 2).contiguous())
    return module


def column_forward(kind: str, prob: Problem, hf_module: torch.nn.Module | None = None):
    """A function computing column ``kind``'s output ``[T, d]`` (``dense``: ``[M, d]``) from
    ``prob``, with autograd to its leaves."""
    if kind == "dense":
        xs = prob.x.detach().index_select(0, prob.idx).requires_grad_()
        wu, wd = prob.w_up[0].detach().requires_grad_(), prob.w_down[0].detach().requires_grad_()

        def dense():
            gate, up = (xs @ wu).chunk(2, dim=-1)
            return (torch.nn.functional.silu(gate) * up) @ wd
        return dense
    if kind in HF_IMPL:
        module = hf_module if hf_module is not None else hf_experts(prob, HF_IMPL[kind])
        return lambda: module(prob.x, prob.choice, prob.weights)
    fn = PACK_FN[ABLATIONS[kind].base if kind in ABLATIONS else kind]
    # The torch loop reads counts on the host; the others take them on the device.
    c = prob.counts.cpu() if kind == "loop" else prob.counts

    def pack():
        y = fn(prob.x, prob.idx, c, prob.w_up, None, prob.w_down, None, "swiglu")
        return y.new_zeros(prob.x.shape).index_add_(0, prob.idx, y * prob.row_weight.unsqueeze(1))
    return pack


def ablated(kind: str) -> ContextManager:
    """What column ``kind`` runs under, forward and backward alike (nothing for a backend)."""
    return ABLATIONS[kind].under() if kind in ABLATIONS else contextlib.nullcontext()


def step_fn(kind: str, prob: Problem):
    """One timed call: column ``kind``'s forward and backward (upstream gradient ones)."""
    forward = column_forward(kind, prob)

    def run():
        with ablated(kind):
            y = forward()
            y.backward(torch.ones_like(y))
    return run


def case_outputs(kind: str, prob: Problem, upstream: torch.Tensor) -> dict[str, torch.Tensor]:
    """Column ``kind``'s output and its gradients to the input and to both expert weights
    (in the pack's layout) under ``upstream``: what the columns must agree on."""
    hf = hf_experts(prob, HF_IMPL[kind]) if kind in HF_IMPL else None
    with ablated(kind):
        y = column_forward(kind, prob, hf)()
        if hf is not None:
            w_up, w_down = hf.gate_up_proj, hf.down_proj
            dx, du, dd = torch.autograd.grad(y, [prob.x, w_up, w_down], upstream)
            du, dd = du.transpose(1, 2), dd.transpose(1, 2)
        else:
            dx, du, dd = torch.autograd.grad(y, [prob.x, prob.w_up, prob.w_down], upstream)
    return {"y": y.detach(), "x": dx, "w_up": du, "w_down": dd}


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


def bench_shapes(shapes: list[Case], dtype, device, reps, passes, kinds) -> list[dict]:
    """Time every column on every case. The grid is swept ``passes`` times (each pass
    rebuilds the same seeded problem, so only one case is in memory at a time), so that a
    burst of load on the machine hits every column alike and no case entirely. Per case
    and column: the median of CUDA event times; on CPU the minimum, as other load only
    ever adds time."""
    times = [{k: [] for k in kinds} for _ in shapes]
    peaks = [{} for _ in shapes]
    for p in range(passes):
        if passes > 1:
            print(f"# pass {p + 1}/{passes}", flush=True)
        for i, case in enumerate(shapes):
            prob = make_problem(case, dtype, device)
            runs = {kind: step_fn(kind, prob) for kind in kinds}
            for k, v in time_case(runs, device, reps, warmup=2 if p == 0 else 1).items():
                times[i][k].extend(v)
            if p == passes - 1:
                peaks[i] = {k: peak_extra_bytes(run, device) for k, run in runs.items()}
            del prob, runs
    pick = statistics.median if device.type == "cuda" else min
    all_secs = [{k: pick(v) for k, v in t.items()} for t in times]
    elem = torch.empty(0, dtype=dtype).element_size()
    return [case_row(case, secs, peak_of, kinds, elem) for case, peak_of, secs in zip(shapes, peaks, all_secs,
                                                                                      strict=True)]


def case_row(case: Case, secs: dict[str, float], peak_of: dict, kinds: list[str], elem: int) -> dict:
    """One case's row of the table: ms, TFLOP/s of expert GEMMs, ratios, the fastest backend."""
    rows = case.tokens * case.top_k
    f = flops(rows, case.d_model, case.d_ff)
    row = {"name": case.name, "d_model": case.d_model, "d_ff": case.d_ff, "experts": case.experts,
           "top_k": case.top_k, "tokens": case.tokens, "rows": rows}
    for kind in kinds:
        row[f"{kind}_ms"] = round(secs[kind] * 1e3, 3)
        row[f"{kind}_tflops"] = round(f / secs[kind] / 1e12, 4)
        if peak_of.get(kind) is not None:
            row[f"{kind}_peak_vs_ideal"] = round(
                peak_of[kind] / ideal_extra_bytes(case.tokens, rows, case.d_model, case.d_ff, case.experts, elem), 3)
    for kind in kinds:
        if kind != "loop":
            row[f"loop/{kind}"] = round(secs["loop"] / secs[kind], 3)
    if "dense" in kinds:
        for kind in kinds:
            if kind != "dense":
                row[f"{kind}/dense"] = round(secs["dense"] / secs[kind], 3)
    for kind, ab in ABLATIONS.items():  # > 1: what the ablation took out pays
        if kind in kinds and ab.base in kinds:
            row[f"{kind}/{ab.base}"] = round(secs[kind] / secs[ab.base], 3)
    contenders = [k for k in kinds if k in BACKEND_OF]
    fastest = min(contenders, key=lambda k: secs[k])
    row["fastest"] = BACKEND_OF[fastest]
    if "hf_grouped_mm" in kinds:  # > 1: this pack's fastest beats transformers' grouped_mm
        row["fastest/hf_grouped_mm"] = round(secs["hf_grouped_mm"] / secs[fastest], 3)
    return row


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


def columns(device: torch.device, quick: bool, dense: bool, hf_eager: bool, ablations: bool = False) -> list[str]:
    """The columns that run here, each skipped one with its reason printed."""
    kinds = []
    # The interpreter would take minutes on these shapes; on CPU it is for tests only.
    if device.type == "cuda" and triton_available(device):
        kinds.append("triton")
    else:
        print("# triton column skipped: " + ("no CUDA device (the CPU interpreter is for tests)"
                                             if device.type != "cuda" else "triton unavailable"))
    if grouped_mm_available(device):
        kinds.append("grouped_mm")
    else:
        print(f"# grouped_mm column skipped: torch._grouped_mm cannot run on {device}")
    if ablations and device.type == "cuda":
        kinds += [k for k, ab in ABLATIONS.items() if ab.base in kinds]
    kinds.append("loop")
    reason = hf_unavailable_reason(device)
    if reason:
        print(f"# hf_grouped_mm column skipped: {reason}")
    else:
        kinds.append("hf_grouped_mm")
    if hf_eager:
        kinds.append("hf_eager")
    if device.type == "cuda" or quick or dense:
        kinds.append("dense")
    return kinds


def print_table(results: list[dict], kinds: list[str], cuda: bool) -> None:
    ratios = ([f"loop/{k}" for k in kinds if k not in ("loop", "dense")]
              + [f"{k}/dense" for k in kinds if "dense" in kinds and k != "dense"]
              + [f"{k}/{ab.base}" for k, ab in ABLATIONS.items() if k in kinds and ab.base in kinds])
    head = (f"{'case':<22} {'d':>5} {'f':>6} {'E':>4} {'k':>2} {'tokens':>6} | "
            + " ".join(f"{k + ' ms':>16}" for k in kinds) + " | " + " ".join(f"{k + ' TF/s':>18}" for k in kinds)
            + " | " + " ".join(f"{r:>20}" for r in ratios) + " | fastest")
    if cuda:
        head += " | " + " ".join(f"{k + ' mem':>17}" for k in kinds)
    print(head)
    for r in results:
        line = (f"{r['name']:<22} {r['d_model']:>5} {r['d_ff']:>6} {r['experts']:>4} {r['top_k']:>2} "
                f"{r['tokens']:>6} | " + " ".join(f"{r[k + '_ms']:>16.3f}" for k in kinds) + " | "
                + " ".join(f"{r[k + '_tflops']:>18.4f}" for k in kinds) + " | "
                + " ".join(f"{r[q]:>20.3f}" for q in ratios) + f" | {r['fastest']}")
        if "fastest/hf_grouped_mm" in r:
            line += f" ({r['fastest/hf_grouped_mm']:.2f}x hf_grouped_mm)"
        if cuda:
            line += " | " + " ".join(f"{r[k + '_peak_vs_ideal']:>16.2f}x" for k in kinds)
        print(line, flush=True)


def measured_entry(summary: dict, results: list[dict], kinds: list[str], *, date: str | None = None,
                   source: str = "bench/expert_kernels.py --write") -> dict:
    """The ``measured.json`` entry of this run: the winner among this pack's backends and
    every column's times per case (transformers' beside them, for the record)."""
    timed = [k for k in kinds if k != "dense"]
    return {
        "best": summary["best"],
        "speedup_vs_torch": summary["speedup_vs_torch"],
        "device": summary["device"],
        "dtype": summary["dtype"],
        "torch": summary.get("torch", torch.__version__),
        "date": date or datetime.date.today().isoformat(),
        "source": source,
        "workload": "fwd+bwd SwiGLU expert MLP with weighted combine, uniform top-k routing",
        "cases": [{"name": r["name"], "d_model": r["d_model"], "d_ff": r["d_ff"], "experts": r["experts"],
                   "top_k": r["top_k"], "tokens": r["tokens"],
                   "ms": {BACKEND_OF.get(k, k): r[f"{k}_ms"] for k in timed}} for r in results],
    }


def record(report_path: Path, measured_path: Path) -> dict:
    """Write the ``measured.json`` entry of a run made elsewhere: a ``--json`` summary, or a
    ``bench/gpu.py`` report (its ``kernels`` step), as a lent GPU's run brings it back."""
    report = json.loads(report_path.read_text(encoding="utf-8"))
    summary = report["steps"]["kernels"]["result"] if "steps" in report else report
    if not isinstance(summary, dict) or summary.get("bench") != "kernels" or not summary.get("results"):
        raise SystemExit(f"{report_path}: no bench/expert_kernels.py summary in it (a --json file, or bench/gpu.py's report)")
    entry = measured_entry(summary, summary["results"], summary["columns"], date=report.get("date"),
                           source=f"bench/expert_kernels.py on the device, recorded from {report_path.name}")
    write_measured(measured_path, summary["kind"], entry)
    print(f"# wrote {summary['kind']}: best={summary['best']} to {measured_path}")
    return entry


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small shapes of the four models' kinds, anywhere")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                    help="default bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--reps", type=int, default=None, help="timed calls per column, case and pass")
    ap.add_argument("--passes", type=int, default=None,
                    help="sweeps over the grid (default 1 on CUDA, 3 on CPU, 2 on CPU with --quick)")
    ap.add_argument("--dense", action="store_true", help="time the dense ceiling on CPU's default grid too")
    ap.add_argument("--hf-eager", action="store_true", help="time transformers' eager experts loop too")
    ap.add_argument("--ablations", action="store_true",
                    help="time the ablation columns too (" + ", ".join(ABLATIONS) + "; CUDA)")
    ap.add_argument("--write", nargs="?", const=str(MEASURED), default=None, metavar="PATH",
                    help=f"record the fastest backend for this device kind (default file: {MEASURED})")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the summary (the JSON line) here")
    ap.add_argument("--record", default=None, metavar="REPORT",
                    help="time nothing: record the winner of a run made elsewhere (its --json file, or "
                         "bench/gpu.py's report) into --write's file")
    args = ap.parse_args(argv)
    if args.record:
        return record(Path(args.record), Path(args.write or MEASURED))

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    reps = args.reps or (20 if device.type == "cuda" else 3)
    passes = args.passes or (1 if device.type == "cuda" else 2 if args.quick else 3)
    shapes = QUICK_SHAPES if args.quick else (model_cases() if device.type == "cuda" else CPU_SHAPES)
    kind_name = device_kind(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    kinds = columns(device, args.quick, args.dense, args.hf_eager, args.ablations)
    print(f"# device={name} kind={kind_name} dtype={str(dtype).replace('torch.', '')} torch={torch.__version__} "
          f"fwd+bwd SwiGLU expert MLP; contenders: {', '.join(kinds)}; "
          f"{'median' if device.type == 'cuda' else 'minimum'} of {reps * passes} reps ({passes} passes); "
          f"TF/s = 6 * tokens * top_k * d_model * d_ff * 3 / time")
    if not args.quick and device.type == "cuda":
        print(f"# shapes: the MoE layers of {', '.join(MODELS)} from conf/model/*.yaml, {MODEL_TOKENS} tokens")
    for kind in kinds:
        if kind in ABLATIONS:
            print(f"# {kind}: {ABLATIONS[kind].base} with {ABLATIONS[kind].what}")
    results = bench_shapes(shapes, dtype, device, reps, passes, kinds)
    print_table(results, kinds, device.type == "cuda")
    speedup = summarise(results, kinds)
    best = max(speedup, key=speedup.get)
    print("# geometric mean over the cases of loop time / backend time: "
          + ", ".join(f"{b} {s:.3f}x" for b, s in speedup.items()) + f" -> fastest on {kind_name}: {best}")
    behind = [r["name"] for r in results if r.get("fastest/hf_grouped_mm", 1.0) < 1.0]
    if behind:
        print(f"# this pack's fastest backend is slower than transformers' grouped_mm at: {', '.join(behind)}")
    summary = {"bench": "kernels", "device": name, "kind": kind_name, "dtype": str(dtype).replace("torch.", ""),
               "torch": torch.__version__, "columns": kinds,
               "flops": "6 * tokens * top_k * d_model * d_ff * 3 (expert GEMMs, fwd+bwd, SwiGLU)",
               "results": results, "speedup_vs_torch": speedup, "best": best}
    if args.write:
        path = Path(args.write)
        write_measured(path, kind_name, measured_entry(summary, results, kinds))
        print(f"# wrote {kind_name}: best={best} to {path}")
    return emit(summary, args.json)


def emit(summary: dict, path: str | None) -> dict:
    """Print ``summary`` as the last line's JSON, also written to ``path`` where given
    (``bench/tile_order.py``, which loads this script, ends the same way)."""
    if path:
        Path(path).write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    from lightning_hetermoe.process_exit import run_and_exit

    run_and_exit(main)  # no finalization: its collections walk every object torch and Lightning made
