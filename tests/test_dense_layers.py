"""Dense decoder layers beside the MoE ones (DeepSeek's first ``first_k_dense_replace``,
Qwen-MoE's ``mlp_only_layers``): the pack's model builds them (``model.dense_layers``), a
converted Hugging Face model's are read from the module, and every price counts them where
they run: their parameters and saved inputs in the attention stack, their time in the
attention tasks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_hetermoe.cluster import get_device
from lightning_hetermoe.cluster.devices import DeviceSpec
from lightning_hetermoe.configs import ConfigError, ModelConfig, MoEConfig
from lightning_hetermoe.model.transformer import MoETransformer
from lightning_hetermoe.model_contract import describe_model
from lightning_hetermoe.profile import CostModel
from lightning_hetermoe.profile.memory import MemoryModel
from lightning_hetermoe.profile.profile import DeviceProfile, Profile
from lightning_hetermoe.profile.timer import CostModelTimer, ProfileTimer


def dense_cfg(**kw) -> ModelConfig:
    base = dict(d_model=32, n_layers=3, n_heads=4, max_seq_len=16, dense_layers=2, dense_d_ff=40,
                moe=MoEConfig(num_experts=4, d_ff=12, shared_expert_d_ff=8))
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("kw, field", [(dict(dense_d_ff=0), "model.dense_d_ff"),
                                       (dict(dense_layers=-1), "model.dense_layers"),
                                       (dict(dense_layers=True), "model.dense_layers")])
def test_bad_dense_layer_settings_name_the_field(kw, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        dense_cfg(**kw)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_the_pack_model_holds_the_dense_layers_the_memory_model_counts(activation):
    cfg = dense_cfg(moe=MoEConfig(num_experts=4, d_ff=12, shared_expert_d_ff=8, activation=activation))
    model = MoETransformer(cfg)
    assert [type(b).__name__ for b in model.blocks] == ["DenseBlock"] * 2 + ["DecoderBlock"] * 3
    assert sum(p.numel() for p in model.parameters()) == MemoryModel(cfg).model_params()
    without = dataclasses.replace(cfg, dense_layers=0, dense_d_ff=0)
    per_dense = (MemoryModel(cfg).attention_stack_params() - MemoryModel(without).attention_stack_params()) / 2
    assert per_dense == sum(p.numel() for p in model.blocks[0].parameters())
    logits, auxes = model(torch.randint(0, cfg.vocab_size, (2, 16)))
    assert logits.shape == (2, 16, cfg.vocab_size) and len(auxes) == 3  # one aux per MoE layer only
    # read from the module as the model contract reads any model (no model_cfg on it)
    read = describe_model(model)
    assert (read.n_layers, read.dense_layers, read.dense_d_ff) == (3, 2, 40)
    assert MemoryModel(read).model_params() == MemoryModel(cfg).model_params()


def test_a_member_among_the_blocks_too_small_for_an_mlp_is_named():
    from lightning_hetermoe.model_contract import ModelContractError

    model = MoETransformer(dense_cfg())
    model.blocks[0] = torch.nn.LayerNorm(32)
    with pytest.raises(ModelContractError, match="LayerNorm .*model_cfg with dense_layers and dense_d_ff"):
        describe_model(model)


def test_the_output_projections_are_scaled_for_the_whole_depth():
    """GPT-2's residual scaling, 1 / sqrt(2 x layers), over every decoder layer, dense or MoE."""
    torch.manual_seed(3)
    model = MoETransformer(dense_cfg(d_model=64, n_heads=4))
    for block in (model.blocks[0], model.blocks[4]):
        assert block.attn.proj.weight.std().item() == pytest.approx((64 * 2 * 5) ** -0.5, rel=0.1)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_a_dense_layer_is_priced_as_attention_and_its_mlp_without_a_router(activation):
    """The dense layer's price over an MoE layer's attention task (no shared expert) is its
    MLP's FLOPs, forward and backward as torch counts them on the block's own MLP, less the
    router's (a device whose bandwidth never binds and whose launches are free prices FLOPs
    alone)."""
    from torch.utils.flop_counter import FlopCounterMode

    from lightning_hetermoe.model.transformer import DenseBlock

    dev = DeviceSpec(name="flops only", memory_gb=80, fp16_tflops=100, mem_bw_gbps=1e15, flash_attention=True,
                     launch_overhead_s=0.0)
    cm = CostModel(activation_checkpointing=False)
    rate = cm._peak(dev) * dev.gemm_efficiency
    tokens, d, ff, experts = 96, 32, 40, 4
    cfg = dense_cfg(moe=MoEConfig(num_experts=experts, d_ff=12, activation=activation))
    mlp = DenseBlock(cfg).mlp
    x = torch.randn(tokens, d, requires_grad=True)
    with FlopCounterMode(display=False) as fwd:
        y = mlp(x)
    with FlopCounterMode(display=False) as bwd:
        y.sum().backward()
    router = 2 * tokens * d * experts
    for backward, counted in ((False, fwd.get_total_flops()), (True, bwd.get_total_flops())):
        dense = cm.dense_layer_time(dev, tokens=tokens, seq_len=32, d_model=d, n_heads=4, d_ff=ff,
                                    activation=activation, backward=backward)
        moe = cm.attention_time(dev, tokens=tokens, seq_len=32, d_model=d, n_heads=4, num_experts=experts,
                                backward=backward)
        router_s = router * (cm.backward_factor if backward else 1) / rate
        assert (dense - moe + router_s) * rate == pytest.approx(counted, rel=1e-6)


