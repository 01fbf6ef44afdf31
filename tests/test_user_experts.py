"""The experts and gate a user writes (FastMoE's interface): an expert module class and a
Router subclass with a loss of its own, inside the user's own blocks, train under expert
parallelism (with a migration of experts and their optimizer state mid-run) and zebra on
real gloo processes exactly as one process trains them; a zebra checkpoint resumes under
ep; the stacked experts compute what the user's modules compute, gradients included; a
module that cannot be stacked is refused with the reason."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from harness import run_ranks
from lightning_hetermoe import HeterMoEStrategy, MoEConfig, MoELayer, OptimConfig
from lightning_hetermoe.model.lm import MoELanguageModel
from lightning_hetermoe.moe import ExpertContractError, ModuleExperts, Router, RouterOutput, gate_losses
from reference import MoveAt, assert_same_params, data, reference_fit, trainer, whole_checkpoint
from helpers_zebra import make_test_plan

D, E, VOCAB = 16, 4, 256
STEPS, SAVED = 5, 3


class LNExpert(nn.Module):
    """Not the pack's MLP: a LayerNorm, biases, GELU."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, 24)
        self.down = nn.Linear(24, D)

    def forward(self, x):
        return self.down(F.gelu(self.up(self.norm(x))))


class CosineGate(Router):
    """Top-2 by cosine similarity at a learned temperature; its own loss: the mean routing
    entropy per token (a per-token mean, so a micro-batch's share adds up to the batch's)."""

    def __init__(self) -> None:
        super().__init__(D, E, top_k=2)
        self.scale = nn.Parameter(torch.tensor(4.0))

    def forward(self, x):
        logits = self.scale * F.normalize(x.float(), dim=-1) @ F.normalize(self.weight.float(), dim=-1).t()
        probs = logits.softmax(-1)
        top_p, top_i = probs.topk(2, dim=-1)
        entropy = -(probs * probs.clamp_min(1e-9).log()).sum(-1).mean()
        return RouterOutput(top_i, top_p / top_p.sum(-1, keepdim=True), torch.ones_like(top_i, dtype=torch.bool),
                            probs, logits, gate_loss=0.01 * entropy)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n_heads = 2  # what planning reads of the block
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.mix = nn.Linear(D, D)
        self.moe = MoELayer(D, MoEConfig(num_experts=E, top_k=2), experts=LNExpert, router=CosineGate())

    def forward(self, x):
        x = x + self.mix(self.norm1(x))
        y, aux = self.moe(self.norm2(x))
        return x + y, aux


class UserModel(L.LightningModule):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D, VOCAB)
        self.optim_cfg = OptimConfig()

    def losses(self, batch):
        tokens, targets = batch
        x, auxes = self.embed(tokens), []
        for block in self.blocks:
            x, aux = block(x)
            auxes.append(aux)
        logits = self.head(x)
        ce = F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))
        cfg = self.blocks[0].moe.cfg
        balance = torch.stack([a.balance_loss for a in auxes]).sum()
        z = torch.stack([a.z_loss for a in auxes]).sum()
        loss = ce + cfg.aux_loss_coef * balance + cfg.z_loss_coef * z + gate_losses(auxes)
        return {"loss": loss, "ce": ce, "balance_loss": balance, "z_loss": z,
                "dropped": torch.stack([a.dropped for a in auxes]).sum(),
                "tokens_per_expert": torch.stack([a.tokens_per_expert for a in auxes])}

    training_step = MoELanguageModel.training_step
    validation_step = MoELanguageModel.validation_step
    configure_optimizers = MoELanguageModel.configure_optimizers


SWAP = [[[2, 3], [0, 1]], [[0, 2], [1, 3]]]


