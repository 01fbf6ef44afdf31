"""Ragged batches (issue #29): a collate that cuts each batch to its own length gives ranks
batches of different sequence lengths. Every mode trains them as one process trains on the
same unpadded rows (the loss a mean over every real token of the global batch, balance
and z-loss over real tokens only), and a batch the strategy cannot pad is refused on every
rank, before any device collective, with a message that names the ranks and their shapes."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, default_collate

from harness import run_ranks
from lightning_hetermoe import (ByteCorpusDataModule, HeterMoEStrategy, MoEConfig, MoELanguageModel, MoELayer,
                                OptimConfig, comm)
from lightning_hetermoe.model.sampling import ResumableLoader
from reference import SEQ, assert_same_params, global_balance, recording_balance, data, global_batches, make_model, mixed_cluster, trainer
from helpers_zebra import make_test_plan

WORLD, GLOBAL, WINDOWS, STEPS = 2, 8, 64, 3


def ragged_length(tokens: torch.Tensor) -> int:
    """How many tokens a rank's batch keeps this step (8..16), read from its first row: it
    differs between ranks and between steps, and the reference finds it from the same rows."""
    return SEQ // 2 + int(tokens[0].sum()) % (SEQ // 2 + 1)


def truncate(samples: list) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, targets = default_collate(samples)
    n = ragged_length(tokens)
    return tokens[:, :n], targets[:, :n]


class RaggedData(ByteCorpusDataModule):
    """The tests' byte corpus, each rank's batch cut to its own length (labels alike)."""

    def train_dataloader(self) -> ResumableLoader:
        return self._ragged(super().train_dataloader(), self._consumed_train_batches)

    def val_dataloader(self) -> ResumableLoader:
        return self._ragged(super().val_dataloader())

    @staticmethod
    def _ragged(loader: ResumableLoader, consumed=None) -> ResumableLoader:
        return ResumableLoader(loader.dataset, batch_size=loader.batch_size, sampler=loader.sampler, drop_last=True,
                               collate_fn=truncate, consumed_batches=consumed)


def ragged_data(world: int) -> RaggedData:
    dm = RaggedData(data(world, GLOBAL, windows=WINDOWS).cfg)
    dm.setup()
    return dm


# -- the reference: one process, every rank's rows as they came, nothing padded --------------
def rank_rows(batch, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``r``'s batch of a step: global rows ``r, r + W, ...`` (the global order), cut as
    its collate cuts them."""
    out = []
    for r in range(world):
        tokens, targets = (t[r::world] for t in batch)
        n = ragged_length(tokens)
        out.append((tokens[:, :n], targets[:, :n]))
    return out


