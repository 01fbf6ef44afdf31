"""Placement-independent checkpoints: saved while experts are sharded over 2 ranks,
resumed on 4 ranks (another placement), ending where uninterrupted training ends."""

import copy

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler

from lightning_hetermoe import (
    ByteCorpusDataModule,
    DataConfig,
    HeterMoEStrategy,
    ModelConfig,
    MoEConfig,
    MoELanguageModel,
    OptimConfig,
)

GLOBAL_BATCH = 8

STEPS_PER_EPOCH = 3
NUM_EXPERTS = 4
DATA_SEED = 7


def make_model() -> MoELanguageModel:
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=16, n_layers=1, n_heads=2, max_seq_len=16,
                      moe=MoEConfig(num_experts=NUM_EXPERTS, top_k=2, d_ff=12, aux_loss_coef=0.0))
    # Momentum makes the optimizer state matter: a lost or misplaced buffer changes the result.
    return MoELanguageModel(cfg, OptimConfig(name="sgd", lr=0.2, momentum=0.9, warmup_steps=0))


def data(world: int) -> ByteCorpusDataModule:
    dm = ByteCorpusDataModule(DataConfig(seq_len=16, batch_size=GLOBAL_BATCH // world, shuffle=True, seed=DATA_SEED,
                                         train_windows=GLOBAL_BATCH * STEPS_PER_EPOCH, val_windows=8))
    dm.setup()
    return dm


def reference(model: MoELanguageModel, epochs: int) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    train_set = data(1).train_set
    # The datamodule's DistributedSampler: one seeded permutation per epoch, shared by all ranks.
    sampler = DistributedSampler(train_set, num_replicas=1, rank=0, shuffle=True, seed=DATA_SEED)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch in DataLoader(train_set, batch_size=GLOBAL_BATCH, sampler=sampler):
            opt.zero_grad()
            model.losses(batch)["loss"].backward()
            opt.step()
    return model.state_dict()


def trainer(devices: int, max_epochs: int, callbacks=()) -> L.Trainer:
    return L.Trainer(strategy=HeterMoEStrategy(start_method="spawn"), accelerator="cpu", devices=devices,
                     max_epochs=max_epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
                     limit_val_batches=0, num_sanity_val_steps=0, callbacks=list(callbacks),
                     enable_checkpointing=bool(callbacks))


def test_checkpoint_saved_on_two_ranks_resumes_on_four(tmp_path):
    model = make_model()
    expected = reference(model, epochs=2)

    ckpt_cb = ModelCheckpoint(dirpath=tmp_path, filename="epoch{epoch}", save_top_k=-1, every_n_epochs=1)
    trainer(2, 1, [ckpt_cb]).fit(model, datamodule=data(2))
    path = next(tmp_path.glob("*.ckpt"))
    ckpt = torch.load(path, weights_only=False)
    w_up = ckpt["state_dict"]["model.blocks.0.moe.experts.w_up"]
    assert w_up.shape[0] == NUM_EXPERTS, "checkpoint must hold every expert, not rank 0's shard"
    names = list(ckpt["state_dict"].keys())
    momentum = ckpt["optimizer_states"][0]["state"][names.index("model.blocks.0.moe.experts.w_up")]
    assert momentum["momentum_buffer"].shape == w_up.shape

    resumed = make_model()
    trainer(4, 2).fit(resumed, datamodule=data(4), ckpt_path=str(path))
    actual = resumed.state_dict()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-5)
