"""The GPU self-check: the rules this pack relies on on a GPU, checked with one command.

    python -m lightning_hetermoe.selfcheck               # on the GPU (auto: cuda if available)
    python -m lightning_hetermoe.selfcheck --device cpu --quick --json out.json   # CI

Prints one row per check (``ok``, ``FAIL`` or ``skipped``, and what was seen), one summary
line, and exits 1 if anything failed. The checks:

* ``environment``: versions, the device and its compute capability, NCCL, bf16.
* ``kernels <dtype>``: the Triton expert MLP against the pure-torch path, output and every
  gradient, on ragged, empty-expert, single-expert and large-M cases. On CPU the kernels
  run through Triton's interpreter (small shapes).
* ``collectives ep`` / ``collectives zebra``: one-rank training under a real Trainer on a
  real process group (NCCL on CUDA, gloo on CPU); every recorded collective must carry
  its tensors where its traffic kind says, in sequences NCCL would accept.
* ``streams`` (CUDA): the zebra exchange's NCCL all-to-all kernels ran off the compute stream.
* ``memory``: what the zebra executor holds in a forward-only step does not grow with depth.

Everything runs in this one process, one check after the other; a check that raises
becomes a FAIL row and the others still run.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import logging
import os
import socket
import sys
import tempfile
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

OK, FAIL, SKIPPED = "ok", "FAIL", "skipped"


# -- report ---------------------------------------------------------------------------
@dataclass
class Row:
    check: str
    result: str  # ok, FAIL or skipped
    detail: str


class Skip(Exception):
    """The check cannot run here; the message says why."""


class Failed(Exception):
    """The check ran and found a problem; the message is the row's detail as it stands."""


@dataclass
class Context:
    device: torch.device
    quick: bool
    workdir: str  # run directories and checkpoints of the Trainer runs

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


@dataclass
class Check:
    name: str
    fn: Callable[[Context], str]  # returns the detail of a passing check
    cuda_only: bool = False


def run_check(check: Check, ctx: Context) -> Row:
    if check.cuda_only and not ctx.cuda:
        return Row(check.name, SKIPPED, "no CUDA")
    print(f"[selfcheck] {check.name} ...", file=sys.stderr, flush=True)
    try:
        # What Lightning and the strategy print (banners, the plan table) would bury the
        # table; stderr (warnings, tracebacks) stays visible.
        with contextlib.redirect_stdout(io.StringIO()):
            detail = check.fn(ctx)
    except Skip as why:
        return Row(check.name, SKIPPED, str(why))
    except Failed as problem:
        return Row(check.name, FAIL, str(problem))
    except Exception as err:  # any failure is a row; the traceback helps on the GPU day
        traceback.print_exc(file=sys.stderr)
        return Row(check.name, FAIL, f"{type(err).__name__}: {err}")
    return Row(check.name, OK, detail)


def run_checks(checks: Sequence[Check], ctx: Context) -> list[Row]:
    return [run_check(c, ctx) for c in checks]


def render(rows: Sequence[Row]) -> str:
    width = max([len("check")] + [len(r.check) for r in rows])
    lines = [f"{'check':<{width}}  {'result':<7}  detail", f"{'-' * width}  {'-' * 7}  {'-' * 6}"]
    lines += [f"{r.check:<{width}}  {r.result:<7}  {r.detail}" for r in rows]
    return "\n".join(lines)


def summary(rows: Sequence[Row]) -> str:
    counts = Counter(r.result for r in rows)
    verdict = "FAILED" if counts[FAIL] else "passed"
    return (f"selfcheck {verdict}: {counts[OK]} ok, {counts[FAIL]} failed, {counts[SKIPPED]} skipped "
            f"of {len(rows)} checks")


def exit_code(rows: Sequence[Row]) -> int:
    return 1 if any(r.result == FAIL for r in rows) else 0


# -- shared pieces --------------------------------------------------------------------
SEQ, EXPERTS, GLOBAL_BATCH = 16, 4, 8


def _tiny_model(n_layers: int = 2) -> Any:
    from . import ModelConfig, MoEConfig, MoELanguageModel, OptimConfig

    torch.manual_seed(0)
    cfg = ModelConfig(d_model=16, n_layers=n_layers, n_heads=2, max_seq_len=SEQ,
                      moe=MoEConfig(num_experts=EXPERTS, d_ff=12))
    return MoELanguageModel(cfg, OptimConfig())


