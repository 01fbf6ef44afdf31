"""Hugging Face MoE models converted to MoELayer and back, against transformers' own modules:
outputs and every gradient within 1e-5 relative in fp32, on tiny random configs (no download).
Also the MoE layer's new options against the naive reference, and the pack's own
MoETransformer (rope theta, norm eps, grouped-query attention) against transformers' Mixtral."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from helpers_moe import assert_close, check
from lightning_hetermoe import MoELayer, from_hf, to_hetermoe, to_hf
from lightning_hetermoe.configs import ConfigError, ModelConfig, MoEConfig
from lightning_hetermoe.model_contract import describe_model, find_blocks
from lightning_hetermoe.convert import HFMoEBlock, mixtral_tensors, moe_aux, moe_tensors_from_hf, moe_tensors_to_hf

transformers = pytest.importorskip("transformers")
from transformers.models.olmoe import modeling_olmoe as hf_olmoe  # noqa: E402

from helpers_hf import ARCHS, assert_same_model, hf_config, hf_model, randomize  # noqa: E402

# -- one sparse MoE block -------------------------------------------------------------------

@pytest.mark.parametrize("arch", list(ARCHS))
def test_block_matches_transformers(arch):
    config = hf_config(arch, experts_implementation="eager")
    block = ARCHS[arch][2](config).train()
    randomize(block)
    holder = nn.Module()
    holder.config, holder.mlp = config, copy.deepcopy(block)
    to_hetermoe(holder)
    layer = holder.mlp
    assert isinstance(layer, MoELayer) and isinstance(layer, HFMoEBlock)
    assert layer.cfg.normalize_topk == getattr(config, "norm_topk_prob", True)
    assert layer.cfg.shared_expert_d_ff == getattr(config, "shared_expert_intermediate_size", 0)

    x = torch.randn(3, 7, 16, requires_grad=True)
    upstream = torch.randn(3, 7, 16)
    torch.manual_seed(100)  # the same jitter draws in both (Mixtral's router_jitter_noise)
    y_hf = block(x * 1)  # HF scales its input in place: give it a non-leaf
    names = [n for n, _ in block.named_parameters()]
    g_hf = torch.autograd.grad((y_hf * upstream).sum(), [x] + list(block.parameters()))
    torch.manual_seed(100)
    y = layer(x)
    g = torch.autograd.grad((y * upstream).sum(), [x] + list(layer.parameters()))

    assert y.shape == y_hf.shape
    assert_close(y, y_hf, f"{arch} output")
    assert_close(g[0], g_hf[0], f"{arch} input gradient")
    expected = moe_tensors_from_hf(dict(zip(names, g_hf[1:], strict=True)))
    ours = dict(zip([n for n, _ in layer.named_parameters()], g[1:], strict=True))
    assert ours.keys() == expected.keys()
    for name in expected:
        assert_close(ours[name], expected[name], f"{arch} gradient of {name}")
    assert moe_aux(holder)[0].tokens_per_expert.sum() == 21 * layer.top_k


def test_balance_loss_is_top_k_times_ours_for_one_layer():
    """The relation that sets the converted aux_loss_coef (see moe/balance.py)."""
    config = hf_config("olmoe", num_experts_per_tok=3, experts_implementation="eager")
    block = ARCHS["olmoe"][2](config)
    randomize(block)
    holder = nn.Module()
    holder.config, holder.mlp = config, copy.deepcopy(block)
    to_hetermoe(holder)
    x = torch.randn(40, 16)
    logits, _, _ = block.gate(x)
    hf_loss = hf_olmoe.load_balancing_loss_func((logits,), config.num_experts, config.num_experts_per_tok)
    _, aux = MoELayer.forward(holder.mlp, x)
    assert_close(hf_loss, 3 * aux.balance_loss, "HF balance loss vs top_k x ours")
    assert holder.mlp.cfg.aux_loss_coef == pytest.approx(config.router_aux_loss_coef * 3 / 1)


# -- whole models ---------------------------------------------------------------------------

def test_converted_mixtral_matches_transformers():
    hf = hf_model("mixtral").train()
    conv = to_hetermoe(copy.deepcopy(hf))
    assert [type(b).__name__ for _, b, _ in find_blocks(conv)] == ["MixtralDecoderLayer"] * 2
    assert_same_model(hf, conv)
    assert len(moe_aux(conv)) == 2


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_round_trip_gives_identical_weights_and_exports_trained_ones(arch):
    hf = hf_model(arch)
    original = copy.deepcopy(hf.state_dict())
    rng = torch.get_rng_state()
    model = to_hetermoe(hf)
    assert torch.equal(torch.get_rng_state(), rng), "conversion must not draw from the torch RNG"
    back = to_hf(copy.deepcopy(model))
    assert not any(isinstance(m, MoELayer) for m in back.modules())
    assert type(back.model.layers[0].mlp) is ARCHS[arch][2]
    sd = back.state_dict()
    assert sd.keys() == original.keys()
    for name in original:
        assert torch.equal(sd[name], original[name]), name

    # Trained weights travel back: change every MoE weight, export, compare the two models.
    with torch.no_grad():
        for layer in (m for m in model.modules() if isinstance(m, MoELayer)):
            for p in layer.parameters():
                p.add_(torch.randn_like(p) * 0.1)
    tokens = torch.randint(0, 64, (2, 9))
    expected = model(input_ids=tokens).logits
    exported = to_hf(model)
    assert_close(exported(input_ids=tokens).logits, expected, f"{arch} exported logits")


def test_contract_reads_heads_from_hf_config():
    model = to_hetermoe(hf_model("qwen2_moe"))
    cfg = describe_model(model)
    assert (cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.vocab_size) == (2, 4, 16, 64)
    assert cfg.moe.shared_expert_d_ff == 20 and not cfg.moe.normalize_topk
    assert not cfg.activation_checkpointing


def test_contract_reads_hugging_face_activation_checkpointing():
    """A converted model whose blocks recompute in backward is planned and predicted so:
    its description says it, and its timer prices the backward a forward dearer."""
    from lightning_hetermoe.cluster import get_device
    from lightning_hetermoe.profile import make_timer

    model = to_hetermoe(hf_model("mixtral"))
    before = describe_model(model)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    after = describe_model(model)
    assert not before.activation_checkpointing and after.activation_checkpointing
    dev = get_device("v100")
    for cfg, ratio in ((before, 2.0), (after, 3.0)):
        timer = make_timer(cfg, 64)
        assert timer.attention(dev, 4096, backward=True) == pytest.approx(ratio * timer.attention(dev, 4096))


def test_older_per_expert_layout_maps_like_fused():
    """transformers < 5 kept one Linear per expert (Mixtral w1/w3/w2, others gate/up/down_proj)."""
    E, d, f = 3, 4, 5
    g = torch.Generator().manual_seed(0)
    for gate, up, down in (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj")):
        sd = {"gate.weight": torch.randn(E, d, generator=g)}
        for e in range(E):
            sd[f"experts.{e}.{gate}.weight"] = torch.randn(f, d, generator=g)
            sd[f"experts.{e}.{up}.weight"] = torch.randn(f, d, generator=g)
            sd[f"experts.{e}.{down}.weight"] = torch.randn(d, f, generator=g)
        fused = {"gate.weight": sd["gate.weight"],
                 "experts.gate_up_proj": torch.stack([torch.cat([sd[f"experts.{e}.{gate}.weight"],
                                                                 sd[f"experts.{e}.{up}.weight"]]) for e in range(E)]),
                 "experts.down_proj": torch.stack([sd[f"experts.{e}.{down}.weight"] for e in range(E)])}
        ours, ours_fused = moe_tensors_from_hf(sd), moe_tensors_from_hf(fused)
        assert all(torch.equal(ours[k], ours_fused[k]) for k in ours_fused)
        back = moe_tensors_to_hf(ours, list(sd))
        assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    with pytest.raises(ValueError, match="does not know"):
        moe_tensors_from_hf({**fused, "experts.gate_up_proj_bias": torch.zeros(E, 2 * f)})


def test_conversion_errors_are_clear():
    plain = nn.Module()
    plain.config, plain.proj = hf_config("mixtral"), nn.Linear(2, 2)
    with pytest.raises(ValueError, match="no sparse MoE block"):
        to_hetermoe(plain)
    with pytest.raises(ValueError, match="cannot be overridden"):
        to_hetermoe(hf_model("mixtral"), top_k=1)
    with pytest.raises(ValueError, match="holds no HFMoEBlock"):
        to_hf(hf_model("mixtral"))
    model = to_hetermoe(hf_model("olmoe"), capacity_factor=1.0, z_loss_coef=0.0)
    layer = model.model.layers[1].mlp
    assert layer.cfg.capacity_factor == 1.0 and layer.cfg.z_loss_coef == 0.0


# -- the pack's own model against transformers' Mixtral -------------------------------------

def test_moe_transformer_matches_transformers_mixtral():
    hf = hf_model("mixtral", rope_parameters={"rope_type": "default", "rope_theta": 500.0}, rms_norm_eps=1e-3,
                  num_attention_heads=4, num_key_value_heads=2).train()
    ours = from_hf(hf)
    cfg = ours.cfg
    assert (cfg.rope_theta, cfg.norm_eps, cfg.n_heads, cfg.n_kv_heads) == (500.0, 1e-3, 4, 2)
    tokens = torch.randint(0, 64, (3, 12))
    upstream = torch.randn(3, 12, 64)
    logits_hf = hf(input_ids=tokens).logits
    g_hf = torch.autograd.grad((logits_hf * upstream).sum(), list(hf.parameters()))
    logits, auxes = ours(tokens)
    g = torch.autograd.grad((logits * upstream).sum(), list(ours.parameters()))
    assert_close(logits, logits_hf, "logits")
    expected = mixtral_tensors(dict(zip([n for n, _ in hf.named_parameters()], g_hf, strict=True)), cfg.n_layers)
    got = dict(zip([n for n, _ in ours.named_parameters()], g, strict=True))
    assert got.keys() == expected.keys()
    for name in expected:
        assert_close(got[name], expected[name], f"gradient of {name}")


def test_from_hf_rejects_what_moe_transformer_cannot_compute():
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        from_hf(hf_model("mixtral", tie_word_embeddings=True))
    with pytest.raises(ValueError, match="to_hetermoe"):
        from_hf(hf_model("olmoe"))


# -- the new options against the naive reference, and their validation ----------------------

@pytest.mark.parametrize("kw", [
    dict(normalize_topk=False, top_k=3),
    dict(shared_expert_d_ff=7),
    dict(shared_expert_d_ff=6, normalize_topk=False, activation="gelu", bias=True, capacity_factor=0.6),
])
def test_new_layer_options_match_reference(kw):
    check(MoEConfig(**{"num_experts": 5, "top_k": 2, "d_ff": 9, "router": "topk", **kw}))


def test_gqa_with_as_many_kv_heads_is_plain_attention():
    from lightning_hetermoe import MoETransformer

    torch.manual_seed(0)
    a = MoETransformer(ModelConfig(d_model=16, n_heads=4, max_seq_len=8, moe=MoEConfig(num_experts=2, d_ff=8)))
    torch.manual_seed(0)
    b = MoETransformer(ModelConfig(d_model=16, n_heads=4, n_kv_heads=4, max_seq_len=8,
                                   moe=MoEConfig(num_experts=2, d_ff=8)))
    tokens = torch.randint(0, 256, (2, 8))
    assert torch.equal(a(tokens)[0], b(tokens)[0])


@pytest.mark.parametrize("kw,match", [
    (dict(n_kv_heads=3), "model.n_kv_heads"), (dict(n_kv_heads=0), "model.n_kv_heads"),
    (dict(n_kv_heads=8), "model.n_kv_heads"), (dict(rope_theta=0.0), "model.rope_theta"),
    (dict(norm_eps=-1e-6), "model.norm_eps"), (dict(norm_eps=0), "model.norm_eps"),
])
def test_bad_model_options(kw, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(n_heads=4, d_model=64, **kw)


@pytest.mark.parametrize("kw,match", [
    (dict(shared_expert_d_ff=-1), "model.moe.shared_expert_d_ff"),
    (dict(shared_expert_d_ff=1.5), "model.moe.shared_expert_d_ff"),
    (dict(normalize_topk=False, router="gshard"), "model.moe.normalize_topk"),
    (dict(normalize_topk="no"), "model.moe.normalize_topk"),
    (dict(router_dtype="bfloat16"),
     r"model.moe.router_dtype='bfloat16' is invalid: must be one of \('float32', 'input'\)"),
])
def test_bad_moe_options(kw, match):
    with pytest.raises(ConfigError, match=match):
        MoEConfig(**kw)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_converted_block_routes_by_its_family_logits_dtype(arch):
    """Mixtral, Qwen-MoE and OLMoE compute the gate's logits in the hidden dtype: a converted
    block does too (``router_dtype=input``) unless the caller asks for fp32; in bf16 its
    logits are then transformers' own, bit for bit."""
    config = hf_config(arch, experts_implementation="eager")
    block = ARCHS[arch][2](config).eval()
    randomize(block)
    layers = {}
    for options in ({}, {"router_dtype": "float32"}):
        holder = nn.Module()
        holder.config, holder.mlp = config, copy.deepcopy(block)
        to_hetermoe(holder, **options)
        layers[options.get("router_dtype", "default")] = holder.mlp
    assert layers["default"].cfg.router_dtype == "input" and layers["float32"].cfg.router_dtype == "float32"
    x = torch.randn(40, 16).bfloat16()
    hf_logits = copy.deepcopy(block).bfloat16().gate(x)[0]
    assert torch.equal(layers["default"].bfloat16().router.logits(x), hf_logits.float())
    fp32 = layers["float32"].bfloat16().router.logits(x)
    assert fp32.dtype == torch.float32 and not torch.equal(fp32, hf_logits.float())


