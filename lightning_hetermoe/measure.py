"""The profiler: measures, on each device kind, what the planner needs.

For the configured model and sequence length it times, on one rank of each device kind:

* attention + router of one layer (a real :class:`~lightning_hetermoe.model.transformer.DecoderBlock`
  whose experts are skipped) for micro-batches of a few sequence counts, forward and backward;
* one expert MLP on a few token counts, forward and backward;
* the LM head with its loss (final norm + head + cross-entropy, forward and backward);

and works out how many experts a rank of that kind holds next to its other state
(:class:`~lightning_hetermoe.profile.memory.MemoryModel` over the device's usable memory;
on CUDA the memory is the one the device reports).

On emulated ranks (``cluster.emulate``) the very same code runs with the rank's emulated
clock installed on the block (:mod:`lightning_hetermoe.emulate`), so the figures are the
emulated device's: measured wall time divided by ``cluster.time_scale``. The LM head is
not emulated, so emulated profiles leave ``head_s`` empty (the planner then takes it from
the cost model).

With ``torch.distributed`` initialised every rank must call :func:`profile_cluster`; the
first rank of each kind measures and the results are exchanged with
``all_gather_object`` so that every rank returns the same :class:`Profile`. Without it,
one process measures every kind it can: all of them when emulated, else the local GPU's.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from .cluster import ClusterConfig
from .cluster.devices import DeviceSpec, detect_cuda_devices, get_device, match_device_name
from .configs import ConfigError, ModelConfig, from_cfg
from .emulate import Emulator, emulation_cost_model, install
from .model.loss import linear_cross_entropy
from .model.transformer import DecoderBlock, RMSNorm
from .profile.cost_model import CostModel
from .profile.memory import MemoryModel
from .profile.profile import DeviceProfile, Profile
from .profile.timer import CostModelTimer, make_timer

log = logging.getLogger(__name__)

DEFAULT_ATTENTION_SEQS = (1, 2, 4, 8)
DEFAULT_EXPERT_TOKENS = (32, 128, 512, 2048)


class _NoExperts:
    """A dispatcher that skips the experts: the block then runs attention + router only."""

    def __call__(self, x: Tensor, indices: Tensor, keep: Tensor | None, experts) -> Tensor:
        return x.new_zeros(indices.numel(), x.shape[-1])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fwd_bwd_times(forward: Callable[[], Tensor], params: Sequence[nn.Parameter], device: torch.device,
                   repeats: int, warmup: int) -> tuple[float, float]:
    """Median forward and backward seconds of ``forward()`` (a scalar-producing closure)."""
    fwd, bwd = [], []
    for i in range(warmup + repeats):
        for p in params:
            p.grad = None
        _sync(device)
        t0 = time.perf_counter()
        out = forward()
        _sync(device)
        t1 = time.perf_counter()
        out.backward()
        _sync(device)
        t2 = time.perf_counter()
        if i >= warmup:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return statistics.median(fwd), statistics.median(bwd)


def _default_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def measure_device(
    model_cfg: ModelConfig | dict,
    spec: DeviceSpec,
    *,
    seq_len: int,
    attention_seqs: Sequence[int] = DEFAULT_ATTENTION_SEQS,
    expert_tokens: Sequence[int] = DEFAULT_EXPERT_TOKENS,
    emulator=None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    repeats: int = 5,
    warmup: int = 1,
    seed: int = 0,
) -> DeviceProfile:
    """Measure one device kind here. ``emulator`` (an :class:`~lightning_hetermoe.emulate.Emulator`)
    makes this process play ``spec``; figures are then divided by its ``time_scale``."""

    cfg = from_cfg(ModelConfig, model_cfg)
    if seq_len < 1 or seq_len > cfg.max_seq_len:
        raise ConfigError(f"profile: seq_len={seq_len} is invalid: must be in [1, model.max_seq_len={cfg.max_seq_len}]")
    device = torch.device(device) if device is not None else torch.device("cpu")
    dtype = dtype or _default_dtype(device)
    scale = emulator.time_scale if emulator is not None else 1.0
    gen = torch.Generator().manual_seed(seed)

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        block = DecoderBlock(cfg).to(device=device, dtype=dtype)
        head = nn.Sequential(RMSNorm(cfg.d_model), nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)).to(device, dtype)
    block.moe.dispatcher = _NoExperts()
    handle = install(block, emulator) if emulator is not None else None
    threads = torch.get_num_threads()
    if emulator is not None:
        # The emulated clock hides CPU speed; one thread avoids OpenMP stalls on busy cores.
        torch.set_num_threads(1)
    try:
        attn_f: dict[int, float] = {}
        attn_b: dict[int, float] = {}
        head_s: dict[int, float] = {}
        params = list(block.parameters())
        for n in sorted(set(int(s) for s in attention_seqs)):
            if n < 1:
                raise ConfigError(f"profile: attention_seqs must be >= 1, got {n}")
            x = torch.randn(n, seq_len, cfg.d_model, generator=gen).to(device, dtype).requires_grad_()

            def attention(x=x) -> Tensor:
                y, aux = block(x)
                return y.float().sum() + aux.balance_loss.float()

            f, b = _fwd_bwd_times(attention, params + [x], device, repeats, warmup)
            attn_f[n * seq_len], attn_b[n * seq_len] = f / scale, b / scale
            if emulator is None:
                tgt = torch.randint(0, cfg.vocab_size, (n, seq_len), generator=gen).to(device)

                def lm_head(x=x, tgt=tgt) -> Tensor:  # as the pack's model runs it, a chunk at a time
                    return linear_cross_entropy(head[0](x), head[1].weight, tgt, chunk=cfg.loss_chunk_tokens)

                hf, hb = _fwd_bwd_times(lm_head, list(head.parameters()) + [x], device, repeats, warmup)
                head_s[n * seq_len] = hf + hb

        exp_f: dict[int, float] = {}
        exp_b: dict[int, float] = {}
        experts = block.moe.experts
        eparams = list(experts.parameters())
        for t in sorted(set(int(t) for t in expert_tokens)):
            if t < 1:
                raise ConfigError(f"profile: expert_tokens must be >= 1, got {t}")
            x = torch.randn(t, cfg.d_model, generator=gen).to(device, dtype).requires_grad_()
            idx = torch.arange(t, device=device)
            counts = torch.zeros(experts.num_local_experts, dtype=torch.long, device=device)
            counts[0] = t  # one expert on t tokens

            def one_expert(x=x, idx=idx, counts=counts) -> Tensor:
                return experts(x, idx, counts).float().sum()

            f, b = _fwd_bwd_times(one_expert, eparams + [x], device, repeats, warmup)
            exp_f[t], exp_b[t] = f / scale, b / scale
    finally:
        torch.set_num_threads(threads)
        if handle is not None:
            handle.remove()

    mem_spec = spec
    if device.type == "cuda" and emulator is None:
        total = torch.cuda.get_device_properties(device).total_memory
        mem_spec = DeviceSpec.from_dict({**spec.to_dict(), "memory_gb": total / 1e9})
    n_max, n_exp = expert_capacities(cfg, mem_spec, mb_tokens=max(attention_seqs) * seq_len)
    return DeviceProfile(
        device=spec.name, attention_fwd_s=attn_f, attention_bwd_s=attn_b, expert_fwd_s=exp_f, expert_bwd_s=exp_b,
        head_s=head_s, memory_gb=mem_spec.memory_gb, max_experts_attention=n_max, max_experts_expert=n_exp,
    )


def expert_capacities(cfg: ModelConfig, spec: DeviceSpec, *, mb_tokens: int) -> tuple[int, int]:
    """(experts an attention rank holds next to the attention stack, experts an expert rank holds).

    One micro-batch of ``mb_tokens`` in flight; the experts see ``mb_tokens * top_k / E``
    tokens each. -1 means not even the rest of the state fits."""
    mem = MemoryModel(cfg)
    per_expert = mb_tokens * cfg.moe.top_k / cfg.moe.num_experts
    common = dict(tokens_in_flight_per_expert=per_expert, mb_tokens_per_expert=per_expert)
    n_max = mem.expert_capacity(spec, holds_attention=True, attention_tokens_in_flight=mb_tokens,
                                attention_mb_tokens=mb_tokens, **common)
    n_exp = mem.expert_capacity(spec, holds_attention=False, **common)
    return n_max, n_exp


def _rank_kinds(cluster: ClusterConfig | None) -> list[str]:
    """Device kind of every rank (cluster config names, else CUDA detection)."""
    import torch.distributed as dist

    if cluster is not None:
        return [get_device(n, cluster.custom_devices).name for n in cluster.devices]

    if torch.cuda.is_available():
        return [d.name for d in detect_cuda_devices()]
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return ["cpu"] * world


def profile_cluster(
    model_cfg: ModelConfig | dict,
    cluster: ClusterConfig | dict | None = None,
    *,
    seq_len: int,
    attention_seqs: Sequence[int] = DEFAULT_ATTENTION_SEQS,
    expert_tokens: Sequence[int] = DEFAULT_EXPERT_TOKENS,
    repeats: int = 5,
    warmup: int = 1,
    cost_model=None,
    device: torch.device | str | None = None,
) -> Profile:
    """A :class:`Profile` with one entry per device kind of ``cluster`` (see module docstring).

    ``cost_model`` is the emulated clock's (default
    :func:`~lightning_hetermoe.emulate.emulation_cost_model`)."""
    import torch.distributed as dist


    cfg = from_cfg(ModelConfig, model_cfg)
    cl = from_cfg(ClusterConfig, cluster) if cluster is not None else None
    emulate = bool(cl is not None and cl.emulate)
    kinds = _rank_kinds(cl)
    distributed = dist.is_available() and dist.is_initialized()
    if distributed and dist.get_world_size() != len(kinds):
        raise ConfigError(f"profile: cluster names {len(kinds)} ranks, the process group has {dist.get_world_size()}")
    rank = dist.get_rank() if distributed else 0
    first_rank = {}
    for r, k in enumerate(kinds):
        first_rank.setdefault(k, r)

    if distributed:
        mine = [k for k, r in first_rank.items() if r == rank]
    elif emulate or cl is None:
        mine = list(first_rank)
    else:
        here = _local_kind(device)
        mine = [k for k in first_rank if k == here]
        missing = sorted(set(first_rank) - set(mine))
        if missing:
            raise ConfigError(f"profile: cannot measure {missing} from this process (it has {here!r}); run one "
                             "process per rank, or set cluster.emulate=true")
    kw = dict(seq_len=seq_len, attention_seqs=attention_seqs, expert_tokens=expert_tokens, repeats=repeats,
              warmup=warmup)
    results: dict[str, DeviceProfile] = {}
    for k in mine:
        spec = get_device(k, cl.custom_devices if cl is not None else None)
        emulator = None
        if emulate:
            timer = make_timer(cfg, seq_len, cost=cost_model or emulation_cost_model())
            emulator = Emulator(spec, timer, link=cl.bottleneck_link, time_scale=cl.time_scale)
        dev = device if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if (torch.cuda.is_available() and not emulate) else "cpu")
        log.info(f"profile: measuring {k}{' (emulated)' if emulate else ''} on {dev}")
        results[k] = measure_device(cfg, spec, emulator=emulator, device=dev, **kw)
        if emulator is not None and emulator.needed_time_scale > 0:
            log.warning(f"profile: emulated {k} overran its modelled times; time_scale >= "
                        f"{emulator.needed_time_scale:.0f} would be faithful")
    if distributed:
        from . import comm

        gathered = comm.gather_objects(comm.world(), {k: v.__dict__ for k, v in results.items()}, what="profile.devices")
        results = {}
        for part in gathered:
            for k, v in (part or {}).items():
                results[k] = DeviceProfile(**v)
    source = "emulated" if emulate else "measured"
    return Profile(model=cfg.name, seq_len=seq_len, devices={k: results[k] for k in first_rank if k in results},
                   source=source)


def _local_kind(device) -> str:
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):

        name = torch.cuda.get_device_name(device)
        return match_device_name(name) or name.lower()
    return "cpu"


# ---- Hydra entry (recipes/profile_devices.py) ----------------------------------------------------
def run_profile(cfg) -> Profile:
    """Profile from a composed ``conf/profile.yaml`` (model, data, cluster, profile).

    Under ``torchrun`` (``WORLD_SIZE`` > 1) it joins a process group first (NCCL on real
    GPUs, gloo when emulated) so each rank measures its own device kind."""
    import os

    import torch.distributed as dist
    from omegaconf import OmegaConf

    cfg_model = from_cfg(ModelConfig, cfg.model)
    cluster = from_cfg(ClusterConfig, cfg.cluster)
    p = OmegaConf.to_container(cfg.profile, resolve=True)
    unknown = sorted(set(p) - {"seq_len", "attention_seqs", "expert_tokens", "repeats", "warmup"})
    if unknown:
        raise ConfigError(f"profile: unknown field(s) {unknown}")
    seq_len = int(p.get("seq_len") or cfg.data.seq_len)
    seqs = sorted(set(int(s) for s in p.get("attention_seqs") or DEFAULT_ATTENTION_SEQS) | {int(cfg.data.batch_size)})
    created = False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() and not cluster.emulate else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
        created = True
    try:
        return profile_cluster(cfg_model, cluster, seq_len=seq_len, attention_seqs=seqs,
                               expert_tokens=p.get("expert_tokens") or DEFAULT_EXPERT_TOKENS,
                               repeats=int(p.get("repeats", 5)), warmup=int(p.get("warmup", 1)))
    finally:
        if created:
            dist.destroy_process_group()


def profile_summary(profile: Profile, cfg=None, cost_model=None) -> dict[str, Any]:
    """Headline figures per device kind, beside the cost model's for the same tasks."""

    cfg_model = from_cfg(ModelConfig, cfg.model) if cfg is not None else None
    cluster = from_cfg(ClusterConfig, cfg.cluster) if cfg is not None else None
    cm = cost_model or (emulation_cost_model() if profile.source == "emulated" else CostModel())
    out: dict[str, Any] = {"model": profile.model, "seq_len": profile.seq_len, "source": profile.source,
                           "cluster": cluster.name if cluster else None, "devices": {}}
    for kind, dp in profile.devices.items():
        n_att = max(dp.attention_fwd_s)
        n_exp = max(dp.expert_fwd_s)
        row = {
            "attention_tokens": n_att,
            "attention_fwd_ms": dp.attention_fwd_s[n_att] * 1e3,
            "attention_bwd_ms": dp.attention_bwd_s.get(n_att, float("nan")) * 1e3,
            "expert_tokens": n_exp,
            "expert_fwd_ms": dp.expert_fwd_s[n_exp] * 1e3,
            "expert_bwd_ms": dp.expert_bwd_s.get(n_exp, float("nan")) * 1e3,
            "memory_gb": dp.memory_gb,
            "max_experts_attention": dp.max_experts_attention,
            "max_experts_expert": dp.max_experts_expert,
        }
        if cfg_model is not None:
            spec = get_device(kind, cluster.custom_devices if cluster else None)
            m = cfg_model
            row["cost_model_attention_fwd_ms"] = CostModelTimer(m, profile.seq_len, cm).block_attention(spec, n_att) * 1e3
            row["cost_model_expert_fwd_ms"] = cm.expert_time(
                spec, tokens=n_exp, d_model=m.d_model, d_ff=m.moe.d_ff, activation=m.moe.activation) * 1e3
        out["devices"][kind] = row
    return out
