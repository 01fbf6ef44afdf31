"""What the prediction and test runs share: a model whose steps return per-row outputs, the
data sets (an uneven last batch), and callbacks that record what each rank got back."""

from __future__ import annotations

import torch
from lightning.pytorch.callbacks import BasePredictionWriter, Callback
from torch.utils.data import Subset

from lightning_hetermoe import MoELanguageModel
from lightning_hetermoe.strategy.batch import map_tensors
from reference import data, make_model

# rows per rank's batch (the test plans' global batch over the ranks) and data set sizes:
# the predict set leaves an uneven last batch that differs between ranks (13 on 2 ranks:
# 4+3 and 4+2; 19 on 3: 4+3, 4+2, 4+2); the test set splits evenly over the ranks
# (Lightning's test sampler pads, a single process would not) with a short last batch (4+2)
BATCH = {2: 4, 3: 4}
PREDICT_ROWS = {2: 13, 3: 19}
TEST_ROWS = {2: 12, 3: 18}


class Predictor(MoELanguageModel):
    """Per-row outputs of several dtypes in a nested structure; the test loss logged as the
    model's validation loss is."""

    def predict_step(self, batch, batch_idx):
        tokens, _ = batch
        return {"logits": self(tokens), "ids": (tokens, tokens[:, 0] == tokens[:, 1])}

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.losses(batch)["ce"], sync_dist=True)
        return {"tokens": batch[0]}  # per row: comes back to the rank that loaded it


class StepOutputs(Callback):
    """Whether each test batch's step output holds the rows of the batch this rank loaded."""

    def __init__(self) -> None:
        self.matched: list[bool] = []

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.matched.append(isinstance(outputs, dict) and torch.equal(outputs["tokens"].cpu(), batch[0].cpu()))


def predictor(seed: int, cls: type = Predictor) -> Predictor:
    # make_model's build, as the subclass that adds the steps (it adds no state)
    model = make_model(4, seed=seed)
    model.__class__ = cls
    return model


class Written(BasePredictionWriter):
    """What Lightning hands a prediction writer on this rank: its sampler's indices and the
    predictions of each batch."""

    def __init__(self) -> None:
        super().__init__(write_interval="batch")
        self.batches: list[tuple[list[int], dict]] = []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        self.batches.append((list(batch_indices), to_cpu(prediction)))


def to_cpu(prediction):
    return map_tensors(prediction, lambda t: t.cpu())  # whatever came: the checks say what is wrong with it


def rows(n: int):
    return Subset(data(1, 16).val_set, range(n))  # 32 windows
