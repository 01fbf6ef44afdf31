"""A small Mixtral-style decoder. Pure model code: nothing here knows about parallelism."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..configs import ModelConfig
from ..kernels import rms_norm, rotary
from ..moe import MoEAux, MoELayer
from ..moe.layer import SharedExpert
from ..seeded_init import draw_seed, fill_, fill_normal_, generator, initialise, seed_scope


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.init_seed = draw_seed()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        fill_(self.weight, 1.0)

    def forward(self, x: Tensor) -> Tensor:
        if rms_norm.runs_fused(x, self.weight):  # on a GPU: one kernel each way, the same roundings
            return rms_norm.rms_norm(x, self.weight, self.eps)[0]
        xf = x.float()
        return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


# Every layer of every micro-batch asked for the same tables and built them again: nine
# small ops each time (a launch each on a GPU, 2,304 a step for 32 layers at R = 8, twice
# with checkpointed blocks). Built once per shape and kept; a few shapes at most are live.
_TABLES: dict[tuple, tuple[Tensor, Tensor]] = {}
TABLES_KEPT = 8


def rotary_tables(seq_len: int, head_dim: int, device: torch.device, theta: float = 10000.0,
                  positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """cos and sin of every position's rotary angles: ``[seq_len, head_dim / 2]`` for
    positions ``0..seq_len-1``, or ``[batch, 1, seq_len, head_dim / 2]`` (one row per
    sequence, broadcast over heads) for given ``positions`` ``[batch, seq_len]``.

    The first form is kept per shape and device and returned again (read only: shared by
    every caller). Inference mode keeps its own (an inference tensor cannot be saved for a
    backward), and a graph being compiled builds them inside itself, as before."""
    if positions is not None or torch.compiler.is_compiling():
        return _angles(seq_len, head_dim, device, theta, positions)
    key = (seq_len, head_dim, torch.device(device), float(theta), torch.is_inference_mode_enabled())
    tables = _TABLES.get(key)
    if tables is None:
        tables = _angles(seq_len, head_dim, device, theta, None)
        if len(_TABLES) >= TABLES_KEPT:
            _TABLES.pop(next(iter(_TABLES), None), None)  # the oldest shape
        _TABLES[key] = tables
    return tables


def _angles(seq_len: int, head_dim: int, device: torch.device, theta: float,
            positions: Tensor | None) -> tuple[Tensor, Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if positions is None:
        ang = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv)
    else:
        ang = (positions.to(torch.float32)[..., None] * inv)[:, None]
    return ang.cos(), ang.sin()


def document_layout(segments: Tensor) -> tuple[Tensor, Tensor]:
    """Packed rows: ``segments`` ``[batch, seq]`` gives each token's document within its
    row, constant over a document's tokens and changing exactly where the next one starts
    (any integers: only equality of neighbours counts).

    Returns the attention mask ``[batch, 1, seq, seq]`` (bool, True = may attend: key in the
    query's document and not after it, a block-diagonal causal mask) and each token's
    position inside its document ``[batch, seq]`` (0 at its first token in the row: what
    Megatron's ``reset_position_ids`` does). Device ops only (no host sync)."""
    b, s = segments.shape
    idx = torch.arange(s, device=segments.device)
    starts = torch.ones(b, s, dtype=torch.bool, device=segments.device)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values  # each token's document start
    positions = idx - first
    # key j is visible to query i iff first[i] <= j <= i
    mask = (idx[None, None, :] <= idx[None, :, None]) & (idx[None, None, :] >= first[:, :, None])
    return mask[:, None], positions


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    if rotary.runs_fused(x, cos):  # on a GPU: one kernel each way, the same rounding
        return rotary.rotary(x, cos, sin)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class CausalSelfAttention(nn.Module):
    """Rotary causal attention; with ``n_kv_heads < n_heads`` each key/value head serves
    ``n_heads / n_kv_heads`` consecutive query heads (grouped-query attention)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.init_seed = draw_seed()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_size
        self.rope_theta = cfg.rope_theta
        self.n_layers = cfg.n_layers + cfg.dense_layers  # the depth the output projection is scaled for
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.kv_heads) * cfg.head_size, bias=False)
        self.proj = nn.Linear(cfg.attention_width, cfg.d_model, bias=False)
        initialise(self)

    def reset_parameters(self) -> None:
        d_model, width = self.proj.weight.shape  # width: n_heads x head_dim, d_model where heads split it
        gen = generator(self.init_seed)
        fill_normal_(self.qkv.weight, 1.0 / math.sqrt(d_model), gen)
        fill_normal_(self.proj.weight, 1.0 / math.sqrt(width * 2 * self.n_layers), gen)

    def forward(self, x: Tensor, mask: Tensor | None = None, positions: Tensor | None = None) -> Tensor:
        """``mask`` and ``positions`` (:func:`document_layout`): packed documents; neither:
        one causal sequence per row."""
        b, s, _ = x.shape
        width, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = self.qkv(x).split([width, kv, kv], dim=-1)
        q = q.view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k, v = (t.view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2) for t in (k, v))
        cos, sin = rotary_tables(s, self.head_dim, x.device, self.rope_theta, positions)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # grouped-query attention inside the attention kernel: copies of each key/value head
        # per query head would be written, and saved for the backward, by every layer
        gqa = self.n_kv_heads != self.n_heads
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.proj(out.transpose(1, 2).reshape(b, s, width))


class DecoderBlock(nn.Module):
    """Pre-norm: x + attn(norm(x)), then x + moe(norm(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.moe_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.moe = MoELayer(cfg.d_model, cfg.moe)

    def forward(self, x: Tensor, mask: Tensor | None = None, positions: Tensor | None = None
                ) -> tuple[Tensor, MoEAux]:
        x = x + self.attn(self.attn_norm(x), mask, positions)
        y, aux = self.moe(self.moe_norm(x))
        return x + y, aux


class DenseBlock(nn.Module):
    """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x)): a decoder layer whose FFN is one
    dense MLP every token passes through (DeepSeek's first layers)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SharedExpert(cfg.d_model, cfg.dense_d_ff, cfg.moe.activation, cfg.moe.bias, gated=False)

    def forward(self, x: Tensor, mask: Tensor | None = None, positions: Tensor | None = None) -> Tensor:
        x = x + self.attn(self.attn_norm(x), mask, positions)
        return x + self.mlp(self.mlp_norm(x))


class MoETransformer(nn.Module):
    """Built on the meta device (``Trainer.init_module(empty_init=True)``), it holds no
    storage and a strategy materialises each process's share; the values equal an eager
    build with the same seed (see :mod:`lightning_hetermoe.seeded_init`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.init_seed = draw_seed()  # one draw from the caller's generator, meta or not
        with seed_scope(self.init_seed):
            self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
            # the dense layers first, in the same list (as a Hugging Face model keeps them, where
            # the model contract reads them); none: no draws, such models initialise as before
            self.blocks = nn.ModuleList([*(DenseBlock(cfg) for _ in range(cfg.dense_layers)),
                                         *(DecoderBlock(cfg) for _ in range(cfg.n_layers))])
            self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        initialise(self)

    def reset_parameters(self) -> None:
        """The embedding and the head; every block initialises its own."""
        gen = generator(self.init_seed)
        fill_normal_(self.embed.weight, 0.02, gen)
        fill_normal_(self.head.weight, 1.0 / math.sqrt(self.cfg.d_model), gen)

    def forward(self, tokens: Tensor, segments: Tensor | None = None) -> tuple[Tensor, list[MoEAux]]:
        """The logits and every MoE layer's aux (see :meth:`features`)."""
        x, auxes = self.features(tokens, segments)
        return self.head(x), auxes

    def features(self, tokens: Tensor, segments: Tensor | None = None) -> tuple[Tensor, list[MoEAux]]:
        """What the head reads (the final norm's output) and every MoE layer's aux.
        ``segments`` ``[batch, seq]``: each token's document in a packed row (see
        :func:`document_layout`); attention then stays inside a document and rotary
        positions restart at each document's first token, so every document's logits are
        the ones it would get alone. ``None``: each row is one sequence."""
        if tokens.shape[1] > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        mask = positions = None
        if segments is not None:
            if segments.shape != tokens.shape:
                raise ValueError(f"segment ids {tuple(segments.shape)} must have the tokens' shape {tuple(tokens.shape)}")
            mask, positions = document_layout(segments)
        x = self.embed(tokens)
        auxes = []
        for block in self.blocks:
            if self.cfg.activation_checkpointing and torch.is_grad_enabled():
                out = checkpoint(block, x, mask, positions, use_reentrant=False)
            else:
                out = block(x, mask, positions)
            if isinstance(block, DenseBlock):
                x = out
            else:
                x, aux = out
                auxes.append(aux)
        return self.norm(x), auxes
