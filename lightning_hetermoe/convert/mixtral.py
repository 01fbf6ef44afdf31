"""A Hugging Face Mixtral as this project's own :class:`~lightning_hetermoe.model.MoETransformer`.

The two compute the same function (pre-norm RMSNorm decoder, rotary attention with
half-split rotation, grouped-query attention, SwiGLU top-k experts), so the weights map
one to one: ``q_proj``/``k_proj``/``v_proj`` stack into ``qkv``, ``o_proj`` is ``proj``,
the MoE block maps as in :mod:`.hf`. Only tensors move; ``transformers`` is not imported.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..configs import ModelConfig, MoEConfig
from ..model.transformer import MoETransformer
from .hf import check_filled, fresh_copy, moe_tensors_from_hf


def model_config_from_mixtral(config: Any, **moe_options: Any) -> ModelConfig:
    """The :class:`ModelConfig` of a ``MixtralConfig``; raises where MoETransformer cannot
    compute what Mixtral computes."""
    if getattr(config, "model_type", None) != "mixtral":
        raise ValueError(f"model_type={getattr(config, 'model_type', None)!r}: MoETransformer has Mixtral's "
                         f"architecture; convert other models' MoE blocks with to_hetermoe instead")
    d, heads = config.hidden_size, config.num_attention_heads
    rope = dict(getattr(config, "rope_parameters", None) or {})
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    problems = []
    head_dim = getattr(config, "head_dim", None) or d // heads
    if head_dim * heads != d and head_dim % 2:
        problems.append(f"head_dim={head_dim} is odd (rotary embeddings pair its dimensions)")
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope_type={rope['rope_type']!r} (only plain rotary embeddings)")
    if config.hidden_act not in ("silu", "swish"):
        problems.append(f"hidden_act={config.hidden_act!r} (experts are SwiGLU)")
    if getattr(config, "tie_word_embeddings", False):
        problems.append("tie_word_embeddings=True (the output head is its own weight)")
    if getattr(config, "router_jitter_noise", 0.0):
        problems.append(f"router_jitter_noise={config.router_jitter_noise} (the topk router has no input jitter)")
    if problems:
        raise ValueError("this Mixtral config does not map onto MoETransformer: " + "; ".join(problems))
    # Within the sliding window, windowed attention is plain causal attention.
    window = getattr(config, "sliding_window", None)
    max_len = min(config.max_position_embeddings, window) if window else config.max_position_embeddings
    moe_options.setdefault("aux_loss_coef", config.router_aux_loss_coef * config.num_experts_per_tok
                           / config.num_hidden_layers)
    moe = MoEConfig(num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                    d_ff=config.intermediate_size, router="topk", activation="swiglu", **moe_options)
    return ModelConfig(name="mixtral", vocab_size=config.vocab_size, d_model=d, n_layers=config.num_hidden_layers,
                       n_heads=heads, n_kv_heads=config.num_key_value_heads, max_seq_len=max_len,
                       head_dim=None if head_dim * heads == d else head_dim,
                       rope_theta=float(theta), norm_eps=float(config.rms_norm_eps), moe=moe)


def mixtral_config_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """``MixtralConfig`` arguments for the Mixtral with ``cfg``'s shape: the inverse of
    :func:`model_config_from_mixtral` (what a recipe builds when ``model.architecture`` is
    ``hf_mixtral``). The balance coefficient maps back through the same pooling factor."""
    moe = cfg.moe
    if moe.activation != "swiglu" or moe.router != "topk" or moe.bias or moe.shared_expert_d_ff:
        raise ValueError(f"model.architecture=hf_mixtral needs moe.activation=swiglu, router=topk, bias=false and no "
                         f"shared expert; got activation={moe.activation}, router={moe.router}, bias={moe.bias}, "
                         f"shared_expert_d_ff={moe.shared_expert_d_ff}")
    if cfg.dense_layers:
        raise ValueError(f"model.dense_layers={cfg.dense_layers}: a Mixtral has an MoE FFN in every layer; "
                         f"model.architecture=hf_mixtral (and the Mixtral export) needs model.dense_layers=0")
    return dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=moe.d_ff,
                num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, head_dim=cfg.head_size,
                num_key_value_heads=cfg.n_kv_heads or cfg.n_heads, max_position_embeddings=cfg.max_seq_len,
                rope_theta=cfg.rope_theta, rms_norm_eps=cfg.norm_eps, num_local_experts=moe.num_experts,
                num_experts_per_tok=moe.top_k, router_aux_loss_coef=moe.aux_loss_coef * cfg.n_layers / moe.top_k,
                router_jitter_noise=0.0, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                pad_token_id=None)


def mixtral_tensors(sd: dict[str, Tensor], n_layers: int) -> dict[str, Tensor]:
    """A ``MixtralForCausalLM`` state dict (or its gradients, same names) as an
    :class:`MoETransformer`'s."""
    out = {"embed.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"],
           "head.weight": sd["lm_head.weight"]}
    for i in range(n_layers):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        a = hf + "self_attn."
        out[ours + "attn_norm.weight"] = sd[hf + "input_layernorm.weight"]
        out[ours + "moe_norm.weight"] = sd[hf + "post_attention_layernorm.weight"]
        out[ours + "attn.qkv.weight"] = torch.cat([sd[a + "q_proj.weight"], sd[a + "k_proj.weight"],
                                                   sd[a + "v_proj.weight"]], dim=0)
        out[ours + "attn.proj.weight"] = sd[a + "o_proj.weight"]
        block = {k[len(hf + "mlp."):]: v for k, v in sd.items() if k.startswith(hf + "mlp.")}
        for k, v in moe_tensors_from_hf(block).items():
            out[ours + "moe." + k] = v
    return out


def from_hf(hf_model: nn.Module, **moe_options: Any) -> MoETransformer:
    """A new :class:`MoETransformer` with the config and weights of a Hugging Face
    ``MixtralForCausalLM`` (``moe_options``: further :class:`MoEConfig` fields)."""
    cfg = model_config_from_mixtral(hf_model.config, **moe_options)
    with torch.device("meta"):  # weights come from the HF model: no init, no RNG draws
        model = MoETransformer(cfg)
    sd = mixtral_tensors(hf_model.state_dict(), cfg.n_layers)
    model.load_state_dict({k: fresh_copy(v) for k, v in sd.items()}, strict=True, assign=True)
    for block in model.blocks:
        block.moe.experts.expert_ids = torch.arange(cfg.moe.num_experts, device=model.embed.weight.device)
    check_filled(model, "MoETransformer")
    return model
