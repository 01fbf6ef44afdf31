"""Memory model: how many experts fit on a rank next to its other state.

Mixed-precision Adam keeps 16 bytes per parameter (fp16 weight and gradient, fp32 master
weight, Adam m and v). Activations follow activation checkpointing: each layer keeps its
input (and the MoE input, the boundary tensor of the expert round trip) for every token
still in flight, plus the working set of the one task being (re)computed. In zebra every
micro-batch's forward finishes before its backward starts, so all of a rank's tokens are
in flight at once; in EP/DistEP (gradient accumulation) only one micro-batch is.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..cluster.devices import DeviceSpec
from ..config import ModelConfig


@dataclass(frozen=True)
class MemoryModel:
    model: ModelConfig
    bytes_per_param: float = 16.0
    act_bytes: int = 2
    # Live [tokens, d] tensors while one attention block is recomputed and backpropagated.
    attention_working_tensors: int = 20
    # The loss is computed over chunks of this many tokens (fp16 logits + fp32 softmax and
    # its gradient: 6 bytes per vocabulary entry), so long micro-batches still fit.
    loss_chunk_tokens: int = 4096

    # ---- parameter counts ----------------------------------------------------------------
    def attention_stack_params(self) -> float:
        """Everything but the experts: embeddings, LM head, attention, router, norms."""
        m = self.model
        d = m.d_model
        per_layer = 4 * d * d + d * m.moe.num_experts + 2 * d
        return m.n_layers * per_layer + 2 * m.vocab_size * d + d

    def expert_params(self) -> float:
        m = self.model
        mats = 3 if m.moe.activation == "swiglu" else 2
        return mats * m.d_model * m.moe.d_ff

    def total_params(self) -> float:
        m = self.model
        return self.attention_stack_params() + m.n_layers * m.moe.num_experts * self.expert_params()

    # ---- bytes ---------------------------------------------------------------------------
    def attention_bytes(self, *, tokens_in_flight: float, mb_tokens: float) -> float:
        """Attention stack state + checkpoints of ``tokens_in_flight`` + one task's working set."""
        m = self.model
        state = self.attention_stack_params() * self.bytes_per_param
        ckpt = tokens_in_flight * m.n_layers * m.d_model * self.act_bytes * 2
        work = mb_tokens * self.attention_working_tensors * m.d_model * self.act_bytes
        work += min(mb_tokens, self.loss_chunk_tokens) * m.vocab_size * 6
        return state + ckpt + work

    def expert_bytes(self, *, tokens_in_flight_per_expert: float) -> float:
        """One expert (one layer): state + its saved inputs for the tokens in flight."""
        return (
            self.expert_params() * self.bytes_per_param
            + tokens_in_flight_per_expert * self.model.d_model * self.act_bytes * 2
        )

    def expert_working_bytes(self, mb_tokens_per_expert: float) -> float:
        return mb_tokens_per_expert * self.model.moe.d_ff * self.act_bytes * 3

    # ---- capacities ----------------------------------------------------------------------
    def attention_fits(self, dev: DeviceSpec, *, tokens_in_flight: float, mb_tokens: float) -> bool:
        return self.attention_bytes(tokens_in_flight=tokens_in_flight, mb_tokens=mb_tokens) <= dev.usable_bytes

    def expert_capacity(
        self,
        dev: DeviceSpec,
        *,
        tokens_in_flight_per_expert: float,
        mb_tokens_per_expert: float,
        attention_tokens_in_flight: float = 0.0,
        attention_mb_tokens: float = 0.0,
        holds_attention: bool = False,
    ) -> int:
        """Whole experts that fit on ``dev`` (n_max on attention ranks); -1 if even the rest does not fit."""
        free = dev.usable_bytes - self.expert_working_bytes(mb_tokens_per_expert)
        if holds_attention:
            free -= self.attention_bytes(tokens_in_flight=attention_tokens_in_flight, mb_tokens=attention_mb_tokens)
        if free < 0:
            return -1
        return int(free // self.expert_bytes(tokens_in_flight_per_expert=tokens_in_flight_per_expert))
