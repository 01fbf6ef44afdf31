"""Memory model: how many experts fit on a rank next to its other state.

Mixed-precision Adam keeps 16 bytes per parameter (fp16 weight and gradient, fp32 master
weight, Adam m and v). Activations follow activation checkpointing: each layer keeps its
input (and the MoE input, the boundary tensor of the expert round trip) for every token
still in flight, plus the working set of the one task being (re)computed. In zebra every
micro-batch's forward finishes before its backward starts, so all of a rank's tokens are
in flight at once; in EP/DistEP (gradient accumulation) only one micro-batch is.

The optimizer step has a peak of its own: the activations are gone, every gradient is
there, and the optimizer's temporaries are allocated beside them. torch's AdamW on a GPU
takes its multi-tensor path by default, which forms the square root of the second moment
for every parameter of a group at once: 4 bytes per parameter stepped (measured on CPU
under ``foreach=True``: 4.0; ``fused=True``: none). An expert rank, whose state is nearly all
it holds, peaks there: 20 bytes per expert parameter, not 16.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

from ..cluster.devices import DeviceSpec
from ..configs import ModelConfig, MoEConfig, OptimConfig

# Bytes of dense gradients per all-reduce in zebra's gradient sync (DDP's default bucket
# size); the strategy syncs in buckets of this size and the memory model prices one.
GRAD_BUCKET_BYTES = 25 * 2**20
# The head's loss (model/loss.py) sums the head weight's gradient in fp32 through the loss's
# forward, beside the weight in the compute dtype and each chunk's share before it is added
# (4 + 2 + 2 bytes per entry under 16-bit autocast, 4 + 4 in fp32), and in its backward
# returns it scaled, a second fp32 copy (4 + 4): a transient of the head's size.
HEAD_GRAD_BYTES = 8
# The dense gradients are fp32 (the weights' own width) whatever the autocast dtype.
GRAD_SYNC_ELEMENT_BYTES = 4

# A model is "small" while its whole training state (fp32 weights, gradients and AdamW's two
# moments: 16 bytes per parameter) stays within SMALL_STATE_BYTES. A small model is built
# whole by the recipe (init_on_meta: auto) and saved as Lightning's single checkpoint file by
# the strategy (checkpoint_format: auto); a larger one is built on the meta device and saved
# sharded, every rank its part.
SMALL_STATE_BYTES = 2e9
TRAINING_BYTES_PER_PARAM = 16
# Adam's multi-tensor step: one fp32 square root of the second moment per parameter stepped.
FOREACH_STEP_BYTES = 4.0
# A weight average kept on the device (Lightning's WeightAveraging, EMAWeightAveraging): one
# copy of every fp32 weight the rank holds, for the whole run.
AVERAGE_BYTES_PER_PARAM = 4.0


def hidden_activation(moe: MoEConfig, checkpointed: bool) -> tuple[int, bool]:
    """An expert's hidden activation per row (``d_ff``, twice that for SwiGLU's gate and up)
    and whether its backward recomputes it (``moe.recompute_activation``, or a model that
    checkpoints its blocks: its expert rounds too) instead of keeping it."""
    return moe.d_ff * (2 if moe.activation == "swiglu" else 1), moe.recompute_activation or checkpointed


def routed_row_values(d_model: int, moe: MoEConfig, checkpointed: bool) -> int:
    """:meth:`MemoryModel.expert_row_values` of a layer of width ``d_model`` whose experts are
    ``moe``, in a model that checkpoints its blocks or not."""
    hidden, recomputed = hidden_activation(moe, checkpointed)
    return 2 * d_model + (0 if recomputed else hidden)


def small_training_state(params: float) -> bool:
    """The training state of a model of ``params`` parameters is small (see ``SMALL_STATE_BYTES``)."""
    return params * TRAINING_BYTES_PER_PARAM <= SMALL_STATE_BYTES


# Bytes of fp32 state each optimizer keeps per parameter, by torch's class name lowercased
# (SGD's momentum buffer counted apart): the planner prices the ``optim`` config with it,
# the strategy's memory watch the live optimizer. Any other optimizer is priced as Adam.
OPTIMIZER_STATE_BYTES = {"adam": 8.0, "adamw": 8.0, "sgd": 0.0, "adagrad": 4.0, "rmsprop": 4.0}
SGD_MOMENTUM_BYTES = 4.0


def optimizer_state_bytes(name: str, momentum: bool = False) -> float:
    """Bytes of state per parameter of the optimizer called ``name`` (torch's class name or
    the ``optim`` config's; ``momentum``: SGD keeps a momentum buffer)."""
    key = name.lower()
    if key == "sgd":
        return SGD_MOMENTUM_BYTES if momentum else 0.0
    return OPTIMIZER_STATE_BYTES.get(key, OPTIMIZER_STATE_BYTES["adam"])


def optimizer_pricing(optim: OptimConfig | None) -> tuple[float, float]:
    """``(state, step)`` bytes per parameter of the pack's optimizer ``optim`` on a GPU: its
    state (Adam and AdamW two fp32 moments, 8; SGD with momentum its buffer, 4; plain SGD
    none) and its step's temporaries (torch's multi-tensor step, 4, as
    :func:`~lightning_hetermoe.strategy.memory_watch.optimizer_step_bytes` prices it; none
    for plain SGD, ``optim.fused=true`` and ``auto``, which the pack's model resolves to
    torch's fused step under ``HeterMoEStrategy``, whose precision plugin clips for it:
    ``model.lm.resolve_fused``). ``None``: AdamW's, unfused (an optimizer of the user's own,
    not known until set-up has planned)."""
    if optim is None:
        return 8.0, FOREACH_STEP_BYTES
    state = optimizer_state_bytes(optim.name, optim.momentum > 0)
    return state, (0.0 if state == 0.0 or optim.fused in (True, "auto") else FOREACH_STEP_BYTES)


@dataclass(frozen=True)
class MemoryModel:
    model: ModelConfig
    bytes_per_param: float = 16.0
    act_bytes: int = 2
    # Live [tokens, d] tensors while one attention block is recomputed and backpropagated.
    attention_working_tensors: int = 20
    # Of ``bytes_per_param``, AdamW's two fp32 moments: the part ZeRO-1 shards over the ranks
    # that hold the dense weights alike (strategy/zero.py).
    optimizer_bytes_per_param: float = 8.0
    # The optimizer step's temporaries per parameter it steps (see the module docstring):
    # torch's default AdamW on a GPU.
    optimizer_step_bytes_per_param: float = FOREACH_STEP_BYTES

    @classmethod
    def for_optimizer(cls, model: ModelConfig, optim: OptimConfig | None, weight_averages: int = 0,
                      **kw) -> "MemoryModel":
        """The memory model of ``model`` trained by ``optim`` (:func:`optimizer_pricing`):
        8 bytes a parameter for its fp32 weight and gradient, plus the optimizer's state,
        plus 4 for each of ``weight_averages`` averages kept on the device (not sharded:
        each rank averages what it holds)."""
        state, step = optimizer_pricing(optim)
        if isinstance(weight_averages, bool) or not isinstance(weight_averages, int) or weight_averages < 0:
            raise ValueError(f"weight_averages={weight_averages!r} is invalid: must be an integer >= 0 (copies of "
                             f"the weights kept on the device; Lightning's WeightAveraging keeps one)")
        return cls(model, bytes_per_param=8.0 + state + AVERAGE_BYTES_PER_PARAM * weight_averages,
                   optimizer_bytes_per_param=state, optimizer_step_bytes_per_param=step, **kw)

    # ---- parameter counts ----------------------------------------------------------------
    def attention_stack_params(self) -> float:
        """Everything but the routed experts: embeddings, LM head, attention (keys and values
        over the key/value heads), router, norms, a shared expert, the dense layers."""
        m = self.model
        d = m.d_model
        mats = 3 if m.moe.activation == "swiglu" else 2
        # queries and output n_heads x head_dim wide, keys and values over the kv heads, two norms
        attention = 2 * d * m.attention_width + 2 * d * (m.kv_heads * m.head_size) + 2 * d
        per_layer = attention + d * m.moe.num_experts
        if m.moe.shared_expert_d_ff:
            per_layer += mats * d * m.moe.shared_expert_d_ff + (d if m.moe.shared_expert_gate else 0)
        dense_layer = attention + mats * d * m.dense_d_ff
        return m.n_layers * per_layer + m.dense_layers * dense_layer + 2 * m.vocab_size * d + d

    def expert_params(self) -> float:
        m = self.model
        mats = 3 if m.moe.activation == "swiglu" else 2
        return mats * m.d_model * m.moe.d_ff

    def model_params(self) -> float:
        """The whole model: the attention stack and every layer's experts."""
        return self.attention_stack_params() + self.model.n_layers * self.model.moe.num_experts * self.expert_params()

    # ---- bytes ---------------------------------------------------------------------------
    def grad_sync_bytes(self) -> float:
        """What zebra's dense gradient sync holds beside the gradients: one bucket, or the
        whole dense part where that is smaller."""
        return min(GRAD_BUCKET_BYTES, self.attention_stack_params() * GRAD_SYNC_ELEMENT_BYTES)

    def attention_bytes(self, *, tokens_in_flight: float, mb_tokens: float, optimizer_share: float = 1.0) -> float:
        """Attention stack state + checkpoints of ``tokens_in_flight`` + one task's working set
        + the gradient sync's bucket. ``optimizer_share``: the part of the dense optimizer
        state this rank keeps (1: all of it; sharded over replicas: its range's share)."""
        m = self.model
        per_param = self.bytes_per_param - self.optimizer_bytes_per_param * (1.0 - optimizer_share)
        state = self.attention_stack_params() * per_param + self.grad_sync_bytes()
        ckpt = tokens_in_flight * (m.n_layers + m.dense_layers) * m.d_model * self.act_bytes * 2
        work = mb_tokens * self.attention_working_tensors * m.d_model * self.act_bytes
        # the loss, model.loss_chunk_tokens at a time (model/loss.py): the head's 16-bit output
        # beside its fp32 copy, which becomes the softmax's gradient in place; and, whatever
        # the batch, the head weight's gradient it sums in fp32 (beside the weight cast to the
        # compute dtype in the forward, then beside its scaled copy in the backward)
        work += min(mb_tokens, m.loss_chunk_tokens) * m.vocab_size * 6
        work += m.vocab_size * m.d_model * HEAD_GRAD_BYTES
        return state + ckpt + work

    def expert_row_values(self) -> int:
        """Values a routed row leaves on the rank whose expert ran it, until its backward: the
        row as received and the expert's answer (the round's record), and the expert's hidden
        activation, which its backward reads (``d_ff``, twice that for SwiGLU's gate and up):
        none under ``moe.recompute_activation`` (the expert recomputes it) or activation
        checkpointing (the round runs its experts again in its backward). At Mixtral's shape
        the hidden activation is 7 of every 8 values."""
        return routed_row_values(self.model.d_model, self.model.moe, self.model.activation_checkpointing)

    def expert_bytes(self, *, tokens_in_flight_per_expert: float) -> float:
        """One expert (one layer): state + what its rows in flight leave saved."""
        return (
            self.expert_params() * self.bytes_per_param
            + tokens_in_flight_per_expert * self.expert_row_values() * self.act_bytes
        )

    def expert_working_bytes(self, mb_tokens_per_expert: float) -> float:
        """One expert's part of its layer's round at its peak: a layer's experts run as one
        grouped call over all their rows of a micro-batch, which holds per row the hidden
        activation and its output (``d_ff``) and, in the backward, their gradients; the hidden
        activation (``d_ff``, twice that for SwiGLU) counts once more where it is recomputed
        there instead of kept with the rows in flight (:meth:`expert_row_values`)."""
        hidden, recomputed = hidden_activation(self.model.moe, self.model.activation_checkpointing)
        return mb_tokens_per_expert * (self.model.moe.d_ff + hidden + (hidden if recomputed else 0)) * self.act_bytes

    def dense_step_bytes(self, optimizer_share: float = 1.0) -> float:
        """An attention rank at its optimizer step: the attention stack's state (the part of
        the optimizer state it keeps) and the step's temporaries over the weights it steps
        (ZeRO: its range alone)."""
        return (self.attention_bytes(tokens_in_flight=0, mb_tokens=0, optimizer_share=optimizer_share)
                + self.attention_stack_params() * optimizer_share * self.optimizer_step_bytes_per_param)

    def expert_step_bytes(self) -> float:
        """One expert (one layer) at the optimizer step: its state and the step's temporaries."""
        return self.expert_params() * (self.bytes_per_param + self.optimizer_step_bytes_per_param)

    # ---- capacities ----------------------------------------------------------------------
    def attention_fits(self, dev: DeviceSpec, *, tokens_in_flight: float, mb_tokens: float,
                       optimizer_share: float = 1.0) -> bool:
        return max(self.attention_bytes(tokens_in_flight=tokens_in_flight, mb_tokens=mb_tokens,
                                        optimizer_share=optimizer_share),
                   self.dense_step_bytes(optimizer_share)) <= dev.usable_bytes

    def expert_capacity(
        self,
        dev: DeviceSpec,
        *,
        tokens_in_flight_per_expert: float,
        mb_tokens_per_expert: float,
        attention_tokens_in_flight: float = 0.0,
        attention_mb_tokens: float = 0.0,
        holds_attention: bool = False,
        optimizer_share: float = 1.0,
    ) -> int:
        """Whole experts that fit on ``dev`` (n_max on attention ranks; all layers); -1 if even the
        rest does not fit. They must fit twice: while the tokens are in flight (what their rows
        leave saved, and the working set of one layer's round, whose experts compute together:
        a layer's share of them, ``1 / n_layers`` each), and at the optimizer step (no
        activations; the step's temporaries over everything the rank steps)."""
        free = dev.usable_bytes
        at_step = dev.usable_bytes
        if holds_attention:
            free -= self.attention_bytes(tokens_in_flight=attention_tokens_in_flight, mb_tokens=attention_mb_tokens,
                                         optimizer_share=optimizer_share)
            at_step -= self.dense_step_bytes(optimizer_share)
        if free < 0 or at_step < 0:
            return -1
        each = self.expert_bytes(tokens_in_flight_per_expert=tokens_in_flight_per_expert) \
            + self.expert_working_bytes(mb_tokens_per_expert) / self.model.n_layers
        return int(min(free // each, at_step // self.expert_step_bytes()))

    def fewest_microbatches(self, members: Sequence[tuple[DeviceSpec, int | None, int]], seq_len: int) -> int | None:
        """Fewest micro-batches with which every member fits, one micro-batch in flight
        (gradient accumulation: EP, DistEP); ``None`` if not even one sequence each does.

        ``members``: (device, the sequences it attends or ``None`` where it holds no
        attention stack, the experts it holds over all layers). A member's sequences split
        as :func:`~lightning_hetermoe.apportion.split_microbatches` splits them, the first
        micro-batch the largest: the group's largest is every member's first together, and
        every expert sees its share of that."""
        k, E = self.model.moe.top_k, self.model.moe.num_experts
        alike = list(dict.fromkeys(members))  # hundreds of members, a few kinds: each checked once
        for R in range(1, max(s or 0 for _, s, _ in members) + 1):
            per_expert = sum(0 if s is None else math.ceil(s / R) for _, s, _ in members) * seq_len * k / E
            first = [None if s is None else math.ceil(s / R) for _, s, _ in alike]
            if all(self.expert_capacity(dev, tokens_in_flight_per_expert=per_expert, mb_tokens_per_expert=per_expert,
                                        attention_tokens_in_flight=(n or 0) * seq_len,
                                        attention_mb_tokens=(n or 0) * seq_len, holds_attention=n is not None)
                   >= held for (dev, _, held), n in zip(alike, first)):
                return R
        return None


def format_bytes(n: float) -> str:
    """``1.23 GB``, ``45.6 MB`` or ``789 kB``: readable at any model size."""
    for unit, size in (("GB", 1e9), ("MB", 1e6)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n / 1e3:.0f} kB"


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank needs: its training state (weights, their gradients, optimizer state)
    and its working set (activations of the tokens in flight; the transients of its mode:
    a layer's expert gradients being formed, gathered layers in data-centric mode, DDP's
    gradient buckets). The process itself (interpreter, libraries) is not counted."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    working: float
    # what the experts this rank holds keep for their backward: each routed row in flight
    # (MemoryModel.expert_row_values), the rank's tokens of the step at even routing
    expert_rows: float = 0.0
    layer: float = 0.0  # one MoE layer's experts, whole (what data-centric gathers to compute); not added
    # the optimizer step's temporaries: a peak of their own, once the activations are gone
    step: float = 0.0
    # weight averages kept on the device (Lightning's WeightAveraging: a copy of what the rank holds)
    averages: float = 0.0

    @property
    def state(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.averages

    @property
    def total(self) -> float:
        return self.state + max(self.activations + self.expert_rows + self.working, self.step)

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "state": self.state, "total": self.total}

    @classmethod
    def of(cls, *, dense_params: float, expert_params: float, dense_shards: int = 1, param_bytes: float = 4.0,
           optimizer_bytes: float = 8.0, activations: float = 0.0, working: float = 0.0, layer: float = 0.0,
           step: float | None = None, expert_rows: float = 0.0, averages: float = 0.0) -> "RankMemory":
        """From parameter counts: fp32 weights and gradients, the optimizer's
        ``optimizer_bytes`` per parameter (AdamW: 8), the dense part's split over
        ``dense_shards`` replicas (sharded optimizer state), and the optimizer step's
        temporaries: ``step`` bytes where the optimizer is known, else torch's default
        multi-tensor step over every parameter stepped."""
        held = dense_params + expert_params
        stepped = dense_params / max(dense_shards, 1) + expert_params
        return cls(weights=held * param_bytes, gradients=held * param_bytes, optimizer=stepped * optimizer_bytes,
                   activations=activations, working=working, layer=layer, expert_rows=expert_rows,
                   step=stepped * FOREACH_STEP_BYTES if step is None else step, averages=averages)


def working_bytes(mode: str, *, layer_expert_bytes: float, local_layer_expert_bytes: float, dense_bytes: float
                  ) -> float:
    """A mode's transients beside the state (bytes of the expert tensors of one layer, whole
    and as held here). Every backend forms a layer's expert gradients once, ``[E, ...]``,
    beside the gradient they accumulate into. Data-centric keeps two layers' full experts
    alive in the forward (one in use, the next prefetched) and, in the backward, one layer
    gathered again beside its full gradient. DDP (ep, data-centric) keeps its gradient
    buckets, the dense gradients' size; zebra and DistEP sum them through one bucket."""
    if mode == "datacentric":
        return 2 * layer_expert_bytes + dense_bytes
    buckets = dense_bytes if mode in ("ep", "ep_balanced") else 0.0
    if mode in ("zebra", "distep"):
        buckets = min(GRAD_BUCKET_BYTES, dense_bytes)
    return local_layer_expert_bytes + buckets


def activation_bytes(model: ModelConfig, *, tokens_in_flight: float, mb_tokens: float, act_bytes: int) -> float:
    """Saved activations of the tokens in flight and the working set of one task (see
    :meth:`MemoryModel.attention_bytes`). Without activation checkpointing every layer keeps
    its whole working set (``attention_working_tensors`` of ``[tokens, d_model]``) for every
    token in flight, not only its input."""
    mem = MemoryModel(model, act_bytes=act_bytes)
    out = mem.attention_bytes(tokens_in_flight=tokens_in_flight, mb_tokens=mb_tokens) \
        - mem.attention_stack_params() * mem.bytes_per_param - mem.grad_sync_bytes()
    if not model.activation_checkpointing:
        out += (tokens_in_flight * (model.n_layers + model.dense_layers) * model.d_model * act_bytes
                * (mem.attention_working_tensors - 2))
    return out


def spread_memory(model: ModelConfig, mode: str, devices: list[DeviceSpec], *, shard_optimizer_state: bool = True,
                  param_bytes: float = 4.0, optimizer_bytes: float = 8.0, weight_averages: int = 0,
                  ep_size: int | None = None) -> list[RankMemory]:
    """Each rank's state and mode transients under ``ep`` (experts split evenly, contiguous,
    over each EP group of ``ep_size`` consecutive ranks; ``None``: one group of every rank)
    or ``datacentric`` (every expert tensor split in proportion to device memory), the dense
    part on every rank (its optimizer state split over them when sharded), and
    ``weight_averages`` copies of what it holds; activations are not counted (they depend
    on the batch)."""
    mem = MemoryModel(model)
    W = len(devices)
    L, E = model.n_layers, model.moe.num_experts
    dense = mem.attention_stack_params()
    per_expert = mem.expert_params()
    layer_bytes = E * per_expert * param_bytes
    shards = W if shard_optimizer_state else 1
    if mode == "datacentric":
        total = sum(d.memory_gb for d in devices)
        held = [L * E * per_expert * d.memory_gb / total for d in devices]
        local = [h / L * param_bytes for h in held]
    elif mode in ("ep", "ep_balanced"):
        ep = ep_size or W
        counts = [E // ep + (1 if r % ep < E % ep else 0) for r in range(W)]
        held = [L * c * per_expert for c in counts]
        local = [c * per_expert * param_bytes for c in counts]
    else:
        raise ValueError(f"spread_memory prices ep and datacentric; {mode!r} takes its layout from a plan")
    return [RankMemory.of(dense_params=dense, expert_params=h, dense_shards=shards, param_bytes=param_bytes,
                          optimizer_bytes=optimizer_bytes, layer=layer_bytes,
                          averages=(dense + h) * AVERAGE_BYTES_PER_PARAM * weight_averages,
                          working=working_bytes(mode, layer_expert_bytes=layer_bytes, local_layer_expert_bytes=lo,
                                                dense_bytes=dense * param_bytes))
            for h, lo in zip(held, local)]
