"""DeepSeek-V3 (``DeepseekV3ForCausalLM`` in transformers 5.23) converts to the pack's
layer and back: sigmoid scores, group-limited top-k with its per-expert correction bias,
an ungated shared expert, dense first layers. Outputs and every gradient equal
transformers' own model; and the aux-loss-free bias behaves as DeepSeek-V3 describes it
under every router: it steers the choice, never the weights, and moves by the load."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_hetermoe import MoEConfig, MoELayer, to_hetermoe, to_hf
from lightning_hetermoe.model_contract import find_blocks
from lightning_hetermoe.moe import build_router

transformers = pytest.importorskip("transformers")
from helpers_hf import assert_same_model, hf_model, randomize  # noqa: E402

E = 8


def deepseek(seed: int = 0, layers: int = 3, **kw):
    config = transformers.DeepseekV3Config(**{**dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=12, num_hidden_layers=layers,
        first_k_dense_replace=1, n_routed_experts=E, n_shared_experts=1, num_experts_per_tok=3, n_group=4,
        topk_group=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=32, rope_scaling=None,
        routed_scaling_factor=2.5, norm_topk_prob=True, bos_token_id=None, eos_token_id=None, pad_token_id=None),
        **kw})
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config).float()
    randomize(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # a correction bias that changes choices
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.3)
    return model


def test_converted_deepseek_v3_matches_transformers_outputs_and_every_gradient():
    hf = deepseek().train()
    conv = to_hetermoe(copy.deepcopy(hf))
    blocks = find_blocks(conv)
    assert len(blocks) == 2, "the first layer stays dense"
    layer = blocks[0][2]
    assert layer.cfg.router == "sigmoid_group" and layer.cfg.expert_bias and not layer.cfg.shared_expert_gate
    assert layer.router.expert_bias.abs().max() > 0
    assert_same_model(hf, conv)


def test_deepseek_v3_round_trip_gives_identical_tensors():
    hf = deepseek()
    original = {k: v.clone() for k, v in hf.state_dict().items()}
    back = to_hf(to_hetermoe(hf))
    assert not any(isinstance(m, MoELayer) for m in back.modules())
    sd = back.state_dict()
    assert sd.keys() == original.keys()
    for name in original:
        assert torch.equal(sd[name], original[name]), name


ROUTERS = ["topk", "switch", "gshard", "noisy_topk", "sigmoid_group"]


def router_cfg(router: str, **kw) -> MoEConfig:
    k = {"switch": 1}.get(router, 2)
    group = dict(n_group=4, topk_group=2, routed_scaling_factor=2.5) if router == "sigmoid_group" else {}
    return MoEConfig(num_experts=E, top_k=k, router=router, **group, **kw)


def unbiased_weights(router: str, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The combine weights of the experts ``idx`` from the unbiased scores alone (eval mode)."""
    if router == "sigmoid_group":
        s = logits.sigmoid().gather(1, idx)
        return s / (s.sum(-1, keepdim=True) + 1e-20) * 2.5
    if router == "noisy_topk":
        return logits.gather(1, idx).softmax(-1)
    p = logits.softmax(-1).gather(1, idx)
    return p if router == "switch" else p / p.sum(-1, keepdim=True)


@pytest.mark.parametrize("router", ROUTERS)
def test_the_bias_steers_the_choice_not_the_weights_and_zero_changes_nothing(router):
    torch.manual_seed(0)
    plain = build_router(router_cfg(router), 16).eval()
    biased = build_router(router_cfg(router, expert_bias=True), 16).eval()
    biased.load_state_dict({**plain.state_dict(), "expert_bias": torch.zeros(E)})
    x = torch.randn(10, 16)
    a, b = plain(x), biased(x)
    assert torch.equal(a.indices, b.indices) and torch.equal(a.weights, b.weights), "a zero bias changes nothing"
    assert "expert_bias" not in plain.state_dict() and plain.expert_bias is None
    assert not (a.indices == 3).any(-1).all(), "expert 3 is everyone's choice already: the test shows nothing"
    with torch.no_grad():
        biased.expert_bias[3] = 100.0  # every token now chooses expert 3 ...
    out = biased(x)
    assert (out.indices == 3).any(-1).all()
    # ... at the weight its unbiased score gives it; probs and logits know nothing of the bias
    torch.testing.assert_close(out.weights, unbiased_weights(router, out.logits, out.indices), rtol=1e-6, atol=0)
    assert torch.equal(out.logits, a.logits) and torch.equal(out.probs, a.probs)


def reference_route(router: str, r, x: torch.Tensor, seed: int):
    """Each router's routing written out from its definition, with the router's own random
    draws replayed from ``seed`` (training mode): what a bias-off router must give, bit for bit."""
    torch.manual_seed(seed)
    keep = None
    if router == "switch":
        x = x * torch.empty_like(x).uniform_(1.0 - r.jitter_eps, 1.0 + r.jitter_eps)
    logits = x @ r.weight.t()
    if router == "noisy_topk":
        noisy = logits + torch.randn_like(logits) * torch.nn.functional.softplus(x @ r.noise_weight.t())
        top = noisy.topk(2)
        return top.indices, top.values.softmax(-1), keep
    if router == "sigmoid_group":
        s = logits.sigmoid()
        group = s.view(-1, 4, 2).sum(-1)  # groups of two: a group's score is both its experts
        allowed = torch.zeros_like(group, dtype=torch.bool).scatter(1, group.topk(2).indices, True)
        idx = s.masked_fill(~allowed.repeat_interleave(2, 1), float("-inf")).topk(2).indices
        w = s.gather(1, idx)
        return idx, w / (w.sum(-1, keepdim=True) + 1e-20) * 2.5, keep
    top = logits.softmax(-1).topk(r.top_k)
    w = top.values if router == "switch" else top.values / top.values.sum(-1, keepdim=True)
    if router == "gshard":
        keep = torch.ones_like(top.indices, dtype=torch.bool)
        keep[:, 1] = torch.rand(x.shape[0]) < 2.0 * w[:, 1]
    return top.indices, w, keep


