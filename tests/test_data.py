"""One global sample order per epoch whatever the world size, resumable mid-epoch."""

import torch

from lightning_hetermoe import ByteCorpusDataModule, DataConfig
from lightning_hetermoe.model.sampling import GlobalOrderSampler, ResumableLoader

N, G = 40, 8  # 40 samples, global batch 8


def global_batches(world: int, epochs: int = 3, start: int = 0) -> list[list[int]]:
    """Each step's global batch (sorted sample ids) when ``world`` ranks load ``G / world`` each."""
    data = list(range(N))
    out = []
    for epoch in range(epochs):
        loaders = []
        for r in range(world):
            s = GlobalOrderSampler(data, num_replicas=world, rank=r, shuffle=True, seed=3)
            s.set_epoch(epoch)
            s.start = start if epoch == 0 else 0
            loaders.append(ResumableLoader(data, batch_size=G // world, sampler=s, drop_last=True))
        for parts in zip(*loaders, strict=True):
            out.append(sorted(int(i) for p in parts for i in p))
    return out


def test_global_batches_do_not_depend_on_world_size_in_any_epoch():
    one = global_batches(1)
    assert len(one) == 3 * N // G
    assert one == global_batches(2) == global_batches(4)
    assert one[:5] != one[5:10], "epochs must be shuffled differently"


def test_a_mid_epoch_state_resumes_on_another_world_size():
    consumed = {"n": 2}
    s2 = GlobalOrderSampler(list(range(N)), num_replicas=2, rank=0, shuffle=True, seed=3)
    loader = ResumableLoader(list(range(N)), batch_size=G // 2, sampler=s2, drop_last=True,
                             consumed_batches=lambda: consumed["n"])
    state = loader.state_dict()
    assert state == {"epoch": 0, "position": 2 * G}
    resumed = global_batches(4, epochs=1, start=state["position"])
    assert resumed == global_batches(1, epochs=1)[2:]
    assert len(loader) == N // G, "len stays the whole epoch: Lightning counts resumed batches itself"


def test_datamodule_uses_the_global_order_on_one_process():
    dm = ByteCorpusDataModule(DataConfig(seq_len=16, batch_size=4, train_windows=32, seed=5))
    dm.setup()
    loader = dm.train_dataloader()
    assert isinstance(loader.sampler, GlobalOrderSampler) and loader.sampler.num_replicas == 1
    first = next(iter(loader))[0]
    loader.sampler.set_epoch(1)
    assert not torch.equal(first, next(iter(loader))[0])
