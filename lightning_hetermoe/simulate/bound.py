"""The throughput no schedule can beat on a cluster: every device busy all the time on the
work it is relatively fastest at, no communication, no memory limit.

A token's training work is two kinds: its attention (every layer's attention and router,
forward and backward, and its share of the LM head) and its experts (``top_k`` expert MLPs
per layer, forward and backward). Device ``d`` spends ``a_d`` seconds per token on the
first and ``e_d`` on the second. The most tokens per second a cluster can train is a
linear program (split each device's second between the two kinds so that both kinds keep
up with the same token rate); with two kinds its optimum gives attention to the devices
with the smallest ``a_d / e_d`` first, experts to the rest, and splits at most one device:
a scan over the sorted devices finds it.

Each kind is priced at the largest size a step can run it at, where its fixed costs (a
launch, an expert's weights read) weigh least per token: a whole batch's attention in one
call, each expert's even share of the batch's choices in one call. Priced per sequence, a
small model's launches made the "bound" slower than the schedules it bounds (the tiny model
on an A40 and a V100: zebra predicted at 221% of it).
"""

from __future__ import annotations

from typing import Sequence

from ..cluster.devices import DeviceSpec
from ..configs import ModelConfig


def per_token_seconds(dev: DeviceSpec, timer, model: ModelConfig, seq_len: int,
                      batch_tokens: float) -> tuple[float, float]:
    """(attention, experts) seconds per token of training on ``dev`` for a forward and
    backward over ``batch_tokens`` tokens (a step's batch, or one wave of it): the attention
    of all of them in one call, each expert its even share of their choices in one call
    (an expert that gets no tokens at all in a step is the one way to beat it)."""
    if batch_tokens < seq_len:
        raise ValueError(f"throughput bound: batch_tokens={batch_tokens!r} is invalid: must be at least one "
                         f"sequence (seq_len={seq_len})")
    L, k, E = model.n_layers, model.moe.top_k, model.moe.num_experts
    T = float(batch_tokens)
    attention = L * (timer.attention(dev, T) + timer.attention(dev, T, backward=True))
    attention = (attention + timer.head(dev, T)) / T
    rows = max(T * k / E, 1.0)
    experts = L * k * (timer.expert(dev, rows) + timer.expert(dev, rows, backward=True)) / rows
    return attention, experts


def throughput_bound(devices: Sequence[DeviceSpec], timer, model: ModelConfig, seq_len: int,
                     batch_tokens: float) -> float:
    """Tokens per second of the best split of the two kinds of work over ``devices``, for
    steps of ``batch_tokens`` tokens (see :func:`per_token_seconds`)."""
    if not devices:
        raise ValueError("throughput_bound: no devices")
    costs: dict[str, tuple[float, float, int]] = {}
    for d in devices:  # devices of one kind are interchangeable: price each kind once
        if d.name not in costs:
            costs[d.name] = (*per_token_seconds(d, timer, model, seq_len, batch_tokens), 0)
        a, e, n = costs[d.name]
        costs[d.name] = (a, e, n + 1)
    kinds = sorted(costs.values(), key=lambda c: c[0] / c[1])
    # A device's second gives 1/a tokens of attention or 1/e of experts. With the first j
    # kinds on attention, the rest on experts, and kind j split by a fraction f of its
    # devices' time, the token rate is min(attention rate, expert rate): equal at the best f.
    attention_rate = [0.0]
    for a, _, n in kinds:
        attention_rate.append(attention_rate[-1] + n / a)
    expert_rate = [0.0]
    for _, e, n in reversed(kinds):
        expert_rate.append(expert_rate[-1] + n / e)
    expert_rate.reverse()  # expert_rate[j]: kinds j.. on experts
    best = 0.0
    for j, (a, e, n) in enumerate(kinds):
        before, after = attention_rate[j], expert_rate[j + 1]
        # kind j gives f of its time to attention: before + f*n/a == after + (1-f)*n/e
        f = (after + n / e - before) / (n / a + n / e)
        f = min(max(f, 0.0), 1.0)
        best = max(best, min(before + f * n / a, after + (1 - f) * n / e))
    return best