def fits(rank: int, world: int, ckpt_dir: str) -> dict | None:
    out = {}
    m, move = UserModel(seed=rank), MoveAt(2, SWAP)
    trainer(HeterMoEStrategy(mode="ep"), world, max_steps=STEPS, callbacks=[move]).fit(m, datamodule=data(world))
    out["ep"] = m.state_dict(), move.moved

    m = UserModel(seed=rank)
    save = ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=SAVED, save_top_k=-1)
    trainer(HeterMoEStrategy(mode="zebra", plan=make_test_plan(world, [0], R=2)), world, max_steps=STEPS,
            callbacks=[save], enable_checkpointing=True).fit(m, datamodule=data(world))
    out["zebra"] = m.state_dict(), None

    m = UserModel(seed=100 + rank)  # the checkpoint decides
    trainer(HeterMoEStrategy(mode="ep"), world, max_steps=STEPS).fit(m, datamodule=data(world),
                                                                     ckpt_path=f"{ckpt_dir}/step={SAVED}.ckpt")
    out["resumed"] = m.state_dict(), None
    return out if rank == 0 else None


@pytest.mark.slow
def test_user_experts_and_gate_train_like_one_process_move_and_resume(tmp_path):
    got = run_ranks(2, fits, 2, str(tmp_path))[0]
    model = UserModel(seed=0)
    initial = copy.deepcopy(model.state_dict())
    expected = reference_fit(model, STEPS)
    ckpt = whole_checkpoint(tmp_path / f"step={SAVED}.ckpt")
    # placement-independent: every expert's rows, whatever rank held them
    assert ckpt["state_dict"]["blocks.0.moe.experts.up__weight"].shape == (E, 24, D)
    assert got["ep"][1] > 0, "the move moved nothing"
    for run in ("ep", "zebra", "resumed"):
        assert_same_params(got[run][0], expected, initial)


def test_stacked_experts_compute_what_the_modules_compute():
    torch.manual_seed(0)
    modules = [LNExpert() for _ in range(E)]
    with torch.no_grad():
        for m in modules:  # LayerNorm's affine weights away from 1/0, so they matter
            m.norm.weight.uniform_(0.5, 1.5)
            m.norm.bias.uniform_(-0.5, 0.5)
    stacked = ModuleExperts(copy.deepcopy(modules), E, D)
    x = torch.randn(11, D, requires_grad=True)
    counts = torch.tensor([3, 0, 5, 1])  # expert 1 idle
    gather = torch.randperm(11)[:9]
    out = stacked(x, gather, counts)
    w = torch.randn_like(out)
    (out * w).sum().backward()

    x_ref = x.detach().clone().requires_grad_()
    rows, start = [], 0
    for e, n in enumerate(counts.tolist()):
        rows.append(modules[e](x_ref[gather[start:start + n]]))
        start += n
    ref = torch.cat(rows)
    (ref * w).sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x.grad, x_ref.grad)
    for e, m in enumerate(modules):
        for name, p in m.named_parameters():
            g = getattr(stacked, name.replace(".", "__")).grad[e]
            torch.testing.assert_close(g, p.grad if p.grad is not None else torch.zeros_like(g), msg=f"{e}.{name}")


class WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(D)

    def forward(self, x):
        return self.bn(x)


class Widens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, 2 * D)

    def forward(self, x):
        return self.lin(x)


@pytest.mark.parametrize("experts, match", [
    (WithBuffer, "buffers"),
    ([nn.Linear(D, D), nn.Linear(D, D, bias=False), nn.Linear(D, D), nn.Linear(D, D)], "same parameter names"),
    ([nn.Linear(D, D)] * 3, "list of 3 modules"),
    (lambda: nn.GELU(), "no parameters"),
    ("mlp", "class or factory"),
])
def test_experts_that_cannot_be_stacked_are_refused(experts, match):
    with pytest.raises(ExpertContractError, match=match):
        MoELayer(D, MoEConfig(num_experts=E, top_k=2), experts=experts)


def test_an_expert_of_the_wrong_width_is_named():
    layer = MoELayer(D, MoEConfig(num_experts=E, top_k=2), experts=Widens)
    with pytest.raises(ExpertContractError, match=r"maps \[n, d_model=16\] to \[n, d_model\]"):
        layer(torch.randn(5, D))