def test_every_attention_task_carries_its_share_of_the_dense_layers():
    cfg = dense_cfg()
    a40 = get_device("a40")
    timer = CostModelTimer(cfg, 16)
    plain = CostModelTimer(dataclasses.replace(cfg, dense_layers=0, dense_d_ff=0), 16)
    for backward in (False, True):
        one = timer.cost.dense_layer_time(a40, tokens=4096, seq_len=16, d_model=32, n_heads=4, d_ff=40,
                                          backward=backward)
        assert timer.attention(a40, 4096, backward) == pytest.approx(
            plain.attention(a40, 4096, backward) + 2 / 3 * one, rel=1e-12)
    # a profile's measured attention (an MoE block's) grows at the cost model's ratio
    measured = DeviceProfile(device="a40", attention_fwd_s={4096: 0.01}, attention_bwd_s={4096: 0.03},
                             expert_fwd_s={4096: 0.001})
    prof = ProfileTimer(model=cfg, seq_len=16, profile=Profile(model="m", seq_len=16, devices={"a40": measured}))
    for backward, own in ((False, 0.01), (True, 0.03)):
        ratio = timer.attention(a40, 4096, backward) / plain.attention(a40, 4096, backward)
        assert prof.attention(a40, 4096, backward) == pytest.approx(own * ratio, rel=1e-12)


def test_the_plan_and_its_bound_price_deepseek_v2_lite_s_dense_first_layer():
    from lightning_hetermoe.cluster import ClusterConfig
    from lightning_hetermoe.configs import workload_model
    from lightning_hetermoe.plan import make_plan

    model = workload_model("deepseek_v2_lite")
    assert (model.n_layers, model.dense_layers, model.dense_d_ff) == (26, 1, 10944)
    all_moe = dataclasses.replace(model, dense_layers=0, dense_d_ff=0)
    cluster = ClusterConfig(name="c", devices=["h100"] * 2 + ["a40"] * 4)
    with_dense, without = (make_plan(cluster, m, seq_len=4096, global_batch_tokens=8 * 4096)
                           for m in (model, all_moe))
    assert with_dense.predicted["zebra"]["tokens_per_s"] < without.predicted["zebra"]["tokens_per_s"]
    assert 0 < with_dense.bound_tokens_per_s < without.bound_tokens_per_s


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_a_converted_model_s_dense_layers_are_read_from_the_module(arch):
    """DeepSeek-V3's dense first layer and Qwen3-MoE's ``mlp_only_layers=[1]`` (the tiny
    models of the training tests: 3 layers, one dense, its MLP 12 wide)."""
    pytest.importorskip("transformers")
    from helpers_hf import tiny_lm

    cfg = describe_model(tiny_lm(arch, 0, 4, 16))
    assert (cfg.n_layers, cfg.dense_layers, cfg.dense_d_ff) == (2, 1, 12)


def test_a_mixtral_cannot_stand_for_a_model_with_dense_layers():
    from lightning_hetermoe.convert.mixtral import mixtral_config_kwargs

    with pytest.raises(ValueError, match="model.dense_layers"):
        mixtral_config_kwargs(dense_cfg(moe=MoEConfig(num_experts=4, d_ff=12)))


def test_an_emulated_clock_runs_the_run_s_dense_layers_at_the_workload_s_width():
    from lightning_hetermoe.cluster import ClusterConfig
    from lightning_hetermoe.emulate import emulated_workload

    cluster = ClusterConfig(name="e", devices=["a40", "v100"], emulate=True,
                            emulate_workload={"model": "deepseek_v2_lite", "seq_len": 4096})
    run = dense_cfg(dense_layers=1)
    work = emulated_workload(cluster, run, 16)
    assert (work.model.n_layers, work.model.dense_layers, work.model.dense_d_ff) == (3, 1, 10944)
    d1 = ClusterConfig(name="e", devices=["a40", "v100"], emulate=True,
                       emulate_workload={"model": "d1", "seq_len": 4096})
    scaled = emulated_workload(d1, run, 16).model
    assert scaled.dense_layers == 1 and scaled.dense_d_ff == round(40 * scaled.d_model / 32)
