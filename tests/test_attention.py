"""Grouped-query attention in the attention kernel (``enable_gqa``) against the plain
attention of every key/value head repeated for its query heads: outputs and every gradient,
one causal sequence per row and packed documents."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_hetermoe.configs import ModelConfig
from lightning_hetermoe.model.transformer import CausalSelfAttention, apply_rotary, document_layout, rotary_tables


@pytest.mark.parametrize("packed", [False, True])
def test_grouped_query_attention_equals_each_key_value_head_repeated_per_query_head(packed):
    torch.manual_seed(8)
    attn = CausalSelfAttention(ModelConfig(d_model=32, n_heads=8, n_kv_heads=2, max_seq_len=16))
    x = torch.randn(2, 12, 32, requires_grad=True)
    mask = positions = None
    if packed:
        mask, positions = document_layout(torch.tensor([[0] * 5 + [1] * 7, [3] * 12]))

    def repeated(x):
        # the reference: every key/value head copied for its group of query heads, plain attention
        b, s, d = x.shape
        q, k, v = attn.qkv(x).split([d, 8, 8], dim=-1)
        q = q.view(b, s, 8, 4).transpose(1, 2)
        k, v = (t.view(b, s, 2, 4).transpose(1, 2) for t in (k, v))
        cos, sin = rotary_tables(s, 4, x.device, attn.rope_theta, positions)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k, v = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal if mask is None else mask)
        return attn.proj(out.transpose(1, 2).reshape(b, s, d))

    got, want = attn(x, mask, positions), repeated(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    params = [x, *attn.parameters()]
    for a, b in zip(torch.autograd.grad(got.square().sum(), params), torch.autograd.grad(want.square().sum(), params),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