def unpadded_loss(model, pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The global batch's loss, written out term by term: cross-entropy and z-loss as means over
    every token of every piece, the balance loss with its expert fractions over all of them
    and the mean router probabilities over all of them."""
    with recording_balance(model) as recorders:
        total = sum(tokens.numel() for tokens, _ in pieces)
        loss = sum(model.losses(piece)["loss"] * (piece[0].numel() / total) for piece in pieces)
        return loss + global_balance(model, recorders, total)


def reference(model, steps: int, world: int) -> tuple[MoELanguageModel, list[float], list[list[int]]]:
    """The model after ``steps`` AdamW steps, each step's loss, and each step's lengths per rank."""
    model = copy.deepcopy(model)
    conf = model.configure_optimizers()
    opt = conf["optimizer"] if isinstance(conf, dict) else conf
    sched = conf["lr_scheduler"]["scheduler"] if isinstance(conf, dict) else None
    batches = global_batches(GLOBAL, WINDOWS)
    losses, lengths = [], []
    for _ in range(steps):
        pieces = rank_rows(next(batches), world)
        opt.zero_grad()
        loss = unpadded_loss(model, pieces)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(float(loss.detach()))
        lengths.append([tokens.shape[1] for tokens, _ in pieces])
    return model, losses, lengths


def reference_val_loss(model, world: int) -> float:
    """The validation batches' cross-entropy, each a mean over every real token of its global
    batch (one process), averaged over the batches (their sizes are equal)."""
    val = data(1, GLOBAL, windows=WINDOWS).val_set
    losses = []
    with torch.no_grad():
        model.eval()
        for batch in DataLoader(val, batch_size=GLOBAL, drop_last=True):
            pieces = rank_rows(batch, world)
            total = sum(tokens.numel() for tokens, _ in pieces)
            losses.append(sum(float(model.losses(p)["ce"]) * p[0].numel() / total for p in pieces))
        model.train()
    return sum(losses) / len(losses)


# -- the runs ---------------------------------------------------------------------------------
class StepLosses(L.Callback):
    """Each training step's loss, with the weight this rank's backend gives it (``loss_weight``:
    ``world`` times the share of the global batch's tokens the rank's mean stands for; ``None``
    where the step's loss is already the global one)."""

    def __init__(self) -> None:
        self.values: list[tuple[float, float | None]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.values.append((float(outputs["loss"]), getattr(trainer.strategy.backend, "loss_weight", None)))


def fit_ragged(rank: int, world: int, cases: list[dict]) -> list[dict]:
    out = []
    for case in cases:
        model = make_model(4, seed=rank, optim=OptimConfig(), **case.get("model", {}))
        strategy = HeterMoEStrategy(**case["strategy"])
        losses = StepLosses()
        dm = ragged_data(world)
        t = trainer(strategy, world, max_steps=STEPS, callbacks=[losses],
                    limit_val_batches=1.0 if case.get("validate") else 0)
        with comm.record() as calls:
            t.fit(model, datamodule=dm)
        out.append({"state": {k: v.clone() for k, v in model.state_dict().items()}, "losses": losses.values,
                    "calls": calls})
        if case.get("validate"):
            out[-1]["val"] = t.validate(model, datamodule=dm, verbose=False)[0].get("val_loss")  # attention ranks
    return out


def global_losses(per_rank: list[dict], world: int) -> list[float]:
    """The step's loss over the global batch: the ranks' weighted mean (DDP's average), or the
    loss every rank already returns."""
    steps = zip(*(r["losses"] for r in per_rank), strict=True)
    out = []
    for step in steps:
        if step[0][1] is None:
            out.append(step[0][0])
        else:
            out.append(sum(loss * weight for loss, weight in step) / world)
    return out


CASES = [
    dict(name="ep", strategy=dict(mode="ep")),
    dict(name="ep_balanced", strategy=dict(mode="ep", batch_split="speed", cluster=mixed_cluster(WORLD))),
    # micro-batches of 3+3+2 rows, each holding rows of both ranks padded to the longer: their
    # real tokens are not in proportion to their rows; validation pads too
    dict(name="zebra", strategy=dict(mode="zebra", plan=make_test_plan(WORLD, [0], R=3)), validate=True),
    # checkpointed blocks recompute inside the backward, outside the micro-batch's fiber
    dict(name="zebra_checkpointed", strategy=dict(mode="zebra", plan=make_test_plan(WORLD, [0], R=3)),
         model=dict(activation_checkpointing=True)),
    dict(name="distep", strategy=dict(mode="distep", plan=make_test_plan(WORLD, [0], R=2))),
    dict(name="datacentric", strategy=dict(mode="datacentric", cluster=mixed_cluster(WORLD))),
]


@pytest.mark.slow
def test_every_mode_trains_ragged_batches_as_one_process_on_the_unpadded_rows():
    per_rank = run_ranks(WORLD, fit_ragged, WORLD, CASES)
    model = make_model(4, seed=0, optim=OptimConfig())
    initial = copy.deepcopy(model.state_dict())
    trained, want_losses, lengths = reference(model, STEPS, WORLD)
    expected = trained.state_dict()
    # not vacuous: the ranks' lengths differ within steps, and a rank's differ between steps
    assert any(len(set(step)) > 1 for step in lengths), lengths
    assert len({tuple(step) for step in lengths}) > 1, lengths
    for c, case in enumerate(CASES):
        runs = [per_rank[r][c] for r in range(WORLD)]
        # NCCL's rule holds with padding: every member issues the same collectives, sizes matching
        assert comm.check_sequences([run["calls"] for run in runs]) == [], case["name"]
        got = global_losses(runs, WORLD)
        assert got == pytest.approx(want_losses, abs=1e-5), (case["name"], got, want_losses, lengths)
        try:
            assert_same_params(runs[0]["state"], expected, initial)
        except AssertionError as err:
            raise AssertionError(f"{case['name']}: {err}") from None
        if case.get("validate"):
            want = reference_val_loss(trained, WORLD)
            assert abs(runs[0]["val"] - want) < 1e-4, (case["name"], runs[0]["val"], want)


# -- refusals -------------------------------------------------------------------------------
def _on(rank: int, short: int, full: int) -> int:
    """Rank 1's batch is the short one."""
    return short if rank == 1 else full


REFUSED = {
    # one tensor: inputs and labels alike (the model shifts it), so its padding would be trained on
    "a single tensor": lambda r: torch.zeros(4, _on(r, 26, 30), dtype=torch.long),
    "a dict without labels": lambda r: {"input_ids": torch.zeros(4, _on(r, 26, 30), dtype=torch.long)},
    "a third unnamed tensor": lambda r: tuple(torch.zeros(4, _on(r, 26, 30), dtype=torch.long) for _ in range(3)),
    "a feature dimension differs": lambda r: (torch.zeros(4, _on(r, 26, 30), _on(r, 3, 2)),
                                              torch.zeros(4, _on(r, 26, 30), dtype=torch.long)),
    "the batch sizes differ": lambda r: (torch.zeros(_on(r, 3, 4), 30, dtype=torch.long),
                                         torch.zeros(_on(r, 3, 4), 30, dtype=torch.long)),
}


def _gather_or_refuse(rank: int) -> dict:
    import torch.distributed as dist

    from lightning_hetermoe.configs import ConfigError
    from lightning_hetermoe.strategy.batch import gather_global_batch

    dist.init_process_group("gloo")
    comm.configure(torch.device("cpu"))
    out: dict = {"refused": {}, "calls": {}}
    try:
        for name, make in REFUSED.items():
            with comm.record() as calls:
                try:
                    gather_global_batch(make(rank))
                except ConfigError as err:
                    out["refused"][name] = str(err)
            out["calls"][name] = [(c.traffic, c.what) for c in calls]
        # what can be padded: a Hugging Face style dict and the pack's (tokens, targets)
        n = _on(rank, 26, 30)
        hf = {"input_ids": torch.full((2, n), 5), "labels": torch.full((2, n), 7),
              "attention_mask": torch.ones(2, n, dtype=torch.long)}
        with comm.record() as calls:
            got = gather_global_batch(hf)
        out["hf"] = (got.batch, got.lengths, got.mask(0, 4, torch.device("cpu")))
        out["calls"]["hf"] = [(c.traffic, c.what) for c in calls]
        got = gather_global_batch((torch.full((2, n), 5), torch.full((2, n), 7)))
        out["pair"] = got.batch
        # evaluation: a short last batch (rank 1 holds a row fewer) that is ragged too; the
        # same rows in training are refused
        rows = _on(rank, 2, 3)
        uneven = (torch.arange(rows)[:, None] * 10 + rank + torch.zeros(rows, n, dtype=torch.long),
                  torch.full((rows, n), 7))
        with comm.record() as calls:
            got = gather_global_batch(uneven, uneven_rows=True)
        out["uneven"] = (got.batch, got.lengths, got.counts, got.rank_lengths, got.mask(0, 5, torch.device("cpu")))
        out["calls"]["uneven"] = [(c.traffic, c.what) for c in calls]
        try:
            gather_global_batch(uneven)
        except ConfigError as err:
            out["refused"]["uneven rows in training"] = str(err)
    finally:
        comm.forget()
    return out


@pytest.mark.slow
def test_batches_that_cannot_be_padded_are_refused_before_any_device_collective():
    per_rank = run_ranks(2, _gather_or_refuse)
    for name in REFUSED:
        messages = [per_rank[r]["refused"].get(name) for r in range(2)]
        assert messages[0] and messages[0] == messages[1], (name, messages)  # every rank refuses alike
        # only the shapes crossed the wire, on the host group
        for r in range(2):
            assert per_rank[r]["calls"][name] == [(comm.HOST, "batch.shapes")], (name, per_rank[r]["calls"][name])
    msg = {name: per_rank[0]["refused"][name] for name in REFUSED}
    # each message names the ranks, their shapes, and what to change
    assert "rank 0: [4, 30]" in msg["a single tensor"] and "rank 1: [4, 26]" in msg["a single tensor"], msg
    assert "labels" in msg["a single tensor"] and "mode='ep'" in msg["a single tensor"], msg
    assert "'labels'" in msg["a dict without labels"], msg
    assert "tuple of 3 unnamed tensors" in msg["a third unnamed tensor"], msg
    assert "dimension 2" in msg["a feature dimension differs"] and "[4, 30, 2]" in msg["a feature dimension differs"]
    assert "batch size" in msg["the batch sizes differ"] and "rank 1: [3, 30]" in msg["the batch sizes differ"], msg

    # padded: inputs with 0, labels with -100, the mask 0; rank 1's rows (global rows 1 and 3) are the short ones
    batch, lengths, mask = per_rank[0]["hf"]
    assert lengths == [30, 26, 30, 26]
    assert batch["input_ids"].shape == (4, 30)
    assert (batch["labels"][1, 26:] == -100).all() and (batch["labels"][1, :26] == 7).all()
    assert (batch["labels"][0] == 7).all()
    assert (batch["input_ids"][3, 26:] == 0).all() and (batch["attention_mask"][3, 26:] == 0).all()
    assert mask.tolist() == [[i < n for i in range(30)] for n in lengths]
    assert per_rank[0]["calls"]["hf"] == [(comm.HOST, "batch.shapes"), (comm.DEVICE, "batch.gather"),
                                          (comm.DEVICE, "batch.gather"), (comm.DEVICE, "batch.gather")]
    tokens, targets = per_rank[1]["pair"]
    assert (targets[1, 26:] == -100).all() and (tokens[1, 26:] == 0).all() and (tokens[1, :26] == 5).all()

    # uneven rows and lengths at once: padded along the sequence, then gathered by counts
    # (rank 0's rows 0, 1, 2 and rank 1's rows 0, 1 in the global order: 0.0, 1.0, 0.1, 1.1, 0.2)
    for r in range(2):
        (tokens, targets), lengths, counts, rank_lengths, mask = per_rank[r]["uneven"]
        assert counts == [3, 2] and rank_lengths == (30, 26) and lengths == [30, 26, 30, 26, 30], r
        assert tokens[:, 0].tolist() == [0, 1, 10, 11, 20] and tokens.shape == (5, 30), tokens[:, 0]
        assert (targets[1::2, 26:] == -100).all() and (targets[0::2] == 7).all() and (targets[1::2, :26] == 7).all()
        assert (tokens[1::2, 26:] == 0).all()
        assert mask.tolist() == [[i < n for i in range(30)] for n in lengths]
        # the shapes carry the row counts: one host gather, no other
        assert per_rank[r]["calls"]["uneven"] == [(comm.HOST, "batch.shapes")] + [(comm.DEVICE, "batch.gather")] * 2
        refused = per_rank[r]["refused"]["uneven rows in training"]
        assert "batch size" in refused and "rank 1: [2, 26], [2, 26]" in refused, refused


def test_plan_padding_lets_row_counts_differ_only_where_asked():
    from lightning_hetermoe.configs import ConfigError
    from lightning_hetermoe.strategy.batch import plan_padding

    long = 5  # torch.int64's code among the shapes' dtypes
    batch = (torch.zeros(3, 30, dtype=torch.long), torch.zeros(3, 30, dtype=torch.long))
    rows_only = [[((3, 30), long), ((3, 30), long)], [((2, 30), long), ((2, 30), long)]]
    assert plan_padding(batch, rows_only, uneven_rows=True) is None  # gathered by counts, nothing to pad
    with pytest.raises(ConfigError, match="batch sizes"):
        plan_padding(batch, rows_only)  # training: every rank's rows in global order
    both = [[((3, 30), long), ((3, 30), long)], [((2, 26), long), ((2, 26), long)]]
    padding = plan_padding(batch, both, uneven_rows=True)
    assert padding is not None and padding.values == (0, -100) and padding.lengths == (30, 26)
    split = [[((3, 30), long), ((2, 30), long)], [((2, 26), long), ((2, 26), long)]]
    with pytest.raises(ConfigError, match="rank 0's batch disagree on the batch size"):
        plan_padding(batch, split, uneven_rows=True)


# -- evaluation: ragged batches in predict and test (zebra, distep) ----------------------------
def predict_and_test_ragged(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """``trainer.predict`` (an uneven last batch) and ``trainer.test`` with every rank's batches
    cut to their own lengths."""
    import dataclasses

    from helpers_predict import BATCH, PREDICT_ROWS, TEST_ROWS, StepOutputs, Written, predictor, rows, to_cpu

    out = []
    for case in cases:
        model = predictor(seed=rank)
        writer, test_outputs = Written(), StepOutputs()
        t = trainer(HeterMoEStrategy(mode=case["mode"], plan=case["plan"]), world, callbacks=[writer, test_outputs])
        with comm.record() as calls:
            returned = t.predict(model, DataLoader(rows(PREDICT_ROWS[world]), batch_size=BATCH[world],
                                                   collate_fn=truncate), return_predictions=True)
            tested = t.test(model, DataLoader(rows(TEST_ROWS[world]), batch_size=BATCH[world], collate_fn=truncate),
                            verbose=False)
        out.append({"written": writer.batches, "returned": [to_cpu(p) for p in returned], "test": tested[0],
                    "test_outputs": test_outputs.matched, "calls": [dataclasses.asdict(c) for c in calls]})
    return out


def _rank_batches(rows, n: int, world: int, rank: int, batch: int) -> list[tuple[list[int], int]]:
    """Rank ``rank``'s batches of a data set of ``n`` rows dealt ``r, r + W, ...``: their row
    indices and the length the collate cuts them to."""
    mine = list(range(rank, n, world))
    out = []
    for k in range(0, len(mine), batch):
        indices = mine[k:k + batch]
        out.append((indices, ragged_length(torch.stack([rows[i][0] for i in indices]))))
    return out


def check_ragged_evaluation(world: int, cases: list[dict]) -> None:
    from helpers_predict import BATCH, PREDICT_ROWS, TEST_ROWS, predictor, rows

    from helpers_traffic import DEVICE_TRAFFIC, HOST_TRAFFIC

    per_rank = run_ranks(world, predict_and_test_ragged, world, cases)
    model = predictor(seed=0).eval()
    predict_set, test_set = rows(PREDICT_ROWS[world]), rows(TEST_ROWS[world])
    batches = [_rank_batches(predict_set, PREDICT_ROWS[world], world, r, BATCH[world]) for r in range(world)]
    # not vacuous: the last batch's rows differ between ranks, and so do the lengths within a step
    assert len({len(b[-1][0]) for b in batches}) > 1, batches
    assert any(len({b[k][1] for b in batches}) > 1 for k in range(len(batches[0]))), batches
    # the test loss one process computes: each step's cross-entropy over every real token of its
    # global batch, the steps weighed by their rows (Lightning's epoch mean)
    steps = list(zip(*(_rank_batches(test_set, TEST_ROWS[world], world, r, BATCH[world]) for r in range(world)), strict=True))
    assert any(len({length for _, length in step}) > 1 for step in steps), steps
    values, weights = [], []
    with torch.no_grad():
        for step in steps:
            pieces = [tuple(torch.stack([test_set[i][j][:length] for i in indices]) for j in range(2))
                      for indices, length in step]
            total = sum(p[0].numel() for p in pieces)
            values.append(sum(float(model.losses(p)["ce"]) * p[0].numel() / total for p in pieces))
            weights.append(sum(len(indices) for indices, _ in step))
    want_loss = sum(v * w for v, w in zip(values, weights, strict=True)) / sum(weights)
    for c, case in enumerate(cases):
        mode = case["mode"]
        for r in range(world):
            got, where = per_rank[r][c], f"{mode}, rank {r}"
            assert [indices for indices, _ in got["written"]] == [indices for indices, _ in batches[r]], where
            for (indices, pred), back, (_, length) in zip(got["written"], got["returned"], batches[r], strict=True):
                tokens, same = pred["ids"]
                # per-token outputs at the rank's own length, as it alone computes them
                assert pred["logits"].shape[:2] == (len(indices), length), (where, pred["logits"].shape, length)
                assert tokens.shape == (len(indices), length) and same.shape == (len(indices),), where
                for k, i in enumerate(indices):
                    row = predict_set[i][0][:length]
                    assert torch.equal(tokens[k], row), f"{where}: row {i} carries other tokens"
                    with torch.no_grad():
                        want = model(row[None])[0]
                    torch.testing.assert_close(pred["logits"][k], want, rtol=1e-5, atol=1e-5,
                                               msg=lambda m: f"{where}, row {i}: {m}")
                torch.testing.assert_close(back["logits"], pred["logits"], rtol=0, atol=0)
            loss = got["test"].get("test_loss")
            assert loss is not None and abs(loss - want_loss) < 1e-5, f"{where}: test_loss {loss}, one process {want_loss}"
            assert got["test_outputs"] and all(got["test_outputs"]), f"{where}: {got['test_outputs']}"
        calls = [[comm.Call(**d) for d in per_rank[r][c]["calls"]] for r in range(world)]
        assert comm.check_sequences(calls) == [], mode
        for call in (call for per in calls for call in per):
            assert call.what in (HOST_TRAFFIC if call.traffic == comm.HOST else DEVICE_TRAFFIC), (mode, call)
            assert call.what != "batch.counts", (mode, call)  # the shapes carry the row counts


@pytest.mark.slow
def test_zebra_and_distep_predict_and_test_ragged_batches_as_one_process():
    # R=3: micro-batches of 3+3+2 rows whose real tokens are not in proportion to their rows
    check_ragged_evaluation(2, [dict(mode="zebra", plan=make_test_plan(2, [0], R=3)),
                                dict(mode="distep", plan=make_test_plan(2, [0], R=2))])


@pytest.mark.slow
def test_ragged_evaluation_across_two_attention_ranks():
    check_ragged_evaluation(3, [dict(mode="zebra", plan=make_test_plan(3, [0, 1], R=2))])


# -- the MoE layer: padding leaves its losses, counts and capacity alone -----------------------
@pytest.mark.parametrize("capacity_factor", [0.0, 1.0])
def test_padding_tokens_change_nothing_the_moe_layer_reports(capacity_factor):
    torch.manual_seed(0)
    layer = MoELayer(16, MoEConfig(num_experts=4, d_ff=12, top_k=2, capacity_factor=capacity_factor))
    x = torch.randn(2, 9, 16)
    padded = torch.cat([x, torch.randn(2, 5, 16)], 1)  # 5 padding positions per row
    real = torch.arange(14) < 9
    y, aux = layer(x)
    layer.real_tokens = lambda n: real.expand(2, 14).reshape(-1)
    py, paux = layer(padded)
    torch.testing.assert_close(py[:, :9], y)
    for field in ("balance_loss", "z_loss", "tokens_per_expert", "dropped"):
        torch.testing.assert_close(getattr(paux, field), getattr(aux, field), msg=field)
    if capacity_factor:
        assert int(aux.dropped) > 0, "capacity never dropped: the case is vacuous"
