"""A converted tiny random Hugging Face MoE model trains under the strategy (expert
parallelism on 2 real gloo processes) exactly as one process trains it on the global batch,
at the default settings (balance and z-loss on, the default optimizer)."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch

from harness import run_ranks
from lightning_hetermoe import HeterMoEStrategy, HFMoELanguageModel, MoELayer
from reference import SEQ, assert_same_params, data, reference_fit, trainer

pytest.importorskip("transformers")

STEPS = 4
WORLD = 2


def build(arch: str, seed: int) -> HFMoELanguageModel:
    """Seeded per rank: the strategy must start every rank from rank 0's weights."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    common = dict(hidden_size=16, intermediate_size=12, num_attention_heads=2, num_key_value_heads=1, vocab_size=256,
                  num_hidden_layers=2, max_position_embeddings=SEQ, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None, num_experts_per_tok=2)
    torch.manual_seed(seed)
    if arch == "mixtral":
        hf = MixtralForCausalLM(MixtralConfig(**common, num_local_experts=4))
    else:  # a dense shared expert beside the routed ones, un-normalised top-k
        hf = Qwen2MoeForCausalLM(Qwen2MoeConfig(**common, num_experts=4, moe_intermediate_size=8,
                                                shared_expert_intermediate_size=10, norm_topk_prob=False))
    return HFMoELanguageModel(hf.float())


# (architecture, gradient checkpointing): Hugging Face's own checkpointing recomputes each
# decoder layer, all-to-all included, inside the backward
ARCHS = [("mixtral", False), ("qwen2_moe", False), ("mixtral", True)]


class HeldExperts(L.Callback):
    """Experts per layer on this rank while training: proof that they were spread."""

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.held = [m.experts.num_local_experts for m in pl_module.modules() if isinstance(m, MoELayer)]


def fit(rank: int, world: int) -> list[dict]:
    out = []
    for arch, checkpointed in ARCHS:
        model = build(arch, seed=rank)
        calls = []
        if checkpointed:
            model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            for m in model.modules():
                if isinstance(m, MoELayer):
                    # training forwards only (set-up runs one warm-up forward in eval mode)
                    m.register_forward_pre_hook(lambda mod, args: calls.append(1) if mod.training else None)
        held = HeldExperts()
        trainer(HeterMoEStrategy(mode="ep"), world, max_steps=STEPS, callbacks=[held]).fit(model,
                                                                                         datamodule=data(world))
        out.append(({k: v.clone() for k, v in model.state_dict().items()}, held.held, len(calls)))
    return out if rank == 0 else None


def test_converted_hf_model_trains_like_one_process():
    results = run_ranks(WORLD, fit, WORLD)[0]
    for (arch, checkpointed), (actual, held, calls) in zip(ARCHS, results):
        if checkpointed:  # every MoE layer ran twice per step: forward, then recomputed in backward
            assert calls == 2 * 2 * STEPS, calls
        assert held == [2, 2], f"{arch}: 4 experts per layer should be split 2+2 over 2 ranks, rank 0 held {held}"
        model = build(arch, seed=0)
        layers = [m for m in model.modules() if isinstance(m, MoELayer)]
        assert len(layers) == 2 and layers[0].cfg.aux_loss_coef > 0 and layers[0].cfg.z_loss_coef > 0
        initial = copy.deepcopy(model.state_dict())
        expected = reference_fit(model, STEPS)
        assert_same_params(actual, expected, initial)


def test_zebra_is_refused_with_a_reason():
    from types import SimpleNamespace

    model = build("mixtral", seed=0)
    model._trainer = SimpleNamespace(strategy=SimpleNamespace(mode="zebra"))
    with pytest.raises(ValueError, match="mode='ep'"):
        model.setup("fit")
    model._trainer = SimpleNamespace(strategy=SimpleNamespace(mode="ep"))
    model.setup("fit")
