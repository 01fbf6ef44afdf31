"""A small Mixtral-style decoder. Pure model code: nothing here knows about parallelism."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..config import ModelConfig
from ..moe import MoEAux, MoELayer


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotary_tables(seq_len: int, head_dim: int, device: torch.device, theta: float = 10000.0) -> tuple[Tensor, Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    ang = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv)
    return ang.cos(), ang.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class CausalSelfAttention(nn.Module):
    """Rotary causal attention; with ``n_kv_heads < n_heads`` each key/value head serves
    ``n_heads / n_kv_heads`` consecutive query heads (grouped-query attention)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.kv_heads) * cfg.head_dim, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        nn.init.normal_(self.qkv.weight, std=1.0 / math.sqrt(cfg.d_model))
        nn.init.normal_(self.proj.weight, std=1.0 / math.sqrt(cfg.d_model * 2 * cfg.n_layers))

    def forward(self, x: Tensor) -> Tensor:
        b, s, d = x.shape
        kv = self.n_kv_heads * self.head_dim
        q, k, v = self.qkv(x).split([d, kv, kv], dim=-1)
        q = q.view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k, v = (t.view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2) for t in (k, v))
        cos, sin = rotary_tables(s, self.head_dim, x.device, self.rope_theta)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.n_kv_heads != self.n_heads:
            group = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, s, d))


class DecoderBlock(nn.Module):
    """Pre-norm: x + attn(norm(x)), then x + moe(norm(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.moe_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.moe = MoELayer(cfg.d_model, cfg.moe)

    def forward(self, x: Tensor) -> tuple[Tensor, MoEAux]:
        x = x + self.attn(self.attn_norm(x))
        y, aux = self.moe(self.moe_norm(x))
        return x + y, aux


class MoETransformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = nn.ModuleList(DecoderBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        nn.init.normal_(self.head.weight, std=1.0 / math.sqrt(cfg.d_model))

    def forward(self, tokens: Tensor) -> tuple[Tensor, list[MoEAux]]:
        if tokens.shape[1] > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        x = self.embed(tokens)
        auxes = []
        for block in self.blocks:
            if self.cfg.activation_checkpointing and torch.is_grad_enabled():
                x, aux = checkpoint(block, x, use_reentrant=False)
            else:
                x, aux = block(x)
            auxes.append(aux)
        return self.head(self.norm(x)), auxes
