"""Pretrained Hugging Face weights read per rank, and checkpoints exported back.

A tiny random model of each family is saved with ``save_pretrained`` (sharded, with its
index JSON) into a temporary directory; :func:`from_pretrained` builds it on the meta device
and each process reads the tensors and expert rows it holds. The result computes what the
saved model computes; trained under the strategy it equals one process; its sharded
checkpoint exports to a directory Transformers loads as its own."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from harness import run_ranks
from lightning_hetermoe import HeterMoEStrategy, HFMoELanguageModel, MoELayer
from lightning_hetermoe.convert.export import export_hf
from lightning_hetermoe.convert import from_pretrained  # where README imports it from
from lightning_hetermoe.convert.hf import export_info
from lightning_hetermoe.convert.pretrained import HFWeights, PretrainedError, materialize_whole
from lightning_hetermoe.materialize import Target
from reference import SEQ, assert_same_params, data, make_model, reference_fit, trainer, whole_state

tf = pytest.importorskip("transformers")

EXPERTS = 4
STEPS = 3


def tiny(arch: str, seed: int = 0):
    common = dict(hidden_size=16, intermediate_size=12, num_attention_heads=2, num_key_value_heads=1, vocab_size=256,
                  num_hidden_layers=2, max_position_embeddings=SEQ, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None, num_experts_per_tok=2)
    torch.manual_seed(seed)
    if arch == "mixtral":  # on disk: block_sparse_moe.experts.{e}.w1/w3/w2
        return tf.MixtralForCausalLM(tf.MixtralConfig(**common, num_local_experts=EXPERTS)).eval()
    if arch == "qwen2_moe":  # a gated shared expert
        return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(**common, num_experts=EXPERTS, moe_intermediate_size=8,
                                                        shared_expert_intermediate_size=10)).eval()
    if arch == "deepseek_v3":  # a dense first layer, an ungated shared expert, the correction bias
        hf = tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
            **{**common, "num_hidden_layers": 3, "num_key_value_heads": 2}, moe_intermediate_size=8,
            first_k_dense_replace=1, n_routed_experts=EXPERTS, n_shared_experts=1, n_group=2, topk_group=1,
            q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4,
            rope_scaling=None)).eval()
        with torch.no_grad():  # a bias that is not zero, so that reading it is tested
            for m in hf.modules():
                if hasattr(m, "e_score_correction_bias"):
                    m.e_score_correction_bias.uniform_(-0.1, 0.1)
        return hf
    raise ValueError(arch)


def saved(arch: str, directory: str, fused: bool = False) -> str:
    hf = tiny(arch)
    if fused:  # the model's own (fused expert) names, which Transformers also reads
        from safetensors.torch import save_file

        hf.config.save_pretrained(directory)
        save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, os.path.join(directory, "model.safetensors"))
    else:
        hf.save_pretrained(directory, max_shard_size="40KB")  # several files and the index JSON
    return directory


def logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=tokens, use_cache=False).logits


@pytest.mark.parametrize("arch,fused", [("mixtral", False), ("mixtral", True), ("qwen2_moe", False),
                                        ("deepseek_v3", False)])
def test_from_pretrained_computes_what_the_saved_model_computes(tmp_path, arch, fused):
    directory = saved(arch, str(tmp_path), fused)
    if not fused:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    model = from_pretrained(directory)
    assert all(p.is_meta for p in model.parameters()), "nothing is read before materialisation"
    materialize_whole(model.train(False))
    tokens = torch.randint(0, 256, (2, SEQ))
    torch.testing.assert_close(logits(model, tokens), logits(tiny(arch), tokens), rtol=1e-5, atol=1e-5)


def test_a_rank_reads_only_the_expert_rows_it_holds(tmp_path):
    directory = saved("mixtral", str(tmp_path))
    hf = tiny("mixtral")
    source = HFWeights(directory, ["model.layers.0.mlp", "model.layers.1.mlp"])
    local = torch.full((2, 16, 24), float("nan"))
    filled = source.fill({"model.layers.1.mlp.experts.w_up": Target(local, rows=[3, 1])})
    assert filled == {"model.layers.1.mlp.experts.w_up"}
    want = hf.model.layers[1].mlp.experts.gate_up_proj.detach()[[3, 1]].transpose(1, 2)
    torch.testing.assert_close(local, want)


def test_bad_directories_are_refused_with_the_reason(tmp_path):
    with pytest.raises(PretrainedError, match="config.json"):
        from_pretrained(tmp_path)
    tiny("mixtral").config.save_pretrained(str(tmp_path))
    with pytest.raises(PretrainedError, match="safetensors"):
        from_pretrained(tmp_path)


def test_a_full_checkpoint_exports_to_hugging_face_and_loads_back(tmp_path):
    # a converted Hugging Face model: its own names and layout again
    hf = tiny("qwen2_moe")
    lm = HFMoELanguageModel(copy.deepcopy(hf))
    ckpt = tmp_path / "hf.ckpt"
    torch.save({"state_dict": lm.state_dict(), "hetermoe": {"hf": export_info(lm)}}, ckpt)
    lines: list[str] = []
    out = export_hf(ckpt, tmp_path / "hf_out", max_shard_bytes=20_000, progress_every_s=0.0, say=lines.append)
    assert len(list(out.glob("*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    total = sum(t.numel() * t.element_size() for t in lm.state_dict().values())
    assert len(lines) == len(lm.state_dict()), "a line a tensor read, where every one is due"
    assert lines[-1].startswith(f"[hetermoe] to-hf: {total / 1e9:,.2f} of {total / 1e9:,.2f} GB read (100%)"), lines
    back = tf.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tokens = torch.randint(0, 256, (2, SEQ))
    torch.testing.assert_close(logits(back, tokens), logits(hf, tokens), rtol=1e-5, atol=1e-5)
    # the pack's own model: the Mixtral that computes the same function
    pack = make_model(EXPERTS).eval()
    ckpt = tmp_path / "pack.ckpt"
    torch.save({"state_dict": pack.state_dict(), "hyper_parameters": dict(pack.hparams)}, ckpt)
    mixtral = tf.AutoModelForCausalLM.from_pretrained(str(export_hf(ckpt, tmp_path / "pack_out"))).eval()
    with torch.no_grad():
        torch.testing.assert_close(logits(mixtral, tokens), pack(tokens), rtol=1e-5, atol=1e-5)


# -- per rank, under the strategy ------------------------------------------------------------------
def fit_pretrained(rank: int, world: int, directory: str, ckpt_dir: str) -> list:
    from helpers_zebra import make_test_plan

    out = []
    for mode, plan in (("ep", None), ("zebra", make_test_plan(world, [0], R=2, num_experts=EXPERTS))):
        model = HFMoELanguageModel(from_pretrained(directory))
        t = trainer(HeterMoEStrategy(mode=mode, plan=plan, checkpoint_format="sharded"), world, max_steps=STEPS)
        t.fit(model, datamodule=data(world))
        held = [m.experts.num_local_experts for m in model.modules() if isinstance(m, MoELayer)]
        path = os.path.join(ckpt_dir, f"{mode}.ckpt")
        t.save_checkpoint(path)
        out.append((whole_state(t), held))
    return out if rank == 0 else [o[1] for o in out]


@pytest.mark.slow
def test_pretrained_weights_per_rank_train_like_one_process_and_export_back(tmp_path):
    directory = saved("mixtral", str(tmp_path / "pretrained"))
    ckpt_dir = str(tmp_path / "ckpts")
    os.makedirs(ckpt_dir)
    results = run_ranks(2, fit_pretrained, 2, directory, ckpt_dir)
    reference = HFMoELanguageModel(materialize_whole(from_pretrained(directory)))
    initial = copy.deepcopy(reference.state_dict())
    want = reference_fit(reference, STEPS)
    for i, mode in enumerate(("ep", "zebra")):
        state, held0 = results[0][i]
        held1 = results[1][i]
        assert_same_params(state, want, initial)
        if mode == "ep":
            assert held0 == held1 == [2, 2], "each rank materialised half of every layer's experts"
        else:
            assert held0 == [0, 0] and held1 == [EXPERTS, EXPERTS], "experts live on the expert rank only"
        # the sharded checkpoint, exported: Transformers loads the trained model
        out = export_hf(os.path.join(ckpt_dir, f"{mode}.ckpt"), tmp_path / f"export_{mode}")
        back = tf.AutoModelForCausalLM.from_pretrained(str(out)).eval()
        trained = HFMoELanguageModel(materialize_whole(from_pretrained(directory)))
        trained.load_state_dict(state)
        tokens = torch.randint(0, 256, (2, SEQ))
        torch.testing.assert_close(logits(back, tokens), logits(trained.model.eval(), tokens), rtol=1e-5, atol=1e-5)


def test_the_offline_command_exports_and_says_what_it_wrote_or_why_not(tmp_path, capsys):
    from lightning_hetermoe.ckpt.__main__ import main as ckpt_main
    from lightning_hetermoe.convert.__main__ import main

    pack = make_model(EXPERTS)
    ckpt = tmp_path / "pack.ckpt"
    torch.save({"state_dict": pack.state_dict(), "hyper_parameters": dict(pack.hparams)}, ckpt)
    assert main(["to-hf", str(ckpt), str(tmp_path / "out"), "--max-shard-gb", "0.00001"]) == 0
    assert "wrote" in capsys.readouterr().out and (tmp_path / "out" / "config.json").is_file()
    many = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    (tmp_path / "out" / "tokenizer.json").write_text("{}")  # what a user adds to an export
    # again into it with fewer, larger shards: the earlier shards go, the user's file stays
    assert main(["to-hf", str(ckpt), str(tmp_path / "out")]) == 0
    assert "wrote" in capsys.readouterr().out and len(many) > 1
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json", "tokenizer.json"]
    # an export into it stopped half-way, its shards written: the first export as it was
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    with pytest.MonkeyPatch.context() as mp:
        from lightning_hetermoe.convert import export

        def stopped(self):
            self._flush()
            raise KeyboardInterrupt

        mp.setattr(export._ShardedSafetensors, "close", stopped)
        with pytest.raises(KeyboardInterrupt):
            main(["to-hf", str(ckpt), str(tmp_path / "out"), "--max-shard-gb", "0.00001"])
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "pack.ckpt"]
    # an output that cannot be written: one line, before the checkpoint is read
    assert ckpt_main(["consolidate", str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 2
    assert f"consolidate: out='{tmp_path / 'out'}' is invalid: it cannot be written (it is a directory)" in \
        capsys.readouterr().err
    assert main(["to-hf", str(ckpt), str(ckpt)]) == 2
    assert f"to-hf: out='{ckpt}' is invalid: it cannot be written (it is a file)" in capsys.readouterr().err
    assert main(["to-hf", str(tmp_path / "missing.ckpt"), str(tmp_path / "out2")]) == 2
    assert "to-hf:" in capsys.readouterr().err and not (tmp_path / "out2").exists()
    assert ckpt_main(["consolidate", str(tmp_path), str(tmp_path / "whole.ckpt")]) == 2
    assert "is not a sharded checkpoint directory" in capsys.readouterr().err
    # the export's old place names its new one
    assert ckpt_main(["to-hf", str(ckpt), str(tmp_path / "out3"), "--max-shard-gb", "1"]) == 2
    assert "python -m lightning_hetermoe.convert to-hf" in capsys.readouterr().err