def test_recipe_builds_a_converted_mixtral_of_the_configured_shape():
    from lightning_hetermoe import HFMoELanguageModel, ModelConfig, MoEConfig, OptimConfig
    from lightning_hetermoe.configs import ConfigError
    from lightning_hetermoe.training import build_model

    cfg = ModelConfig(d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=16, architecture="hf_mixtral",
                      moe=MoEConfig(num_experts=6, top_k=2, d_ff=20, aux_loss_coef=0.02, z_loss_coef=0.003))
    model = build_model(cfg, OptimConfig())
    assert isinstance(model, HFMoELanguageModel)
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    assert len(layers) == 3 and layers[0].num_experts == 6 and layers[0].experts.d_ff == 20
    # the balance coefficient maps back through Hugging Face's pooling factor to the configured one
    assert abs(layers[0].cfg.aux_loss_coef - 0.02) < 1e-12 and layers[0].cfg.z_loss_coef == 0.003
    assert model.model.config.num_key_value_heads == 2
    with pytest.raises(ConfigError, match="router=topk"):
        build_model(ModelConfig(architecture="hf_mixtral", moe=MoEConfig(router="switch", top_k=1)), OptimConfig())
    with pytest.raises(ValueError, match="model.architecture"):
        ModelConfig(architecture="llama")
