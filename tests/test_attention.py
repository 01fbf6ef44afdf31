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


class _Counting(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func).split(".")[1])
        return func(*args, **(kwargs or {}))


def test_rotary_tables_are_built_once_per_shape_kept_a_few_and_equal_the_formula():
    from lightning_hetermoe.model import transformer

    transformer._TABLES.clear()
    cos, sin = rotary_tables(12, 8, torch.device("cpu"), 500.0)
    again = rotary_tables(12, 8, torch.device("cpu"), 500.0)
    assert again[0] is cos and again[1] is sin
    pos = torch.arange(12, dtype=torch.float64)[:, None]
    ang = pos * 500.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    torch.testing.assert_close(cos, ang.cos().float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin, ang.sin().float(), rtol=1e-6, atol=1e-6)
    assert rotary_tables(13, 8, torch.device("cpu"), 500.0)[0].shape == (13, 4)
    assert rotary_tables(12, 8, torch.device("cpu"), 10000.0)[0] is not cos  # theta is part of the shape
    for n in range(2 * transformer.TABLES_KEPT):
        rotary_tables(20 + n, 8, torch.device("cpu"))
    assert len(transformer._TABLES) == transformer.TABLES_KEPT
    assert rotary_tables(12, 8, torch.device("cpu"), 500.0)[0] is not cos  # the oldest went first

    # a layer's forward builds them once: the second forward issues no op of theirs
    attn = CausalSelfAttention(ModelConfig(d_model=32, n_heads=4, max_seq_len=16))
    x = torch.randn(2, 9, 32)
    counted = []
    for _ in range(2):
        with _Counting() as mode:
            attn(x)
        counted.append(mode.ops)
    assert {"cos", "sin", "arange"} <= set(counted[0])
    assert not {"cos", "sin", "arange"} & set(counted[1])
    assert len(counted[1]) < len(counted[0])


def test_tables_built_in_inference_mode_do_not_reach_a_training_backward():
    """Lightning validates under inference mode between training steps: an inference
    tensor saved for a backward is an error, so inference mode keeps tables of its own."""
    from lightning_hetermoe.model import transformer

    transformer._TABLES.clear()
    attn = CausalSelfAttention(ModelConfig(d_model=32, n_heads=4, max_seq_len=16))
    x = torch.randn(2, 9, 32)
    with torch.inference_mode():
        seen = attn(x)
    out = attn(x.requires_grad_())
    out.square().sum().backward()
    assert x.grad is not None and torch.equal(out.detach(), seen)
    assert {key[-1] for key in transformer._TABLES} == {True, False}


def test_a_compiled_layer_keeps_no_tracer_tensors_and_equals_eager():
    from lightning_hetermoe.model import transformer

    transformer._TABLES.clear()
    torch.manual_seed(3)
    attn = CausalSelfAttention(ModelConfig(d_model=32, n_heads=4, max_seq_len=16))
    x = torch.randn(2, 7, 32)
    compiled = torch.compile(attn, backend="aot_eager")
    got = compiled(x)
    assert all(type(t) is torch.Tensor for tables in transformer._TABLES.values() for t in tables)
    torch.testing.assert_close(got, attn(x), rtol=1e-6, atol=1e-6)