@pytest.mark.parametrize("router", ROUTERS)
def test_bias_off_routers_route_as_their_definition_says(router):
    torch.manual_seed(1)
    r = build_router(router_cfg(router), 16).train()
    with torch.no_grad():
        if router == "noisy_topk":
            r.noise_weight.normal_()
    x = torch.randn(64, 16)
    idx, w, keep = reference_route(router, r, x, seed=7)
    torch.manual_seed(7)
    out = r(x)
    assert torch.equal(out.indices, idx)
    torch.testing.assert_close(out.weights, w, rtol=1e-6, atol=0)
    if keep is not None:
        assert torch.equal(out.keep, keep) and not keep.all(), "the draw of GShard's second choice was not replayed"


def test_update_moves_each_bias_toward_even_load_by_the_rate():
    router = build_router(MoEConfig(num_experts=4, expert_bias=True, bias_update_rate=0.01), 8)
    router.update_expert_bias(torch.tensor([10, 2, 4, 4]))  # mean 5
    router.update_expert_bias(torch.tensor([1, 9, 5, 5]))
    assert torch.equal(router.expert_bias, torch.tensor([0.0, 0.0, 0.0, 0.0]) + torch.tensor([-0.01, 0.01, 0.01, 0.01])
                       + torch.tensor([0.01, -0.01, 0.0, 0.0]))
    restored = build_router(MoEConfig(num_experts=4, expert_bias=True), 8)
    restored.load_state_dict(router.state_dict())
    assert torch.equal(restored.expert_bias, router.expert_bias)
    with pytest.raises(RuntimeError, match="expert_bias=true"):
        build_router(MoEConfig(num_experts=4), 8).update_expert_bias(torch.ones(4))


def test_the_bias_stays_fp32_when_the_model_is_cast():
    """bf16-true casts the whole model; in bf16 the 1e-3 steps would stop moving a bias of 0.5."""
    router = build_router(MoEConfig(num_experts=4, expert_bias=True), 8).to(torch.bfloat16)
    assert router.weight.dtype == torch.bfloat16 and router.expert_bias.dtype == torch.float32
    for _ in range(600):
        router.update_expert_bias(torch.tensor([0, 1, 1, 2]))
    assert router.expert_bias[0] == pytest.approx(0.6, abs=1e-4)
    assert build_router(MoEConfig(num_experts=4), 8).to(torch.bfloat16).expert_bias is None
    hf = deepseek(layers=2).to(torch.bfloat16)
    layer = find_blocks(to_hetermoe(hf))[0][2]
    assert layer.router.expert_bias.dtype == torch.float32 and layer.router.weight.dtype == torch.bfloat16


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_deepseek_v3_without_shared_experts_converts_and_back():
    """n_shared_experts=0 gives a zero-width MLP in transformers: nothing to carry, nothing lost."""
    hf = deepseek(layers=2, n_shared_experts=0).train()
    conv = to_hetermoe(copy.deepcopy(hf))
    layer = find_blocks(conv)[0][2]
    assert layer.shared_expert is None and layer.cfg.shared_expert_d_ff == 0
    assert_same_model(hf, conv)
    original = {k: v.clone() for k, v in hf.state_dict().items()}
    sd = to_hf(conv).state_dict()
    assert sd.keys() == original.keys() and all(torch.equal(sd[k], original[k]) for k in original)


def test_conversion_errors_name_the_bias():
    with pytest.raises(ValueError, match="bias_update_rate=0"):
        to_hetermoe(deepseek(layers=2), expert_bias=False)
    layer = find_blocks(to_hetermoe(deepseek(layers=2), expert_bias=True, bias_update_rate=0.0))[0][2]
    assert layer.cfg.expert_bias and layer.cfg.bias_update_rate == 0.0
    mixtral = to_hetermoe(hf_model("mixtral"), expert_bias=True)  # balancing by a bias: fine to train ...
    assert torch.equal(find_blocks(mixtral)[0][2].router.expert_bias, torch.zeros(5))
    with pytest.raises(ValueError, match="expert_bias"):  # ... but Mixtral has nowhere to keep it
        to_hf(mixtral)


@pytest.mark.parametrize("kw, match", [
    (dict(router="sigmoid_group", num_experts=8, n_group=3), "model.moe.n_group=3"),
    (dict(router="sigmoid_group", num_experts=8, n_group=2, topk_group=3), "model.moe.topk_group=3"),
    (dict(router="sigmoid_group", num_experts=8, top_k=3, n_group=4, topk_group=1), r"model.moe.top_k=3.*<= .* 2"),
    (dict(router="sigmoid_group", routed_scaling_factor=0), "model.moe.routed_scaling_factor"),
    (dict(router="topk", n_group=2), "model.moe.n_group=2.*sigmoid_group"),
    (dict(router="topk", routed_scaling_factor=2.5), "model.moe.routed_scaling_factor=2.5.*sigmoid_group"),
    (dict(expert_bias="yes"), "model.moe.expert_bias"),
    (dict(shared_expert_gate=0), "model.moe.shared_expert_gate"),
    (dict(bias_update_rate=-1e-3), "model.moe.bias_update_rate"),
])
def test_bad_deepseek_options_name_the_field(kw, match):
    from lightning_hetermoe.configs import ConfigError

    with pytest.raises(ConfigError, match=match):
        MoEConfig(**kw)
