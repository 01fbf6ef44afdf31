"""The data-centric step (HEXA-MoE), priced in closed form.

What :class:`~lightning_hetermoe.strategy.backends.datacentric.DataCentricBackend` runs: every rank
takes a speed-proportional share of the batch and runs *every* expert on its own tokens;
per layer, the layer's full experts are all-gathered in the forward (overlapping the
previous layer's compute), all-gathered again in the backward (the expert computation is
recomputed there, not stored) and their gradient reduce-scattered. The collectives are
synchronous across ranks, layer by layer: each rank's clock is walked through the step and
every gather and reduce-scatter starts when the last rank reaches it, so a rank heavy on
experts and one heavy on attention wait for each other at every layer (per-rank sums, the
slowest taken, missed 10-17% of the step on emulated A40+V100 at 16K). Against expert parallelism
the trade is visible in the terms: no all-to-all of ``tokens * top_k`` rows, but three
moves of a layer's expert weights per layer and step (a gather each way, each issued
ahead of its use, and a reduce-scatter; with checkpointed blocks the backward's recompute
and the experts' own share one gather).
"""

from __future__ import annotations

from typing import Sequence

from ..cluster.spec import LinkConfig
from ..cluster.topology import Topology, as_topology
from ..cluster.devices import DeviceSpec
from ..configs import ModelConfig, OptimConfig
from ..profile.memory import MemoryModel
from .schedules import ep_balanced_shares, ep_speed


def layer_weight_bytes(model: ModelConfig, timer, grads: bool = False) -> float:
    """One MoE layer's expert weights as they travel: gathered at the run's compute width,
    their gradients reduce-scattered at the gradient sync's (``grads``)."""
    per = timer.cost.grad_bytes if grads else timer.cost.dtype_bytes
    return model.moe.num_experts * MemoryModel(model).expert_params() * per


def weight_move_seconds(model: ModelConfig, timer, link: LinkConfig, move_fraction: float,
                        grads: bool = False) -> float:
    """One gather (or, ``grads``, reduce-scatter) of a layer's experts: each rank moves
    ``move_fraction`` of the layer (``(W - 1)`` padded chunks of the largest range, over
    the whole layer) through its link."""
    if move_fraction <= 0:
        return 0.0
    return timer.comm(layer_weight_bytes(model, timer, grads) * move_fraction, link)


def datacentric_shares(devs: Sequence[DeviceSpec], model: ModelConfig, seq_len: int, total_seqs: int,
                       timer) -> list[int]:
    return ep_balanced_shares(total_seqs, [ep_speed(d, timer, model, seq_len) for d in devs])


def datacentric_step_time(devs: Sequence[DeviceSpec], model: ModelConfig, *, seq_len: int, total_seqs: int,
                          link: LinkConfig | Topology, timer, expert_load: list[list[float]] | None = None,
                          optimizer: OptimConfig | None = None, weight_averages: int = 0) -> float:
    """Device seconds of one step; raises ``ValueError`` where a rank's memory cannot hold
    its shard of the experts (with ``optimizer``'s state and ``weight_averages`` copies of
    the weights), the dense model and two layers
    of full experts, or the shard and the dense model with the optimizer step's temporaries."""
    W = len(devs)
    if W == 0:
        raise ValueError("the data-centric mode needs at least one rank")
    mem = MemoryModel.for_optimizer(model, optimizer, weight_averages)
    L, E = model.n_layers, model.moe.num_experts
    weights = layer_weight_bytes(model, timer)
    link = as_topology(link, W).ring_link(range(W))  # every collective is a ring over all ranks
    total_memory = sum(d.memory_gb for d in devs)
    kinds = set(devs)  # ranks of one device kind hold and run alike: price each kind once
    for d in kinds:
        params = L * E * mem.expert_params() * d.memory_gb / total_memory + mem.attention_stack_params()
        held = params * mem.bytes_per_param + 2 * weights
        if held > d.memory_gb * 1e9:
            raise ValueError(f"data-centric: {d.name} cannot hold its expert shard, the dense model and two layers "
                             f"of full experts ({held / 1e9:.1f} GB > {d.memory_gb} GB)")
        # at the optimizer step the gathered layers are gone and the step's temporaries are there
        at_step = params * (mem.bytes_per_param + mem.optimizer_step_bytes_per_param)
        if at_step > d.memory_gb * 1e9:
            raise ValueError(f"data-centric: {d.name} cannot hold its expert shard and the dense model at the "
                             f"optimizer step ({at_step / 1e9:.1f} GB > {d.memory_gb} GB with the step's temporaries)")
    # ring collectives: each rank moves W - 1 chunks, padded to the largest range
    fraction = max(d.memory_gb for d in devs) / total_memory * (W - 1)
    move = weight_move_seconds(model, timer, link, fraction)
    scatter = weight_move_seconds(model, timer, link, fraction, grads=True)
    seqs = datacentric_shares(devs, model, seq_len, total_seqs, timer)
    # ranks alike in device and share clock alike: the synchronised step over the distinct
    # ones is the step over all of them
    work = [_rank_work(d, n * seq_len, model, timer, expert_load) for d, n in dict.fromkeys(zip(devs, seqs))]
    slowest = _synchronised_step(work, L, move, scatter, recompute=bool(timer.cost.activation_checkpointing))
    tail = timer.grad_sync(mem.attention_stack_params(), W, link) + max(
        timer.optimizer(d, mem.attention_stack_params() + L * E * mem.expert_params() * d.memory_gb / total_memory)
        for d in kinds)
    return slowest + tail


