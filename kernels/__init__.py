"""Expert kernels, shipped as ``lightning_hetermoe.kernels``: Triton, and torch's grouped GEMM.

Importing this package is cheap and never fails on a CPU-only machine: triton and the
kernel modules load on first use. Modules, one job each:

- ``availability``: whether each backend can run on a device, and why not.
- ``triton_src``: the Triton kernels (gather-GEMM with epilogues, grouped weight gradient,
  the row tile map, SwiGLU forward and backward, the cross-entropy rows, RMSNorm, rotary embedding).
- ``tuning``: which tile config each launch takes (the shipped table, else a heuristic per
  GPU generation; no autotuning unless ``HETERMOE_AUTOTUNE=1`` or ``enable_autotune()``),
  row-count buckets, interpreter blocks.
- ``tiles``: the shipped tile table (``tiles.json``, package data), which
  ``bench/tune_tiles.py --write`` fills per device kind.
- ``warmup``: which shapes and row counts set-up warms (``warm_up_keys``), and ``warm_up``
  here runs them.
- ``launch``: Python launchers (variant per device, sync-free grids, TF32 per torch's
  setting; ``E`` not specialised, so a new expert count does not recompile).
- ``activation``: GELU/SwiGLU and their derivatives.
- ``swiglu``: SwiGLU and its gradient as fused Triton kernels behind custom ops, which
  ``activation`` takes on CUDA (``runs_fused``).
- ``cross_entropy``: the LM head's cross-entropy rows (loss, then softmax - onehot in place)
  as one Triton kernel behind a custom op, which ``model/loss.py`` takes on CUDA.
- ``rms_norm``: RMSNorm forward and backward as Triton kernels behind a custom op with
  autograd, which the pack's ``RMSNorm`` takes on CUDA.
- ``rotary``: the rotary position embedding as one Triton kernel (its gradient the same
  kernel rotating back) behind a custom op, which the pack's attention takes on CUDA.
- ``eager``: how each custom op is called outside ``torch.compile``: its body directly (as an
  ``autograd.Function`` where it has autograd), without the op's Python layers.
- ``algorithm``: the expert MLP, forward and backward, written once over a small set of
  grouped GEMMs (``Gemms``); each backend below is one such set.
- ``mlp``: on the Triton kernels, as custom ops with autograd (the ``triton`` backend,
  ``grouped_mlp``); fp32 that CUDA could not run as TF32 goes to the torch loop
  (``availability.triton_runs_dtype``).
- ``grouped_mm``: on ``torch._grouped_mm`` (the ``grouped_mm`` backend,
  ``grouped_mlp_grouped_mm``), pure torch.
- ``loop``: one ``torch.mm`` per expert (the ``torch`` backend), pure torch.
- ``measured``: the fastest backend per device kind, as ``bench/expert_kernels.py --write``
  recorded it in ``measured.json`` (package data), which ``expert_backend=auto`` follows.
- ``chooser``: the one place ``expert_backend`` becomes a function (``resolve_backend``),
  and the one sentence for a backend that cannot run (``why_not``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .availability import (
    grouped_mm_available,
    grouped_mm_unavailable_reason,
    triton_available,
    triton_uses_tensor_cores,
    unavailable_reason,
)

from .chooser import BACKENDS, auto_backend, resolve_backend, runs_on_host_counts, why_not

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch
    from torch import Tensor

__all__ = ["BACKENDS", "auto_backend", "grouped_gemm", "grouped_mlp", "grouped_mlp_grouped_mm",
           "grouped_mlp_torch", "resolve_backend", "runs_on_host_counts", "why_not", "grouped_mm_available",
           "grouped_mm_unavailable_reason", "grouped_wgrad", "GroupedMLPFunction", "triton_available",
           "triton_uses_tensor_cores", "unavailable_reason", "warm_up"]


def grouped_mlp(x: "Tensor", gather_idx: "Tensor", counts: "Tensor", w_up: "Tensor", b_up: "Tensor | None",
                w_down: "Tensor", b_down: "Tensor | None", activation: str, recompute: bool = False) -> "Tensor":
    """Expert backend (contract in ``lightning_hetermoe.moe.experts``) on the Triton kernels."""
    from .mlp import grouped_mlp as impl

    return impl(x, gather_idx, counts, w_up, b_up, w_down, b_down, activation, recompute=recompute)


def grouped_mlp_torch(x: "Tensor", gather_idx: "Tensor", counts: "Tensor", w_up: "Tensor", b_up: "Tensor | None",
                      w_down: "Tensor", b_down: "Tensor | None", activation: str, recompute: bool = False) -> "Tensor":
    """Expert backend (contract in ``lightning_hetermoe.moe.experts``): one matmul per expert
    (``loop``), the algorithm every backend runs, on the simplest GEMMs."""
    from .loop import grouped_mlp as impl

    return impl(x, gather_idx, counts, w_up, b_up, w_down, b_down, activation, recompute=recompute)


def grouped_mlp_grouped_mm(x: "Tensor", gather_idx: "Tensor", counts: "Tensor", w_up: "Tensor",
                           b_up: "Tensor | None", w_down: "Tensor", b_down: "Tensor | None", activation: str,
                           recompute: bool = False) -> "Tensor":
    """Expert backend (contract in ``lightning_hetermoe.moe.experts``) on ``torch._grouped_mm``."""
    from .grouped_mm import grouped_mlp as impl

    return impl(x, gather_idx, counts, w_up, b_up, w_down, b_down, activation, recompute=recompute)


def warm_up(d_model: int, d_ff: int, activation: str, bias: bool, dtype: "torch.dtype", device: "torch.device",
            rows: "int | Sequence[int] | None" = None, experts: int = 2) -> list[int]:
    """Run the Triton expert MLP, forward and backward, for these shapes, ``experts`` local
    experts and each row count, so that every kernel variant a step launches is compiled now
    (and, with autotuning on, tuned now: its benchmarks synchronise the whole device, which
    inside a step could wait on a kernel that waits on a peer).

    By default nothing autotunes (``tuning``): a launch takes one config per (GPU kind,
    dtype, kernel, row bucket) and only compiles, so the strategy warms lazily in most modes
    and, under zebra/distep, only the row counts the plan brings (``warmup.warm_up_keys``).
    ``rows`` (one count or several) runs one count per row bucket (``tuning.m_bucket``);
    ``rows=None`` runs every bucket (``tuning.tuning_buckets``). On CUDA a count whose
    problem would need more than half the free memory is skipped, and so are the larger
    ones; with autotuning on, their row counts then take the largest tuned bucket's tiles
    (``tuning.tuned_up_to``), so nothing tunes inside a step. Tunings are also kept in
    Triton's disk cache. One synchronize at the end. Returns the row counts it ran.
    """
    import torch

    from .tuning import autotune_enabled, m_bucket, tuned_up_to, tuning_buckets
    from .mlp import grouped_mlp as impl

    device = torch.device(device)
    if rows is None:
        counts_to_run = tuning_buckets()
    else:
        by_bucket: dict[int, int] = {}
        for r in ([rows] if isinstance(rows, int) else list(rows)):
            by_bucket.setdefault(m_bucket(r), int(r))
        counts_to_run = [by_bucket[b] for b in sorted(by_bucket)]
    experts = max(int(experts), 1)
    h = 2 * d_ff if activation == "swiglu" else d_ff
    elem = torch.empty(0, dtype=dtype).element_size()
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, device=device, generator=g) * 0.02).to(dtype).requires_grad_()

    w_up, w_down = rand(experts, d_model, h), rand(experts, d_ff, d_model)
    b_up, b_down = (rand(experts, h), rand(experts, d_model)) if bias else (None, None)
    ran = []
    for n in counts_to_run:
        if device.type == "cuda":
            # x, y, dy, dx (+ fp32 rows of dx), h, dh, act(h), its gradient; weight gradients.
            need = n * (4 * d_model * elem + 8 * d_model + 2 * h * elem + 2 * d_ff * elem) \
                + 2 * experts * (d_model * h + d_ff * d_model) * elem
            if need > torch.cuda.mem_get_info(device)[0] // 2:
                if ran and autotune_enabled():
                    tuned_up_to(m_bucket(ran[-1]))  # larger counts take the top tuned bucket's tiles
                break
        x = rand(n, d_model)
        # the rows over (at most) the first two experts, the rest empty, as a skewed round
        split = [n // 2, n - n // 2] if experts > 1 else [n]
        counts = torch.tensor(split + [0] * (experts - len(split)), device=device)
        gather_idx = torch.arange(n, device=device)
        impl(x, gather_idx, counts, w_up, b_up, w_down, b_down, activation).float().sum().backward()
        ran.append(n)
        del x
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return ran


def __getattr__(name: str):
    # Lazy so that `import lightning_hetermoe.kernels` does not import triton.
    if name in ("grouped_gemm", "grouped_wgrad"):
        from . import launch

        return getattr(launch, name)
    if name == "GroupedMLPFunction":
        from .mlp import GroupedMLPFunction

        return GroupedMLPFunction
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _stand_aside() -> None:
    """This folder imported under the bare name ``kernels``: the checkout's root is on
    ``sys.path`` (``python -m pytest``, ``python -c`` run there). That name is Hugging Face's
    kernel hub package, which transformers (5.25 on) depends on and imports as soon as a model
    module loads: found here first, the import failed (``cannot import name 'CUDAProperties'
    from 'kernels'``). The next ``kernels`` on the path takes this module's place. Where there
    is none, this module stays, as before: transformers finds no version in it and uses no
    hub kernels."""
    import importlib.machinery
    import importlib.util
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.machinery.PathFinder.find_spec("kernels", [p for p in sys.path
                                                                if os.path.abspath(p or os.curdir) != root])
    if spec is None or spec.loader is None:
        return
    for name in [n for n in sys.modules if n.startswith("kernels.")]:
        del sys.modules[name]  # this folder's modules, which the imports above loaded under that name
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module  # the import statement returns what sys.modules holds once this module ran
    spec.loader.exec_module(module)


if __name__ == "kernels":
    _stand_aside()
