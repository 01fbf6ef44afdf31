"""Gradient clipping's global norm: the float64 copies the backends took before, beside the
per-tensor fp32 norms they take now (``strategy/grad_norm.py``) and Lightning's own clip.

    python bench/clip_norm.py                           # OLMoE-1B-7B's attention rank, about 2 minutes
    python bench/clip_norm.py --model d1 --expert-layers 2
    python bench/clip_norm.py --device cuda --json clip.json   # on a GPU (bench/gpu.py runs this)

The gradients are an attention rank's of a shipped model at full size (every dense
parameter of ``conf/model/<model>``, built on the meta device for their shapes, then
filled at random), plus ``--expert-layers`` layers' stacked experts. For each contender,
in this process, on ``--device`` (the CPU by default; CUDA synchronised around each
timing): the median seconds of a norm and a scaling by ``clip / norm`` over
``--repeats``, the largest tensor any operation allocated (a dispatch mode watching
every aten call: the transient memory of the clip), the bytes the operations read and
wrote (every tensor argument and result: the memory traffic a GPU would stream), and the
squared norm against a float64 reference (relative). Then the ratios old/new. The last
line is JSON.

A GPU streams those bytes at its memory bandwidth: the ratio of bytes is the ratio of time
there, more so on GPUs whose float64 runs at 1/32-1/64 of fp32 (A40, L40S, T4).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
from omegaconf import OmegaConf
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_hetermoe.configs import ModelConfig, OptimConfig, from_cfg
from lightning_hetermoe.model.lm import MoELanguageModel
from lightning_hetermoe.model_contract import moe_layers
from lightning_hetermoe.strategy.grad_norm import scale_, squared_norm

ROOT = Path(__file__).resolve().parents[1]
CLIP = 1.0


class Traffic(TorchDispatchMode):
    """Bytes every aten call read and wrote, and the largest tensor one allocated."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        schema = func._schema
        outs = out if isinstance(out, (list, tuple)) else [out]
        fresh = [v for ret, v in zip(schema.returns, outs if len(schema.returns) == len(outs) else [outs])
                 if ret.alias_info is None]
        if schema.returns and not fresh and not any(a.alias_info is not None and a.alias_info.is_write
                                                    for a in schema.arguments):
            return out  # a view: no element moves
        read = _tensors(list(args) + list((kwargs or {}).values()))
        written = _tensors(fresh) + _tensors([v for a, v in zip(schema.arguments, args)
                                              if a.alias_info is not None and a.alias_info.is_write])
        self.bytes += sum(t.numel() * t.element_size() for t in read + written)
        self.largest = max([self.largest] + [t.numel() * t.element_size() for t in _tensors(fresh)])
        return out


def _tensors(values) -> list[torch.Tensor]:
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out += _tensors(v)
    return out


