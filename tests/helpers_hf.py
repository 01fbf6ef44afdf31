"""Tiny random Hugging Face MoE models (no download) and the check that a converted model
computes what transformers' own does: logits and every parameter gradient."""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.mixtral import modeling_mixtral as hf_mixtral
from transformers.models.olmoe import modeling_olmoe as hf_olmoe
from transformers.models.qwen2_moe import modeling_qwen2_moe as hf_qwen2
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf_qwen3

from helpers_moe import assert_close
from lightning_hetermoe.convert import HFMoEBlock, HFMoELanguageModel, moe_tensors_from_hf

COMMON = dict(hidden_size=16, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
              num_hidden_layers=2, max_position_embeddings=32, bos_token_id=None, eos_token_id=None,
              pad_token_id=None)


ARCHS = {
    "mixtral": (hf_mixtral.MixtralConfig, hf_mixtral.MixtralForCausalLM, hf_mixtral.MixtralSparseMoeBlock,
                dict(num_local_experts=5, num_experts_per_tok=2)),
    "mixtral_jitter": (hf_mixtral.MixtralConfig, hf_mixtral.MixtralForCausalLM, hf_mixtral.MixtralSparseMoeBlock,
                       dict(num_local_experts=5, num_experts_per_tok=2, router_jitter_noise=0.2)),
    "qwen2_moe": (hf_qwen2.Qwen2MoeConfig, hf_qwen2.Qwen2MoeForCausalLM, hf_qwen2.Qwen2MoeSparseMoeBlock,
                  dict(num_experts=5, num_experts_per_tok=3, moe_intermediate_size=12,
                       shared_expert_intermediate_size=20, norm_topk_prob=False)),
    "qwen3_moe": (hf_qwen3.Qwen3MoeConfig, hf_qwen3.Qwen3MoeForCausalLM, hf_qwen3.Qwen3MoeSparseMoeBlock,
                  dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=12, norm_topk_prob=True)),
    "olmoe": (hf_olmoe.OlmoeConfig, hf_olmoe.OlmoeForCausalLM, hf_olmoe.OlmoeSparseMoeBlock,
              dict(num_experts=5, num_experts_per_tok=2, norm_topk_prob=False)),
}


def hf_config(arch: str, **kw):
    cls, _, _, extra = ARCHS[arch]
    return cls(**{**COMMON, **extra, **kw})


def randomize(module: nn.Module, seed: int = 0) -> None:
    """Weights large enough that routing and every expert matter (HF's init is std 0.02)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def hf_model(arch: str, seed: int = 0, **kw):
    torch.manual_seed(seed)
    model = ARCHS[arch][1](hf_config(arch, **kw)).float()
    randomize(model, seed)
    return model


def converted_grads(model: nn.Module, hf_grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF gradients under the converted model's names (each MoE block's mapped like its weights)."""
    out = dict(hf_grads)
    blocks = [n for n, m in model.named_modules() if isinstance(m, HFMoEBlock)]
    for b in blocks:
        sub = {k[len(b) + 1:]: out.pop(k) for k in list(out) if k.startswith(b + ".")}
        out.update({f"{b}.{k}": v for k, v in moe_tensors_from_hf(sub).items()})
    return out


def assert_same_model(hf: nn.Module, conv: nn.Module, vocab: int = 64) -> None:
    """Logits and every parameter gradient of the converted model equal transformers'."""
    tokens = torch.randint(0, vocab, (3, 12))
    upstream = torch.randn(3, 12, vocab)
    logits_hf = hf(input_ids=tokens).logits
    g_hf = torch.autograd.grad((logits_hf * upstream).sum(), list(hf.parameters()))
    logits = conv(input_ids=tokens).logits
    g = torch.autograd.grad((logits * upstream).sum(), list(conv.parameters()))
    assert_close(logits, logits_hf, "logits")
    expected = converted_grads(conv, dict(zip([n for n, _ in hf.named_parameters()], g_hf, strict=True)))
    ours = dict(zip([n for n, _ in conv.named_parameters()], g, strict=True))
    assert ours.keys() == expected.keys()
    for name in expected:
        assert_close(ours[name], expected[name], f"gradient of {name}")


def tiny_lm(arch: str, seed: int, experts: int, seq: int) -> HFMoELanguageModel:
    """A tiny random Hugging Face MoE language model of ``arch`` with ``experts`` routed
    experts, converted (``HFMoELanguageModel``), seeded (per rank in the training tests: the
    strategy must start every rank from rank 0's weights)."""
    import transformers as tf

    common = dict(hidden_size=16, intermediate_size=12, num_attention_heads=2, num_key_value_heads=1, vocab_size=256,
                  num_hidden_layers=2, max_position_embeddings=seq, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None, num_experts_per_tok=2)
    torch.manual_seed(seed)
    if arch == "mixtral":
        hf = tf.MixtralForCausalLM(tf.MixtralConfig(**common, num_local_experts=experts))
    elif arch == "qwen2_moe":  # a gated dense shared expert beside the routed ones, un-normalised top-k
        hf = tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(**common, num_experts=experts, moe_intermediate_size=8,
                                                      shared_expert_intermediate_size=10, norm_topk_prob=False))
    elif arch == "qwen3_moe":  # a dense decoder layer between the two MoE layers
        hf = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**{**common, "num_hidden_layers": 3}, num_experts=experts,
                                                      moe_intermediate_size=8, mlp_only_layers=[1]))
    elif arch == "olmoe":
        hf = tf.OlmoeForCausalLM(tf.OlmoeConfig(**common, num_experts=experts, norm_topk_prob=False))
    elif arch == "deepseek_v3":  # a dense first layer, an ungated shared expert, group-limited sigmoid routing
        # with its correction bias, moved each step by the global load (aux-loss-free balancing)
        hf = tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
            **{**common, "num_hidden_layers": 3, "num_key_value_heads": 2}, moe_intermediate_size=8, first_k_dense_replace=1,
            n_routed_experts=experts, n_shared_experts=1, n_group=2, topk_group=1, q_lora_rank=None, kv_lora_rank=8,
            qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4, rope_scaling=None, routed_scaling_factor=1.5))
    else:
        raise ValueError(arch)
    return HFMoELanguageModel(hf.float())
