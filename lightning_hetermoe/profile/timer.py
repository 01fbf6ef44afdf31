"""One interface for task durations, backed by a measured Profile or by the CostModel.

The planner and the simulator ask a :class:`TaskTimer` and never care where numbers come
from: :class:`CostModelTimer` computes them, :class:`ProfileTimer` interpolates measured
ones (and falls back to the cost model for what the profiler does not measure: the LM
head, the optimizer step, the network).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..cluster.spec import LinkConfig
from ..cluster.devices import DeviceSpec
from ..configs import ModelConfig
from .cost_model import CostModel
from .profile import Profile


@dataclass(frozen=True)
class CostModelTimer:
    model: ModelConfig
    seq_len: int
    cost: CostModel = field(default_factory=CostModel)

    def __post_init__(self) -> None:
        if self.cost.activation_checkpointing is None:
            # the model's own: a run that recomputes pays a forward more in each backward
            object.__setattr__(self, "cost", replace(self.cost, activation_checkpointing=bool(
                self.model.activation_checkpointing)))

    def attention(self, dev: DeviceSpec, tokens: float, backward: bool = False) -> float:
        """One MoE layer's attention-side task (attention, router, shared expert) and its
        share of the dense layers (see :meth:`dense_share`)."""
        own = self.block_attention(dev, tokens, backward)
        return own + self.dense_share(dev, tokens, backward) if self.model.dense_layers else own

    def dense_share(self, dev: DeviceSpec, tokens: float, backward: bool = False) -> float:
        """The dense layers' time on ``tokens`` tokens over the MoE layers, ``dense_layers /
        n_layers`` of one dense layer each: they run where attention runs, between the same
        exchanges, so every schedule prices them inside the attention tasks (spread evenly,
        not at the first layers where they sit: the same work on the same ranks, the
        pipeline's fill a layer's dense share shorter)."""
        m = self.model
        one = self.cost.dense_layer_time(dev, tokens=tokens, seq_len=self.seq_len, d_model=m.d_model,
                                         n_heads=m.n_heads, d_ff=m.dense_d_ff, activation=m.moe.activation,
                                         backward=backward, kv_heads=m.kv_heads, head_dim=m.head_size)
        return m.dense_layers / m.n_layers * one

    def block_attention(self, dev: DeviceSpec, tokens: float, backward: bool = False) -> float:
        """One MoE layer's own attention-side task, by the cost model (what a profile measures)."""
        m = self.model
        return self.cost.attention_time(
            dev,
            tokens=tokens,
            seq_len=self.seq_len,
            d_model=m.d_model,
            n_heads=m.n_heads,
            num_experts=m.moe.num_experts,
            backward=backward,
            shared_d_ff=m.moe.shared_expert_d_ff,
            shared_activation=m.moe.activation,
            shared_gate=m.moe.shared_expert_gate,
            kv_heads=m.kv_heads,
            head_dim=m.head_size,
        )

    def expert(self, dev: DeviceSpec, tokens: float, backward: bool = False) -> float:
        m = self.model
        return self.cost.expert_time(
            dev, tokens=tokens, d_model=m.d_model, d_ff=m.moe.d_ff, activation=m.moe.activation, backward=backward,
            recompute_hidden=m.moe.recompute_activation)

    def experts(self, dev: DeviceSpec, tokens, backward: bool = False):
        """:meth:`expert` of every element of ``tokens`` at once (each to the last bit)."""
        return self.expert(dev, tokens, backward)

    def head(self, dev: DeviceSpec, tokens: float, forward_only: bool = False) -> float:
        return self.cost.head_time(dev, tokens=tokens, d_model=self.model.d_model, vocab_size=self.model.vocab_size,
                                   forward_only=forward_only)

    def optimizer(self, dev: DeviceSpec, n_params: float) -> float:
        return self.cost.optimizer_time(dev, n_params)

    def comm(self, nbytes: float, link: LinkConfig) -> float:
        return self.cost.comm_time(nbytes, link)

    def transfer(self, rows: float, link: LinkConfig) -> float:
        """One leg of an expert exchange whose busiest link moves ``rows`` hidden-state rows."""
        return self.comm(rows * self.model.d_model * self.cost.dtype_bytes, link)

    def allreduce(self, nbytes: float, n_ranks: int, link: LinkConfig) -> float:
        return self.cost.allreduce_time(nbytes, n_ranks, link)

    def grad_sync(self, n_params: float, n_ranks: int, link: LinkConfig) -> float:
        """The gradients of ``n_params`` weights summed over ``n_ranks`` (at the gradient
        sync's width, see :attr:`CostModel.grad_bytes`)."""
        return self.allreduce(n_params * self.cost.grad_bytes, n_ranks, link)


@dataclass(frozen=True)
class ProfileTimer(CostModelTimer):
    """Measured attention/expert/head times; cost model for the rest."""

    profile: Profile | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.profile is None:
            raise ValueError("ProfileTimer needs a profile")
        if self.profile.seq_len != self.seq_len:
            raise ValueError(
                f"profile was measured at seq_len={self.profile.seq_len}, the plan asks for {self.seq_len}: re-profile"
            )

    def attention(self, dev: DeviceSpec, tokens: float, backward: bool = False) -> float:
        measured = self.profile.get(dev.name).attention(tokens, backward)
        if not self.model.dense_layers or measured <= 0:
            return measured
        # the profiler times an MoE block's attention; the dense layers at the cost model's
        # ratio to it, so they run at the speed measured
        return measured * (1.0 + self.dense_share(dev, tokens, backward) / self.block_attention(dev, tokens, backward))

    def expert(self, dev: DeviceSpec, tokens: float, backward: bool = False) -> float:
        return self.profile.get(dev.name).expert(tokens, backward)

    def head(self, dev: DeviceSpec, tokens: float, forward_only: bool = False) -> float:
        measured = self.profile.get(dev.name).head(tokens)
        if measured is None:
            return super().head(dev, tokens, forward_only)
        # measured forward + backward; the forward is a third of it (backward = 2 x forward)
        return measured / 3.0 if forward_only else measured


def make_timer(model: ModelConfig, seq_len: int, profile: Profile | None = None, cost: CostModel | None = None):
    cost = cost or CostModel()
    if profile is not None:
        return ProfileTimer(model=model, seq_len=seq_len, cost=cost, profile=profile)
    return CostModelTimer(model=model, seq_len=seq_len, cost=cost)


class CachedTimer:
    """A timer that remembers each task's duration: a search asks the same few questions
    (one device kind, one token count) thousands of times. Everything else is the wrapped
    timer's (``experts`` too: an array of a layer's experts at one routing seldom comes
    twice)."""

    def __init__(self, timer) -> None:
        self.inner = timer
        self._memo: dict[tuple, float] = {}

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def _ask(self, key: tuple, compute) -> float:
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def attention(self, dev: DeviceSpec, tokens: float, backward: bool = False) -> float:
        return self._ask(("a", dev.name, tokens, backward), lambda: self.inner.attention(dev, tokens, backward))

    def expert(self, dev: DeviceSpec, tokens: float, backward: bool = False) -> float:
        return self._ask(("x", dev.name, tokens, backward), lambda: self.inner.expert(dev, tokens, backward))

    def head(self, dev: DeviceSpec, tokens: float, forward_only: bool = False) -> float:
        return self._ask(("h", dev.name, tokens, forward_only),
                         lambda: self.inner.head(dev, tokens, forward_only=forward_only))
