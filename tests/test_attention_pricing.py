"""The attention task is priced at the attention a model has: grouped-query attention's
fewer key/value heads (Mixtral-8x7B's 8 of 32, Qwen3-30B-A3B's 4 of 32) and heads wider than
``d_model / n_heads`` (Qwen3-30B-A3B's 32 heads of 128 over d_model 2048: queries and output
projection twice d_model). The pack's model builds it (``model.head_dim``), the memory model
counts its weights, a converted model's shape is read from its modules."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from lightning_hetermoe.cluster.devices import DeviceSpec
from lightning_hetermoe.configs import ConfigError, ModelConfig, MoEConfig
from lightning_hetermoe.model.transformer import CausalSelfAttention, MoETransformer
from lightning_hetermoe.model_contract import describe_model
from lightning_hetermoe.profile import CostModel
from lightning_hetermoe.profile.memory import MemoryModel

SHAPES = {"mha": dict(), "gqa": dict(n_kv_heads=2), "gqa_wide_heads": dict(n_kv_heads=2, head_dim=16)}


def cfg_of(shape: str) -> ModelConfig:
    return ModelConfig(d_model=64, n_heads=8, max_seq_len=32, n_layers=2, moe=MoEConfig(num_experts=4, d_ff=16),
                       **SHAPES[shape])


def naive_core_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """softmax(QKᵀ)V written out, each key/value head repeated for its query heads, counted."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    with FlopCounterMode(display=False) as counted:
        (q @ k.transpose(-2, -1)).softmax(-1) @ v
    return counted.get_total_flops()


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_attention_task_prices_the_flops_and_bytes_the_layer_moves(shape, monkeypatch):
    cfg = cfg_of(shape)
    attn = CausalSelfAttention(cfg)
    batch, seq = 3, 32
    x = torch.randn(batch, seq, cfg.d_model)
    seen = {}
    sdpa = F.scaled_dot_product_attention

    def recorded(q, k, v, **kw):
        seen.update(q=q, k=k, v=v)
        out = sdpa(q, k, v, **kw)
        seen["o"] = out
        return out

    monkeypatch.setattr(F, "scaled_dot_product_attention", recorded)
    with FlopCounterMode(display=False) as counted:  # the projections (the CPU's attention kernel is not counted)
        attn(x)
    flops = counted.get_total_flops() + naive_core_flops(seen["q"], seen["k"], seen["v"])
    tokens = batch * seq
    cm = CostModel(activation_checkpointing=False)
    kw = dict(tokens=tokens, seq_len=seq, d_model=cfg.d_model, n_heads=cfg.n_heads, num_experts=0,
              kv_heads=cfg.kv_heads, head_dim=cfg.head_size)
    # a device whose bandwidth never binds, whose launches are free and whose attention kernel
    # computes the whole square (no causal skipping): FLOPs alone
    flops_only = DeviceSpec(name="flops only", memory_gb=80, fp16_tflops=100, mem_bw_gbps=1e15,
                            flash_attention=False, launch_overhead_s=0.0)
    gemm_rate = cm._peak(flops_only) * flops_only.gemm_efficiency
    core_rate = cm._peak(flops_only) * flops_only.attn_efficiency
    core = naive_core_flops(seen["q"], seen["k"], seen["v"])
    priced = cm.attention_time(flops_only, **kw)
    assert priced == pytest.approx((flops - core) / gemm_rate + core / core_rate, rel=1e-9)
    # the attention core's traffic: Q, K, V read and O written once, at their own widths
    bytes_only = DeviceSpec(name="bytes only", memory_gb=80, fp16_tflops=1e12, mem_bw_gbps=1000,
                            flash_attention=True, launch_overhead_s=0.0)
    moved = sum(seen[t].numel() for t in "qkvo") * cm.dtype_bytes
    got = cm.attention_core_time(bytes_only, tokens=tokens, seq_len=seq, d_model=cfg.attention_width,
                                 kv_width=cfg.kv_heads * cfg.head_size)
    assert got == pytest.approx(moved / bytes_only.stream_bw, rel=1e-12)


def test_multi_head_attention_is_priced_to_the_bit_as_before_the_head_shapes_were_read():
    """``kv_heads=n_heads`` and ``head_dim=d_model / n_heads`` give the arithmetic the paper's
    models were always priced with (its tables depend on it)."""
    from lightning_hetermoe.cluster import get_device

    cm = CostModel(activation_checkpointing=True)
    for dev in (get_device("a40"), get_device("v100")):
        for tokens in (4096.0, 12288.0, 5461.333333333333):
            plain = cm.attention_time(dev, tokens=tokens, seq_len=4096, d_model=1024, n_heads=16)
            said = cm.attention_time(dev, tokens=tokens, seq_len=4096, d_model=1024, n_heads=16, kv_heads=16,
                                     head_dim=64)
            assert plain == said


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_pack_model_holds_the_attention_the_memory_model_counts(shape):
    cfg = cfg_of(shape)
    model = MoETransformer(cfg)
    assert sum(p.numel() for p in model.parameters()) == MemoryModel(cfg).model_params()
    read = describe_model(model)
    assert (read.n_heads, read.kv_heads, read.head_size) == (cfg.n_heads, cfg.kv_heads, cfg.head_size)
    logits, _ = model(torch.randint(0, cfg.vocab_size, (2, 16)))
    assert logits.shape == (2, 16, cfg.vocab_size)


def test_qwen3_30b_a3b_is_planned_with_its_wide_heads():
    from lightning_hetermoe.configs import workload_model

    model = workload_model("qwen3_30b_a3b")
    assert (model.head_size, model.attention_width, model.kv_heads) == (128, 4096, 4)
    assert MemoryModel(model).model_params() == pytest.approx(30.5e9, rel=0.01)  # its model card's 30.5B
    narrow = dataclasses.replace(model, head_dim=None)
    from lightning_hetermoe.cluster import get_device
    from lightning_hetermoe.profile.timer import CostModelTimer

    h100 = get_device("h100")
    assert CostModelTimer(model, 4096).attention(h100, 16384) > 1.5 * CostModelTimer(narrow, 4096).attention(h100, 16384)


@pytest.mark.parametrize("kw, field", [(dict(head_dim=7), "model.head_dim"), (dict(head_dim=0), "model.head_dim"),
                                       (dict(d_model=60, n_heads=8), "model.d_model")])
def test_bad_head_shapes_name_the_field(kw, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        ModelConfig(**{**dict(d_model=64, n_heads=8), **kw})
    if field == "model.d_model":  # heads that do not split d_model are fine with their own width
        assert ModelConfig(d_model=60, n_heads=8, head_dim=8).attention_width == 64


@pytest.mark.parametrize("arch, head_dim", [("mixtral", None), ("qwen3_moe", None), ("qwen3_moe", 8)])
def test_a_converted_model_s_heads_are_read_from_its_modules(arch, head_dim):
    pytest.importorskip("transformers")
    from helpers_hf import hf_model

    from lightning_hetermoe import to_hetermoe

    hf = hf_model(arch, **({} if head_dim is None else {"head_dim": head_dim}))
    c = hf.config
    cfg = describe_model(to_hetermoe(hf))
    assert (cfg.n_heads, cfg.kv_heads) == (c.num_attention_heads, c.num_key_value_heads)
    assert cfg.head_size == (head_dim or c.hidden_size // c.num_attention_heads)
