"""Bring your own model: Hugging Face MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
DeepSeek-V3) trained with the strategy. ``transformers`` is needed only to build the
models; nothing here imports it."""

from .hf import HFMoEBlock, moe_aux, moe_config_for, moe_tensors_from_hf, moe_tensors_to_hf, to_hetermoe, to_hf
from .lm import HFMoELanguageModel
from .mixtral import from_hf, mixtral_tensors, model_config_from_mixtral
from .pretrained import from_pretrained

__all__ = [
    "HFMoEBlock",
    "HFMoELanguageModel",
    "from_hf",
    "from_pretrained",
    "mixtral_tensors",
    "model_config_from_mixtral",
    "moe_aux",
    "moe_config_for",
    "moe_tensors_from_hf",
    "moe_tensors_to_hf",
    "to_hetermoe",
    "to_hf",
]
