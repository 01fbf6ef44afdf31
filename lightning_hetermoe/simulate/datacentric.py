"""The data-centric step (HEXA-MoE), priced in closed form.

What :class:`~lightning_hetermoe.strategy.backends.datacentric.DataCentricBackend` runs: every rank
takes a speed-proportional share of the batch and runs *every* expert on its own tokens;
per layer, the layer's full experts are all-gathered in the forward (overlapping the
previous layer's compute), all-gathered again in the backward (the expert computation is
recomputed there, not stored) and their gradient reduce-scattered. The collectives are
synchronous across ranks, so the slowest rank sets the step. Against expert parallelism
the trade is visible in the terms: no all-to-all of ``tokens * top_k`` rows, but three
moves of a layer's expert weights per layer and step.
"""

from __future__ import annotations

from typing import Sequence

from ..cluster.spec import LinkConfig
from ..cluster.topology import Topology, as_topology
from ..cluster.devices import DeviceSpec
from ..configs import ModelConfig
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
                          link: LinkConfig | Topology, timer, expert_load: list[list[float]] | None = None) -> float:
    """Device seconds of one step; raises ``ValueError`` where a rank's memory cannot hold
    its shard of the experts (with their optimizer state), the dense model and two layers
    of full experts."""
    W = len(devs)
    if W == 0:
        raise ValueError("the data-centric mode needs at least one rank")
    mem = MemoryModel(model)
    L, E, k = model.n_layers, model.moe.num_experts, model.moe.top_k
    weights = layer_weight_bytes(model, timer)
    link = as_topology(link, W).ring_link(range(W))  # every collective is a ring over all ranks
    total_memory = sum(d.memory_gb for d in devs)
    for d in devs:
        held = (L * E * mem.expert_params() * mem.bytes_per_param * d.memory_gb / total_memory
                + mem.attention_stack_params() * mem.bytes_per_param + 2 * weights)
        if held > d.memory_gb * 1e9:
            raise ValueError(f"data-centric: {d.name} cannot hold its expert shard, the dense model and two layers "
                             f"of full experts ({held / 1e9:.1f} GB > {d.memory_gb} GB)")
    # ring collectives: each rank moves W - 1 chunks, padded to the largest range
    fraction = max(d.memory_gb for d in devs) / total_memory * (W - 1)
    move = weight_move_seconds(model, timer, link, fraction)
    scatter = weight_move_seconds(model, timer, link, fraction, grads=True)
    seqs = datacentric_shares(devs, model, seq_len, total_seqs, timer)
    slowest = 0.0
    for d, n in zip(devs, seqs):
        tokens = n * seq_len
        t = timer.head(d, tokens)
        for l in range(L):
            share = expert_load[l] if expert_load is not None else [1.0 / E] * E
            fwd_experts = sum(timer.expert(d, tokens * k * s) for s in share if s > 0)
            bwd_experts = sum(timer.expert(d, tokens * k * s, backward=True) for s in share if s > 0)
            attention = timer.attention(d, tokens), timer.attention(d, tokens, backward=True)
            t += attention[0] + max(fwd_experts, move)  # the next layer's gather hides behind this layer
            t += move + fwd_experts + bwd_experts + attention[1] + scatter  # re-gather, recompute, reduce-scatter
        slowest = max(slowest, t)
    tail = timer.grad_sync(mem.attention_stack_params(), W, link) + max(
        timer.optimizer(d, mem.attention_stack_params() + L * E * mem.expert_params() * d.memory_gb / total_memory)
        for d in devs)
    return slowest + tail