def float64_copies(grads: list[torch.Tensor]) -> torch.Tensor:
    """The backends' norm before: each gradient copied to float64, squared, summed; then
    one multiply per gradient."""
    sq = sum((g.double().square().sum() for g in grads), torch.zeros((), dtype=torch.float64, device=grads[0].device))
    coef = (CLIP / (sq.sqrt() + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(dtype=g.dtype))
    return sq


def fp32_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """Now: one fp32 norm per tensor, their squares summed in float64, one multi-tensor multiply."""
    sq = squared_norm(grads, grads[0].device)
    scale_(grads, (CLIP / (sq.sqrt() + 1e-6)).clamp(max=1.0))
    return sq


def lightning(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``, as Lightning's clipping calls it (on parameters
    that hold the gradients)."""
    return torch.nn.utils.clip_grad_norm_(params, CLIP).double().square()


def as_params(grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.empty_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g
    return params


# name -> (what the contender is handed, given the gradients; the contender)
CONTENDERS = {"float64 copies (before)": (list, float64_copies), "fp32 norms (now)": (list, fp32_norms),
              "lightning clip_grad_norm_": (as_params, lightning)}


def gradients(model_name: str, expert_layers: int, seed: int, device: str = "cpu") -> list[torch.Tensor]:
    cfg = from_cfg(ModelConfig, OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / f"{model_name}.yaml"),
                                                      resolve=True))
    with torch.device("meta"):
        module = MoELanguageModel(cfg, OptimConfig())
    expert_params = {id(p): l for l, (_, layer) in enumerate(moe_layers(module)) for p in layer.experts.parameters()}
    shapes = [p.shape for p in module.parameters() if expert_params.get(id(p), 0) < expert_layers or
              id(p) not in expert_params]
    g = torch.Generator(device).manual_seed(seed)
    # gradients large enough that clipping scales them (norm above CLIP)
    return [torch.randn(s, generator=g, device=device) * 1e-3 for s in shapes]


def rank_state_parser(doc: str, model: str, repeats: int) -> argparse.ArgumentParser:
    """The arguments of a benchmark over a rank's state (this one and ``optimizer_step.py``)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--model", default=model)
    ap.add_argument("--expert-layers", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--json", help="also write the last line's JSON here")
    return ap


def rank_state(args: argparse.Namespace, noun: str) -> tuple[torch.device, Callable[[], None], list[torch.Tensor]]:
    """``args``' device, how to wait for it, and the rank's tensors (:func:`gradients`), said
    in one line."""
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    base = gradients(args.model, args.expert_layers, seed=0, device=args.device)
    n = sum(g.numel() for g in base)
    print(f"{args.model}: {len(base)} {noun}, {n / 1e6:.1f}M elements ({n * 4 / 2**30:.2f} GiB fp32), "
          f"the largest {max(g.numel() for g in base) / 1e6:.1f}M; "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else f'{torch.get_num_threads()} threads'}",
          flush=True)
    return device, sync, base


def emit(result: dict, path: str | None) -> None:
    """The last line's JSON, also written to ``path`` where given."""
    if path:
        Path(path).write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


def main() -> None:
    args = rank_state_parser(__doc__, "olmoe_1b_7b", 5).parse_args()
    torch.manual_seed(0)
    device, sync, base = rank_state(args, "gradients")
    n = sum(g.numel() for g in base)
    exact = float(sum(g.double().square().sum() for g in base))
    rows = {}
    for name, (hand, fn) in CONTENDERS.items():
        times = []
        for _ in range(args.repeats):
            grads = hand([g.clone() for g in base])
            sync()
            t0 = time.perf_counter()
            sq = fn(grads)
            sync()
            times.append(time.perf_counter() - t0)
            del grads
        grads = hand([g.clone() for g in base])
        with Traffic() as traffic:
            sq = fn(grads)
        rows[name] = {"s": statistics.median(times), "largest_alloc_bytes": traffic.largest,
                      "traffic_bytes": traffic.bytes, "rel_error": float(sq) / exact - 1}
        r = rows[name]
        print(f"{name:28} {r['s'] * 1e3:9.1f} ms   largest allocation {r['largest_alloc_bytes'] / 2**20:9.1f} MiB   "
              f"traffic {r['traffic_bytes'] / n:5.1f} B/element   squared norm {r['rel_error']:+.1e} from float64",
              flush=True)
        del grads
    old, new = rows["float64 copies (before)"], rows["fp32 norms (now)"]
    ratios = {"time_old_over_new": old["s"] / new["s"],
              "traffic_old_over_new": old["traffic_bytes"] / new["traffic_bytes"],
              "largest_alloc_old_bytes": old["largest_alloc_bytes"],
              "largest_alloc_new_bytes": new["largest_alloc_bytes"]}
    print(f"before/now: {ratios['time_old_over_new']:.2f}x the time, {ratios['traffic_old_over_new']:.2f}x the bytes "
          f"moved, {old['largest_alloc_bytes'] / 2**20:.0f} MiB against {new['largest_alloc_bytes']} B allocated "
          f"at once")
    result = {"model": args.model, "device": str(device), "elements": n, "rows": rows, **ratios,
              "work_done_at": time.time()}
    emit(result, args.json)


if __name__ == "__main__":
    from lightning_hetermoe.process_exit import run_and_exit

    run_and_exit(main)  # no finalization: its collections walk every object torch and Lightning made