def _data() -> Any:
    from . import ByteCorpusDataModule, DataConfig

    # two batches per epoch: two steps end the epoch, so validation runs without extra settings
    dm = ByteCorpusDataModule(DataConfig(seq_len=SEQ, batch_size=GLOBAL_BATCH, seed=7,
                                         train_windows=2 * GLOBAL_BATCH, val_windows=2 * GLOBAL_BATCH))
    dm.setup()
    return dm


def _loopback_plan(ctx: Context, n_layers: int = 2) -> Any:
    """One rank that attends and holds every expert: zebra's exchange talks to itself."""
    from .plan import Plan, ZPGroup

    return Plan(model="selfcheck", cluster="selfcheck", seq_len=SEQ, devices=[ctx.device.type], roles=["attention"],
                zp_groups=[ZPGroup(attention_ranks=[0], expert_ranks=[])], num_microbatches=2,
                seqs_per_rank=[GLOBAL_BATCH], placement=[[0] * EXPERTS for _ in range(n_layers)],
                base_counts=[[EXPERTS] * n_layers])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainer(ctx: Context, strategy: Any, name: str, **kwargs: Any) -> Any:
    import lightning as L

    # Each run starts its own one-rank process group (the strategy does, as under a
    # launcher); a fresh port keeps it clear of the last run's store.
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())
    settings = dict(default_root_dir=os.path.join(ctx.workdir, name), accelerator="gpu" if ctx.cuda else "cpu",
                    devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    settings.update(kwargs)
    return L.Trainer(strategy=strategy, **settings)


def _end_run(strategy: Any) -> None:
    """Leave the run's process group, so the next run starts its own (even after a failure)."""
    import torch.distributed as dist

    import lightning_hetermoe.comm as comm
    from .strategy import heartbeat

    try:
        strategy.shutdown()
    except Exception:
        heartbeat.stop()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        comm.forget()


@contextlib.contextmanager
def _one_run(ctx: Context, name: str, mode: str, plan: Any = None, **trainer_kwargs: Any) -> Iterator[tuple]:
    from . import HeterMoEStrategy

    strategy = HeterMoEStrategy(mode=mode, plan=plan)
    try:
        yield strategy, _trainer(ctx, strategy, name, **trainer_kwargs)
    finally:
        _end_run(strategy)


# -- 1. environment -------------------------------------------------------------------
def check_environment(ctx: Context) -> str:
    import lightning

    from .kernels import unavailable_reason

    parts = [f"torch {torch.__version__}", f"lightning {lightning.__version__}", _triton_version(ctx)]
    if ctx.device.type == "cuda":
        if not torch.cuda.is_available():
            raise Failed("--device cuda, but CUDA is not available in this process")
        name = torch.cuda.get_device_name(ctx.device)
        major, minor = torch.cuda.get_device_capability(ctx.device)
        nccl = torch.cuda.nccl.version()
        nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        bf16 = "yes" if (major, minor) >= (8, 0) else "no (compute capability < 8.0)"
        parts += [f"device {name} (sm {major}.{minor})", f"CUDA {torch.version.cuda}", f"NCCL {nccl}",
                  f"bf16 {bf16}"]
    else:
        parts += ["device cpu", "NCCL n/a (no CUDA)", "bf16 n/a (cpu)"]
    why = unavailable_reason(ctx.device)
    if why:
        parts.append(f"triton kernels unavailable: {why}")
    return ", ".join(parts)


def _triton_version(ctx: Context) -> str:
    try:
        import triton
    except Exception as err:
        return f"triton not importable ({type(err).__name__}: {err})"
    return f"triton {triton.__version__}"


# -- 2. kernels -----------------------------------------------------------------------
# Largest |triton - reference| over the largest |reference|, per tensor. The reference is
# grouped_mlp_torch in fp32 on the same (rounded) inputs, so the bound is the dtype's own
# rounding: fp32 allows for a different summation order; bf16 keeps 8 mantissa bits,
# fp16 11, and each gradient passes through two to three roundings in that dtype.
KERNEL_TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass
class KernelCase:
    name: str
    counts: list[int]  # rows per expert
    activation: str
    tokens: int  # rows of x; gather_idx repeats them as top-k routing does


@dataclass
class KernelShapes:
    d_model: int
    d_ff: int
    cases: list[KernelCase] = field(default_factory=list)


def kernel_shapes(ctx: Context) -> KernelShapes:
    # d_model and d_ff are not multiples of the interpreter's blocks (16/32) nor of the
    # GPU's, so partial tiles are exercised; counts are not multiples of BLOCK_M.
    if ctx.cuda:
        d_model, d_ff, large = (96, 160, 2048) if ctx.quick else (200, 344, 8192)
    else:
        d_model, d_ff, large = (40, 24, 96) if ctx.quick else (72, 56, 512)
    ragged_large = [large * w // 16 for w in (1, 5, 3, 7)]
    ragged_large[-1] += large - sum(ragged_large)
    cases = [KernelCase("ragged", [7, 19, 11, 30], "swiglu", 41),
             KernelCase("one-empty", [9, 0, 21], "gelu", 23),
             KernelCase("single", [37], "swiglu", 29),
             KernelCase(f"large M={large}", ragged_large, "gelu", large // 2)]
    return KernelShapes(d_model, d_ff, cases)


GRAD_NAMES = ("x", "w_up", "b_up", "w_down", "b_down")


def _kernel_inputs(case: KernelCase, shapes: KernelShapes, dtype: torch.dtype, device: torch.device,
                   seed: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, w_up, b_up, w_down, b_down)`` in ``dtype``, gather_idx, counts, upstream gradient."""
    g = torch.Generator(device=device).manual_seed(seed)
    E, d, f = len(case.counts), shapes.d_model, shapes.d_ff
    h = 2 * f if case.activation == "swiglu" else f

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device=device, generator=g) * scale).to(dtype)

    tensors = [randn(case.tokens, d), randn(E, d, h, scale=d ** -0.5), randn(E, h, scale=0.1),
               randn(E, f, d, scale=f ** -0.5), randn(E, d, scale=0.1)]
    counts = torch.tensor(case.counts, dtype=torch.long, device=device)
    M = sum(case.counts)
    gather_idx = torch.randint(0, case.tokens, (M,), device=device, generator=g)
    upstream = randn(M, d)
    return tensors, gather_idx, counts, upstream


def _forward_backward(fn: Callable, tensors: list[torch.Tensor], gather_idx: torch.Tensor, counts: torch.Tensor,
                      upstream: torch.Tensor, activation: str) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    x, w_up, b_up, w_down, b_down = leaves
    y = fn(x, gather_idx, counts, w_up, b_up, w_down, b_down, activation)
    y.backward(upstream.to(y.dtype))
    return y.detach(), [t.grad for t in leaves]


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if expected.numel() == 0:
        return 0.0
    scale = expected.abs().max().clamp_min(1e-6)
    return float((actual.float() - expected.float()).abs().max() / scale)


def _compare_case(case: KernelCase, shapes: KernelShapes, dtype: torch.dtype, ctx: Context, seed: int
                  ) -> tuple[float, float, list[str]]:
    """The case's worst relative error, the torch path's own in ``dtype`` (what rounding alone
    costs, for scale), and what broke the contract outright."""
    from .kernels import grouped_mlp
    from .moe import grouped_mlp_torch

    tensors, gather_idx, counts, upstream = _kernel_inputs(case, shapes, dtype, ctx.device, seed)
    got_y, got_grads = _forward_backward(grouped_mlp, tensors, gather_idx, counts, upstream, case.activation)
    want_y, want_grads = _forward_backward(grouped_mlp_torch, [t.float() for t in tensors], gather_idx, counts,
                                           upstream.float(), case.activation)
    torch_y, torch_grads = _forward_backward(grouped_mlp_torch, tensors, gather_idx, counts, upstream,
                                             case.activation)
    expected = [want_y, *want_grads]
    own = max(_relative_error(a, b) for a, b in zip([torch_y, *torch_grads], expected) if a is not None)
    problems, worst = [], 0.0
    for what, got, want in zip(("output", *GRAD_NAMES), [got_y, *got_grads], expected):
        if got is None:
            problems.append(f"{case.name}: no gradient for {what}")
            continue
        if got.shape != want.shape or got.dtype != dtype:
            problems.append(f"{case.name}: {what} is {got.dtype} {tuple(got.shape)}, want {dtype} "
                            f"{tuple(want.shape)}")
            continue
        err = _relative_error(got, want)
        worst = max(worst, err)
        if not err <= KERNEL_TOL[dtype]:  # also catches NaN
            problems.append(f"{case.name}: {what} off by {err:.1e} (tol {KERNEL_TOL[dtype]:.0e})")
    for e in (e for e, n in enumerate(case.counts) if n == 0):
        # an expert without rows must get exact zeros, not whatever was in the buffer
        dw_up, dw_down = got_grads[1], got_grads[3]
        if dw_up is not None and dw_down is not None and (dw_up[e].abs().max() != 0 or dw_down[e].abs().max() != 0):
            problems.append(f"{case.name}: expert {e} has no rows but a non-zero weight gradient")
    return worst, own, problems


def check_kernels(dtype: torch.dtype) -> Callable[[Context], str]:
    def check(ctx: Context) -> str:
        from .kernels import unavailable_reason

        why = unavailable_reason(ctx.device)
        if why:
            raise Skip(why)
        if dtype == torch.bfloat16 and ctx.cuda and torch.cuda.get_device_capability(ctx.device) < (8, 0):
            raise Skip("bf16 needs compute capability >= 8.0")
        shapes = kernel_shapes(ctx)
        worst, own, problems = 0.0, 0.0, []
        for seed, case in enumerate(shapes.cases):
            err, torch_err, found = _compare_case(case, shapes, dtype, ctx, seed)
            worst, own, problems = max(worst, err), max(own, torch_err), problems + found
        where = "GPU" if ctx.cuda else "interpreter"
        detail = (f"{len(shapes.cases)} cases ({', '.join(c.name for c in shapes.cases)}), d_model "
                  f"{shapes.d_model}, d_ff {shapes.d_ff}, {where}: worst error {worst:.1e} vs fp32 "
                  f"(tol {KERNEL_TOL[dtype]:.0e}; torch path in {DTYPE_NAMES[dtype]}: {own:.1e})")
        if problems:
            raise Failed(_joined(problems) + "; " + detail)
        return detail

    return check


LARGE_ROWS = 4_500_000  # past 65535 row tiles of 64: where a grid axis other than 0 stops launching


def check_large_gemm(ctx: Context) -> str:
    """One grouped GEMM over 4.5M rows (reachable in data-centric mode, where every rank runs
    every expert on its tokens) against torch, expert by expert."""
    from .kernels import unavailable_reason
    from .kernels.launch import grouped_gemm

    why = unavailable_reason(ctx.device)
    if why:
        raise Skip(why)
    E, K, N = 4, 64, 64
    g = torch.Generator(device=ctx.device).manual_seed(0)
    x = torch.randn(LARGE_ROWS, K, device=ctx.device, dtype=torch.float16, generator=g)
    w = torch.randn(E, K, N, device=ctx.device, dtype=torch.float16, generator=g) / K ** 0.5
    counts = torch.tensor([LARGE_ROWS // 2, LARGE_ROWS // 4, 0, LARGE_ROWS - 3 * (LARGE_ROWS // 4)],
                          device=ctx.device, dtype=torch.int64)
    out = grouped_gemm(x, w, counts)
    worst, start = 0.0, 0
    for e, n in enumerate(counts.tolist()):
        want = x[start:start + n].float() @ w[e].float()
        if n:
            worst = max(worst, _relative_error(out[start:start + n].float(), want))
        start += n
    detail = f"{LARGE_ROWS:,} rows over {E} experts (one without rows), fp16: worst error {worst:.1e} vs fp32"
    if not worst <= KERNEL_TOL[torch.float16]:
        raise Failed(detail)
    return detail


def check_receive_order(ctx: Context) -> str:
    """A receive posted into a freshly allocated buffer behind a long queued kernel: the
    buffer is likely the block a queued kernel still reads; the communication stream must
    wait for it (``comm.issuing``), or the kernel reads what arrived."""
    import torch.distributed as dist

    from . import comm

    started_here = not dist.is_initialized()
    if started_here:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=ctx.device)
    try:
        comm.configure(ctx.device)
        n = 1 << 24
        old = torch.ones(n, device=ctx.device)
        torch.cuda._sleep(200_000_000)  # ~0.1 s of spinning ahead of the read, on the compute stream
        total = old.sum()  # queued: reads the block after the spin
        del old  # the block goes back to the allocator while the read is still queued
        buffer = torch.empty(n, device=ctx.device)
        sent = torch.full((n,), 2.0, device=ctx.device)
        with comm.issuing(after=[sent]):
            pending = comm.all_to_all(comm.world(), buffer, sent, [n], [n], what="selfcheck.receive", async_op=True)
        pending.wait()
        got, arrived = float(total), float(buffer[0])
    finally:
        comm.forget()
        if started_here:
            dist.destroy_process_group()
    detail = f"a kernel queued behind 0.1 s read {got:,.0f} of {n:,} ones; the receive brought {arrived:g}s"
    if got != n or arrived != 2.0:
        raise Failed(detail)
    return detail


# -- 3. collectives -------------------------------------------------------------------
def _traffic_problems(calls: Sequence[Any], compute: str) -> list[str]:
    import lightning_hetermoe.comm as comm

    out = []
    for c in calls:
        if c.traffic == comm.DEVICE and c.device != compute:
            out.append(f"{c.what} (device traffic) carried a tensor on {c.device}, the compute device is {compute}")
        if c.traffic == comm.HOST and c.device not in ("", "cpu"):
            out.append(f"{c.what} (host traffic) carried a tensor on {c.device}, not the CPU")
    return out


def _joined(problems: Sequence[str], most: int = 4) -> str:
    more = f"; and {len(problems) - most} more" if len(problems) > most else ""
    return "; ".join(problems[:most]) + more


def _count_by_what(calls: Sequence[Any]) -> str:
    counts = Counter(c.what for c in calls)
    return ", ".join(f"{what} {n}" for what, n in sorted(counts.items()))


def check_collectives(mode: str) -> Callable[[Context], str]:
    expected = {"ep": {"ep.rows"}, "zebra": {"zebra.rows", "zebra.answers"}}[mode]

    def check(ctx: Context) -> str:
        from lightning.pytorch.callbacks import ModelCheckpoint

        import lightning_hetermoe.comm as comm

        plan = _loopback_plan(ctx) if mode == "zebra" else None
        ckpt = ModelCheckpoint(dirpath=os.path.join(ctx.workdir, f"ckpt-{mode}"), every_n_train_steps=1,
                               save_top_k=-1)
        with comm.record() as calls:
            with _one_run(ctx, f"collectives-{mode}", mode, plan, max_steps=2, limit_val_batches=1,
                          enable_checkpointing=True, callbacks=[ckpt]) as (strategy, trainer):
                trainer.fit(_tiny_model(), datamodule=_data())
                compute = str(strategy.root_device)
                schedule = strategy.schedule
        problems = _traffic_problems(calls, compute) + comm.check_sequences([calls])
        missing = expected - {c.what for c in calls}
        if missing:  # without them the check above would be vacuous
            problems.append(f"no {', '.join(sorted(missing))} collective was issued")
        if schedule != mode:
            problems.append(f"the strategy ran {schedule!r}, not {mode!r}")
        if problems:
            raise Failed(_joined(problems))
        return f"{len(calls)} collectives on {compute}: {_count_by_what(calls)}"

    return check


# -- 4. streams -----------------------------------------------------------------------
_ALL_TO_ALL_KERNELS = ("sendrecv", "alltoall", "all_to_all")


def _kernels_by_stream(prof: Any, path: str) -> list[tuple[str, int]]:
    """``(kernel name, stream)`` of every device kernel in the profile (Kineto's trace format)."""
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    return [(e.get("name", ""), int(e.get("args", {}).get("stream", e.get("tid", -1))))
            for e in events if str(e.get("cat", "")).lower() == "kernel"]


def check_streams(ctx: Context) -> str:
    import lightning as L
    from torch.profiler import ProfilerActivity, profile

    class StepProfile(L.Callback):
        """The last training step alone (set-up broadcasts and autotuning left out)."""

        def __init__(self) -> None:
            self.prof: Any = None
            self.running = False

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 1:
                torch.cuda.synchronize(ctx.device)
                self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                self.prof.start()
                self.running = True

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self.running:
                torch.cuda.synchronize(ctx.device)
                self.stop()

        def on_exception(self, trainer, pl_module, exception):
            self.stop()  # a profiler left running would record the checks after this one

        def stop(self) -> None:
            if self.running:
                self.running = False
                self.prof.stop()

    probe = StepProfile()
    # step 0 warms up (communicators, kernels); step 1 is the one profiled
    with _one_run(ctx, "streams", "zebra", _loopback_plan(ctx), max_steps=2, callbacks=[probe]) as (_, trainer):
        trainer.fit(_tiny_model(), datamodule=_data())
    if probe.prof is None:
        raise Failed("the profiled step never ran")
    return judge_streams(_kernels_by_stream(probe.prof, os.path.join(ctx.workdir, "streams-trace.json")))


def judge_streams(kernels: Sequence[tuple[str, int]]) -> str:
    """Pass when every NCCL all-to-all kernel ran off the compute stream (the stream most
    non-NCCL kernels ran on); ``kernels`` are ``(name, stream)`` of one profiled step."""
    nccl = [(n, s) for n, s in kernels if "nccl" in n.lower()]
    a2a = [(n, s) for n, s in nccl if any(k in n.lower() for k in _ALL_TO_ALL_KERNELS)]
    compute = Counter(s for n, s in kernels if "nccl" not in n.lower())
    if not compute:
        raise Failed(f"no compute kernel in the profiled step ({len(kernels)} kernels)")
    compute_stream = compute.most_common(1)[0][0]
    a2a_streams = Counter(s for _, s in a2a)
    detail = (f"compute stream {compute_stream} ({compute[compute_stream]} kernels); NCCL all-to-all on streams "
              f"{dict(a2a_streams)}; every NCCL kernel: {dict(Counter(n for n, _ in nccl))}")
    if not a2a:
        raise Failed("no NCCL all-to-all kernel in the profiled step; " + detail)
    if compute_stream in a2a_streams:
        raise Failed(f"{a2a_streams[compute_stream]} NCCL all-to-all kernels ran on the compute stream; " + detail)
    return detail


# -- 5. memory ------------------------------------------------------------------------
MEMORY_DEPTHS = (2, 4)
MEMORY_GROWTH = 1.25  # deeper models may hold at most this much more between tasks


def _held_in_validation(ctx: Context, n_layers: int) -> tuple[list[int], int | None]:
    """Bytes the executor held after each task of the last forward-only step, and the
    device's peak allocation over the run (CUDA)."""
    import lightning as L

    class AccountMemory(L.Callback):
        # The backend exists only once the strategy set up; the steps come after.
        def on_validation_start(self, trainer, pl_module):
            trainer.strategy.backend.account_memory = True

    if ctx.cuda:
        gc.collect()  # the last run's model may still sit in a reference cycle, counted in the peak
        torch.cuda.reset_peak_memory_stats(ctx.device)
    with _one_run(ctx, f"memory-{n_layers}", "zebra", _loopback_plan(ctx, n_layers), limit_val_batches=2,
                  callbacks=[AccountMemory()]) as (strategy, trainer):
        trainer.validate(_tiny_model(n_layers), datamodule=_data(), verbose=False)
        last = strategy.backend.last_eval
    peak = torch.cuda.max_memory_allocated(ctx.device) if ctx.cuda else None
    if last is None or not last.held_bytes:
        raise Failed(f"{n_layers} layers: no forward-only step was accounted")
    return last.held_bytes, peak


def check_memory(ctx: Context) -> str:
    held, peaks = {}, {}
    for n in MEMORY_DEPTHS:
        held[n], peaks[n] = _held_in_validation(ctx, n)
    shallow, deep = (max(held[n]) for n in MEMORY_DEPTHS)
    detail = ", ".join(f"{n} layers: max {max(held[n])} B held after a task" for n in MEMORY_DEPTHS)
    if ctx.cuda:
        detail += "; CUDA peak per layer: " + ", ".join(f"{n} layers {peaks[n] / n / 2 ** 20:.2f} MiB"
                                                        for n in MEMORY_DEPTHS)
    problems = []
    if shallow == 0:  # the growth bound below would hold vacuously
        problems.append("nothing was ever held: the accounting saw no rows in flight")
    elif deep > MEMORY_GROWTH * shallow:
        problems.append(f"{MEMORY_DEPTHS[1]} layers held {deep / shallow:.2f}x the {MEMORY_DEPTHS[0]}-layer "
                        f"bytes (limit {MEMORY_GROWTH}x)")
    left = {n: held[n][-1] for n in MEMORY_DEPTHS if held[n][-1]}
    if left:
        problems.append(f"bytes still held after the last task: {left}")
    if problems:
        raise Failed("; ".join(problems) + "; " + detail)
    return detail


def _sync_debug_callback(step: int = 1) -> Any:
    """A Lightning callback that turns CUDA's sync debug mode on for one training step (the
    second: the first warms the allocator and autotunes)."""
    import lightning as L

    class SyncDebug(L.Callback):
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == step:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("warn")

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            torch.cuda.set_sync_debug_mode("default")

    return SyncDebug()


def check_host_syncs(ctx: Context) -> str:
    """Host syncs in one zebra training step (a loopback plan: every exchange goes through
    comm on one GPU), counted by CUDA's sync debug mode: the design allows one per (layer,
    micro-batch), the round's host header; every other drains the queue zebra overlaps on."""
    import warnings

    n_layers, plan = 2, _loopback_plan(ctx)
    with warnings.catch_warnings(record=True) as seen:  # module state: the fibers' warnings land here too
        warnings.simplefilter("always")
        with _one_run(ctx, "syncs", "zebra", plan, max_steps=2, callbacks=[_sync_debug_callback()]) as (_, trainer):
            trainer.fit(_tiny_model(n_layers), datamodule=_data())
    syncs = [w for w in seen if "synchroniz" in str(w.message).lower()]
    per = len(syncs) / (n_layers * plan.num_microbatches)
    where = sorted({f"{os.path.basename(w.filename)}:{w.lineno}" for w in syncs})
    detail = (f"{len(syncs)} host syncs in a step of {n_layers} layers x {plan.num_microbatches} micro-batches: "
              f"{per:.1f} per (layer, micro-batch); at " + (", ".join(where[:6]) or "nowhere"))
    if per > 1:
        raise Failed(detail + " (the design allows 1)")
    return detail


# -- the registry and the command -----------------------------------------------------
CHECKS: list[Check] = [
    Check("environment", check_environment),
    *(Check(f"kernels {name}", check_kernels(dtype)) for dtype, name in DTYPE_NAMES.items()),
    Check("kernels 4.5M rows", check_large_gemm, cuda_only=True),
    Check("receive order", check_receive_order, cuda_only=True),
    Check("host syncs", check_host_syncs, cuda_only=True),
    Check("collectives ep", check_collectives("ep")),
    Check("collectives zebra", check_collectives("zebra")),
    Check("streams", check_streams, cuda_only=True),
    Check("memory", check_memory),
]


def select(checks: Sequence[Check], only: str | None) -> list[Check]:
    return [c for c in checks if only is None or c.name.startswith(only)]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lightning_hetermoe.selfcheck",
                                description="Check the GPU rules of lightning-hetermoe on this machine.")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: cuda if available; cpu runs what can run without a GPU (gloo, Triton's interpreter)")
    p.add_argument("--quick", action="store_true", help="smaller shapes (CI)")
    p.add_argument("--only", metavar="NAME", help="run only the checks whose name starts with NAME")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    return p.parse_args(argv)


def resolve_device(choice: str) -> torch.device:
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device("cuda", torch.cuda.current_device()) if choice == "cuda" and torch.cuda.is_available() \
        else torch.device(choice)


@contextlib.contextmanager
def _environment(device: torch.device) -> Iterator[None]:
    """For the checks' duration: Triton's interpreter on CPU (the kernels read the variable
    per launch, so a scoped setting is enough), and Lightning's banners muted."""
    saved = os.environ.get("TRITON_INTERPRET")
    if device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    loggers = [logging.getLogger(n) for n in ("lightning", "lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


def run(args: argparse.Namespace, checks: Sequence[Check] = CHECKS) -> int:
    """Run ``checks`` as the command line says, print the table, return the exit code."""
    device = resolve_device(args.device)
    chosen = select(checks, args.only)
    if not chosen:
        print(f"selfcheck: no check's name starts with {args.only!r}; checks: "
              f"{', '.join(c.name for c in checks)}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="hetermoe-selfcheck-") as workdir, _environment(device):
        rows = run_checks(chosen, Context(device=device, quick=args.quick, workdir=workdir))
    print(render(rows))
    print(summary(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "quick": args.quick, "rows": [asdict(r) for r in rows]}, f, indent=2)
    return exit_code(rows)


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