def _rank_work(d: DeviceSpec, tokens: int, model: ModelConfig, timer,
               expert_load: list[list[float]] | None) -> dict[str, list[float] | float]:
    """One rank's compute: per layer attention and experts, forward and backward; the head."""
    E, k = model.moe.num_experts, model.moe.top_k
    out: dict[str, list[float] | float] = {"head": timer.head(d, tokens), "attn_fwd": [], "attn_bwd": [],
                                           "experts_fwd": [], "experts_bwd": []}
    for l in range(model.n_layers):
        share = expert_load[l] if expert_load is not None else [1.0 / E] * E
        out["attn_fwd"].append(timer.attention(d, tokens))
        out["attn_bwd"].append(timer.attention(d, tokens, backward=True))
        out["experts_fwd"].append(sum(timer.expert(d, tokens * k * s) for s in share if s > 0))
        out["experts_bwd"].append(sum(timer.expert(d, tokens * k * s, backward=True) for s in share if s > 0))
    return out


def _synchronised_step(work: list[dict], L: int, move: float, scatter: float, recompute: bool = False) -> float:
    """Each rank's clock through one step, the collectives synchronising them layer by layer:
    a layer's gather completes ``move`` after the last rank issued it (the forward's is
    issued as the previous layer's experts start, so it hides behind them); in the backward
    every rank gathers again (issued as the layer above's reduce-scatter ends, so it hides
    behind that layer's attention backward), recomputes and runs its experts' backward, then
    the reduce-scatter starts when the last rank reaches it, and the block's backward follows.
    Per-rank sums would miss the waits: a rank with more expert work and less attention
    than another waits for it at every layer's reduce-scatter, and the other at the next.

    ``recompute``: the blocks are checkpointed, so a block's backward first runs its forward
    again: the attention, a gather and the experts (whose own recompute then runs on the
    weights that gather brought: no second gather); the backward tasks are what is left of
    their recomputing price."""
    clock = [0.0] * len(work)
    issued = None  # when the last rank issued the next layer's gather
    for l in range(L):
        ready = [c + w["attn_fwd"][l] for c, w in zip(clock, work)]
        issued = max(ready) if issued is None else issued  # layer 0's gather leaves with the experts' first need
        start = [max(r, issued + move) for r in ready]
        issued = max(start)  # the next layer's gather, prefetched as this layer's experts start
        clock = [s + w["experts_fwd"][l] for s, w in zip(start, work)]
    clock = [c + w["head"] for c, w in zip(clock, work)]
    issued = None  # when the last rank issued the layer's backward gather (the layer above's scatter)
    for l in reversed(range(L)):
        again = [(w["attn_fwd"][l], w["experts_fwd"][l]) if recompute else (0.0, 0.0) for w in work]
        # the backward gathers the layer again, for the block's recompute (its attention
        # first) where the blocks are checkpointed, else for the experts' own recompute:
        # the top layer's when the last rank needs it, every other issued ahead
        ready = [c + a for c, (a, _) in zip(clock, again)]
        start = [max(r, (max(ready) if issued is None else issued) + move) for r in ready]
        # the experts' recompute and backward on those weights; where the block's recompute
        # ran them too, that forward is the one a checkpointed block's experts_bwd holds
        reached = [s + w["experts_fwd"][l] + w["experts_bwd"][l] for s, w in zip(start, work)]
        scattered = max(reached) + scatter
        issued = scattered  # the layer below's gather leaves once this layer's is scattered
        clock = [scattered + w["attn_bwd"][l] - a for w, (a, _) in zip(work, again)]
    return max(clock)
