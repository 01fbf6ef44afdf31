"""``trainer.predict`` and ``trainer.test`` in every mode, on real gloo processes, behave as
under DDP: each rank gets the outputs of the rows it loaded, in its own order, so
Lightning's prediction writers (which write by the indices of the rank's own sampler) and
``return_predictions=True`` work; the test loss is the one a single process computes.

Zebra and DistEP compute every row on the attention ranks; these tests check the rows come
back to the rank that loaded them, through an uneven last batch (ranks loading different
numbers of rows in it, as Lightning's unrepeated predict sampler deals them)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.data import DataLoader

from harness import run_ranks
from helpers_predict import BATCH, PREDICT_ROWS, TEST_ROWS, Predictor, StepOutputs, Written, predictor, rows, to_cpu
from helpers_traffic import DEVICE_TRAFFIC, HOST_TRAFFIC
from helpers_zebra import make_test_plan
from lightning_hetermoe import HeterMoEStrategy, comm
from reference import trainer


class ScalarPredictor(Predictor):
    def predict_step(self, batch, batch_idx):
        return self(batch[0]).mean()  # one number for the whole batch: no rows to give back

    def test_step(self, batch, batch_idx):
        loss = self.losses(batch)["ce"]
        self.log("test_loss", loss, sync_dist=True)
        return loss  # a test step may return a scalar: only on_test_batch_end sees it


def strategy(case: dict) -> HeterMoEStrategy:
    return HeterMoEStrategy(mode=case["mode"], plan=case.get("plan"))


def predict_and_test(rank: int, world: int, cases: list[dict]) -> list[dict]:
    out = []
    for case in cases:
        with comm.record() as calls:
            model = predictor(seed=rank)  # differently seeded: the strategy starts every rank from rank 0
            writer, test_outputs = Written(), StepOutputs()
            t = trainer(strategy(case), world, callbacks=[writer, test_outputs])
            returned = t.predict(model, DataLoader(rows(PREDICT_ROWS[world]), batch_size=BATCH[world]),
                                 return_predictions=True)
            tested = t.test(model, DataLoader(rows(TEST_ROWS[world]), batch_size=BATCH[world]), verbose=False)
        out.append({"written": writer.batches, "returned": [to_cpu(p) for p in returned], "test": tested[0],
                    "test_outputs": test_outputs.matched, "calls": [dataclasses.asdict(c) for c in calls]})
    zebra = dict(mode="zebra", plan=make_test_plan(world, [0], R=2))
    # a scalar from test_step is no error (Lightning only hands it to on_test_batch_end)
    scalar = trainer(strategy(zebra), world).test(predictor(seed=0, cls=ScalarPredictor),
                                                   DataLoader(rows(TEST_ROWS[world]), batch_size=BATCH[world]),
                                                   verbose=False)
    # last: refusals end the stage on every rank
    out.append({"scalar_test": scalar[0], "scalar": refusal(world, zebra, ScalarPredictor, 2 * world),
                # one row more than 2 ranks' full batches: rank 0 loads a batch more than the others
                "batches": refusal(world, zebra, Predictor, world * BATCH[world] + 1)})
    return out


def refusal(world: int, case: dict, cls: type, n: int) -> str:
    try:
        t = trainer(strategy(case), world)
        t.predict(predictor(seed=0, cls=cls), DataLoader(rows(n), batch_size=BATCH[world]))
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return ""


def expected_rows(n: int) -> list[dict]:
    """A single process's forward of each row alone, from rank 0's initial weights."""
    model = predictor(seed=0).eval()
    with torch.no_grad():
        return [{"logits": model(tokens[None])[0], "tokens": tokens} for tokens, _ in rows(n)]


def expected_test_loss(n: int) -> float:
    model = predictor(seed=0).eval()
    with torch.no_grad():
        tokens, targets = next(iter(DataLoader(rows(n), batch_size=n)))
        return float(model.losses((tokens, targets))["ce"])


def check_rank(rank: int, world: int, got: dict, expected: list[dict], mode: str) -> set[int]:
    """This rank wrote and returned the outputs of its own rows, each as one process computes it."""
    where = f"{mode}, rank {rank}"
    assert len(got["returned"]) == len(got["written"]), where
    mine = list(range(rank, PREDICT_ROWS[world], world))  # Lightning's unrepeated predict sampler
    written = [i for indices, _ in got["written"] for i in indices]
    assert written == mine, f"{where}: wrote rows {written}, loaded {mine}"
    for (indices, pred), back in zip(got["written"], got["returned"], strict=True):
        assert isinstance(pred, dict) and pred.keys() == {"logits", "ids"}, \
            f"{where}: the batch of rows {indices} was written as {type(pred).__name__}, predict_step returns a dict"
        tokens, same = pred["ids"]
        assert pred["logits"].shape[0] == len(indices) == tokens.shape[0] == same.shape[0], \
            f"{where}: {len(indices)} rows loaded, {pred['logits'].shape[0]} predicted"
        for k, i in enumerate(indices):
            want = expected[i]
            assert torch.equal(tokens[k], want["tokens"]), f"{where}: row {i} carries another row's tokens"
            assert bool(same[k]) == bool(want["tokens"][0] == want["tokens"][1]), where
            torch.testing.assert_close(pred["logits"][k], want["logits"], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{where}, row {i}: {m}")
        torch.testing.assert_close(back["logits"], pred["logits"], rtol=0, atol=0)
        assert all(torch.equal(a, b) for a, b in zip(back["ids"], pred["ids"], strict=True)), where
    return set(written)


def check(world: int, cases: list[dict]) -> None:
    per_rank = run_ranks(world, predict_and_test, world, cases)
    expected, loss = expected_rows(PREDICT_ROWS[world]), expected_test_loss(TEST_ROWS[world])
    for c, case in enumerate(cases):
        mode = case["mode"]
        written = [check_rank(r, world, per_rank[r][c], expected, mode) for r in range(world)]
        assert sorted(i for w in written for i in w) == list(range(PREDICT_ROWS[world])), \
            f"{mode}: every row once across ranks, wrote {written}"
        for r in range(world):  # every rank answers the test loss, as under DDP
            got = per_rank[r][c]["test"].get("test_loss")
            assert got is not None and abs(got - loss) < 1e-5, f"{mode}, rank {r}: test_loss {got}, one process {loss}"
            outputs = per_rank[r][c]["test_outputs"]
            assert outputs and all(outputs), f"{mode}, rank {r}: test_step outputs matched the loaded rows {outputs}"
        calls = [[comm.Call(**d) for d in per_rank[r][c]["calls"]] for r in range(world)]
        assert comm.check_sequences(calls) == [], mode
        # each on the group for its kind of traffic (names test_collectives knows; it runs no datacentric)
        for call in (call for per in calls for call in per if mode != "datacentric"):
            assert call.what in (HOST_TRAFFIC if call.traffic == comm.HOST else DEVICE_TRAFFIC), (mode, call)
    for r in range(world):
        got = per_rank[r][-1]["scalar_test"].get("test_loss")
        assert got is not None and abs(got - loss) < 1e-5, f"rank {r}: test_loss {got} (scalar test_step outputs)"
        refused = per_rank[r][-1]
        assert "predict_step" in refused["scalar"] and "shape ()" in refused["scalar"] \
            and "first dimension" in refused["scalar"], f"rank {r}: {refused['scalar']!r}"
        assert "different numbers of batches" in refused["batches"], f"rank {r}: {refused['batches']!r}"


@pytest.mark.slow
def test_two_ranks_every_mode_gives_each_rank_its_own_rows():
    check(2, [dict(mode="zebra", plan=make_test_plan(2, [0], R=2)),
              dict(mode="distep", plan=make_test_plan(2, [0], R=2)),
              dict(mode="ep"), dict(mode="datacentric")])


@pytest.mark.slow
def test_three_ranks_two_attention_ranks_give_rows_back_across_shares():
    # 2 attention ranks + 1 expert rank: each attention rank's share holds rows of all three
    check(3, [dict(mode="zebra", plan=make_test_plan(3, [0, 1], R=2)),
              dict(mode="distep", plan=make_test_plan(3, [0], R=2))])


@pytest.mark.parametrize("counts, spans", [
    ([4, 4], {0: (0, 8)}),  # one attention rank computes everything
    ([4, 3, 3], {0: (0, 6), 1: (6, 4)}),  # a short last batch, two attention ranks
    ([2, 2, 1, 1], {2: (0, 1), 0: (1, 5)}),  # attention ranks out of rank order, one computing a single row
    ([3, 2], {1: (0, 5), 0: (5, 0)}),  # an attention rank with an empty share
])
def test_routes_give_every_row_back_to_the_rank_that_loaded_it(counts, spans):
    """The all-to-all the routes describe, played out on labels: every rank ends with its own
    rows, in its order."""
    from lightning_hetermoe.strategy.backends.zebra.outputs import routes
    from lightning_hetermoe.strategy.batch import global_order

    order, world = global_order(counts), len(counts)
    assert sorted(order) == sorted((r, i) for r in range(world) for i in range(counts[r]))
    plans = [routes(counts, spans, r) for r in range(world)]
    chunks = {}  # (sender, receiver) -> rows
    for p, route in enumerate(plans):
        s, c = spans.get(p, (0, 0))
        sent = [order[s:s + c][k] for k in route.send]
        for q in range(world):
            chunks[(p, q)], sent = sent[:route.to_each[q]], sent[route.to_each[q]:]
    for q, route in enumerate(plans):
        arrived = [row for p in range(world) for row in chunks[(p, q)]]
        assert [len(chunks[(p, q)]) for p in range(world)] == route.from_each
        assert [arrived[t] for t in route.own] == [(q, i) for i in range(counts[q])], q
