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
from lightning_hetermoe.contract import find_blocks
from lightning_hetermoe.moe import build_router

transformers = pytest.importorskip("transformers")
from test_hf_convert import assert_same_model, randomize  # noqa: E402

E = 8


def deepseek(seed: int = 0, layers: int = 3):
    config = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=12, num_hidden_layers=layers,
        first_k_dense_replace=1, n_routed_experts=E, n_shared_experts=1, num_experts_per_tok=3, n_group=4,
        topk_group=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=32, rope_scaling=None,
        routed_scaling_factor=2.5, norm_topk_prob=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
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


@pytest.mark.parametrize("router", ["topk", "switch", "gshard", "noisy_topk", "sigmoid_group"])
def test_the_bias_steers_the_choice_not_the_weights_and_off_changes_nothing(router):
    k = {"switch": 1, "gshard": 2}.get(router, 2)
    kw = dict(n_group=2, topk_group=2) if router == "sigmoid_group" else {}
    cfg = MoEConfig(num_experts=4, top_k=k, router=router, **kw)
    torch.manual_seed(0)
    plain = build_router(cfg, 16).eval()
    biased = build_router(MoEConfig(**{**cfg.__dict__, "expert_bias": True}), 16).eval()
    biased.load_state_dict({**plain.state_dict(), "expert_bias": torch.zeros(4)})
    x = torch.randn(10, 16)
    a, b = plain(x), biased(x)
    assert torch.equal(a.indices, b.indices) and torch.equal(a.weights, b.weights), "a zero bias changes nothing"
    assert "expert_bias" not in plain.state_dict()
    with torch.no_grad():
        biased.expert_bias[3] = 100.0  # every token now chooses expert 3 ...
    out = biased(x)
    assert (out.indices == 3).any(-1).all()
    # ... at the weight its unbiased score gives it
    pos = (out.indices == 3).float().argmax(-1)
    w3 = out.weights.gather(1, pos[:, None])[:, 0]
    if router == "sigmoid_group" or k > 1:
        assert not torch.allclose(w3, torch.ones_like(w3))
    assert (w3 < 50).all(), "the bias leaked into the combine weights"


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
    with pytest.raises(ValueError, match="bias_update_rate"):
        MoEConfig(bias_update_rate=-1)
