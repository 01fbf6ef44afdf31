"""Plans written by hand and the check every zebra equivalence test runs: fit each case on
real gloo processes and compare with single-process training on the global batch (the
naive reference, cut as the executor cuts it), at the default loss coefficients."""

from __future__ import annotations

import copy
import weakref

import lightning as L

from harness import run_ranks
import lightning_hetermoe.comm as comm
import lightning_hetermoe.strategy.backends.zebra.backend as zebra_backend
from lightning_hetermoe import HeterMoEStrategy, MoELayer, OptimConfig, Plan
from lightning_hetermoe.plan import ZPGroup
from lightning_hetermoe.apportion import split_microbatches
from reference import SEQ, assert_same_params, data, make_model, reference_fit, trainer, validation_loss

STEPS = 5
GLOBAL = {2: 8, 3: 12, 4: 8, 5: 10}  # sequences per step, a multiple of the world size
# An even number of batches per epoch: Lightning steps after an epoch's last batch even when
# gradient accumulation is incomplete, and the reference assumes full accumulation cycles.
WINDOWS = {2: 64, 3: 72, 4: 64, 5: 60}


def make_test_plan(world: int, attention: list[int], R: int, *, num_experts: int = 4, layers: int = 2,
                   groups: list[tuple[list[int], list[int]]] | None = None,
                   placement: list[list[int]] | None = None) -> Plan:
    """One ZP group (attention ranks, then expert ranks) unless ``groups`` says otherwise;
    experts spread evenly over the expert members unless ``placement`` says otherwise."""
    experts = [r for r in range(world) if r not in attention]
    groups = groups or [(attention, experts)]
    zp = [ZPGroup(attention_ranks=a, expert_ranks=e) for a, e in groups]
    M, N = len(zp[0].attention_ranks), len(zp[0].expert_ranks)
    if placement is None:
        per = split_microbatches(num_experts, N)
        row = [M + i for i, n in enumerate(per) for _ in range(n)]
        placement = [row[:] for _ in range(layers)]
    size = M + N
    counts = [[sum(1 for p in placement[l] if p == m) for l in range(layers)] for m in range(size)]
    att_all = [r for a, _ in groups for r in a]
    seqs = [0] * world
    for r, n in zip(att_all, split_microbatches(GLOBAL[world], len(att_all)), strict=True):
        seqs[r] = n
    return Plan(model="test", cluster="test", seq_len=SEQ, devices=["cpu"] * world,
                roles=["attention" if r in att_all else "expert" for r in range(world)], zp_groups=zp,
                num_microbatches=R, seqs_per_rank=seqs, placement=placement, base_counts=counts,
                distep_microbatches=1)


def pieces(plan: Plan, mode: str) -> list[int]:
    """How the executor cuts the global batch: attention shares, then micro-batches."""
    R = plan.num_microbatches if mode == "zebra" else plan.distep_microbatches
    out = []
    for r in plan.attention_ranks:
        out += [n for n in split_microbatches(plan.seqs_per_rank[r], R) if n]
    return out


class Holdings(L.Callback):
    """What each rank holds while training runs (before teardown gathers the model back)."""

    def on_train_end(self, trainer, pl_module):
        experts = {id(p) for m in pl_module.modules() if isinstance(m, MoELayer) for p in m.experts.parameters()}
        dense = [p for p in pl_module.parameters() if id(p) not in experts]
        opt = trainer.optimizers[0]
        self.dense_numel = sum(p.numel() for p in dense)
        # optimizer state of dense parameters (or of the ranges of them this rank owns, where
        # the state is sharded over the attention ranks)
        self.dense_state = sum(1 for p, s in opt.state.items() if id(p) not in experts and s)
        self.metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        last = getattr(trainer.strategy.backend, "last_step", None)
        self.work = [str(t) for t in last.work] if last is not None else []  # the last step's tasks, as run
        placed = trainer.strategy.placement
        self.placement = placed.to_lists() if placed is not None else None  # [layer][holder] -> expert ids


class SyncBuffers:
    """While inside: the bytes of the dense gradient sync's buffers (tensors it all-reduces
    that are not a parameter's gradient) alive at each of its all-reduces, at most."""

    def __init__(self, model) -> None:
        self.model, self.peak, self.calls, self._live = model, 0, 0, []

    def __enter__(self) -> "SyncBuffers":
        self._original = original = comm.all_reduce

        def watched(group, t, *, what, **kwargs):
            if what == "zebra.grads.dense":
                self.calls += 1
                grads = {p.grad.untyped_storage().data_ptr() for p in self.model.parameters() if p.grad is not None}
                self._live = [r for r in self._live if r() is not None] + [weakref.ref(t)]
                held = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes()
                        for x in (r() for r in self._live) if x is not None}
                self.peak = max(self.peak, sum(n for ptr, n in held.items() if ptr not in grads))
            return original(group, t, what=what, **kwargs)

        comm.all_reduce = watched
        return self

    def __exit__(self, *exc) -> None:
        comm.all_reduce = self._original


def fit_cases(rank: int, world: int, cases: list[dict]) -> list | None:
    out = []
    default_bucket = zebra_backend.BUCKET_BYTES
    for case in cases:
        model = make_model(case.get("num_experts", 4), seed=rank, optim=OptimConfig(), **case.get("model", {}),
                           **case.get("moe", {}))
        zebra_backend.BUCKET_BYTES = case.get("bucket_bytes", default_bucket)
        strategy = HeterMoEStrategy(mode=case.get("mode", "zebra"), plan=case.get("plan"))
        held = Holdings()
        t = trainer(strategy, world, max_steps=STEPS, callbacks=[held], **case.get("trainer", {}))
        dm = data(world, GLOBAL[world], windows=WINDOWS[world])
        with SyncBuffers(model) as buffers:
            t.fit(model, datamodule=dm)
        zebra_backend.BUCKET_BYTES = default_bucket
        result = {"state": {k: v.clone() for k, v in model.state_dict().items()}, "dense_numel": held.dense_numel,
                  "dense_state": held.dense_state, "train_metrics": held.metrics, "work": held.work,
                  "placement": held.placement,
                  "sync": {"peak": buffers.peak, "calls": buffers.calls}}
        if case.get("validate"):
            result["val"] = t.validate(model, datamodule=dm, verbose=False)
        out.append(result)
    return out


def stored(model: dict) -> dict:
    """The reference's model keeps its activations: recomputing changes no value, and the
    pieces' balance recorder (reference.pieces_loss) is gone by the time a backward would
    recompute."""
    return {k: v for k, v in model.items() if k != "activation_checkpointing"}


def check(world: int, cases: list[dict]) -> list:
    per_rank = run_ranks(world, fit_cases, world, cases)
    for c, case in enumerate(cases):
        actual = per_rank[0][c]
        model = make_model(case.get("num_experts", 4), seed=0, optim=OptimConfig(), **stored(case.get("model", {})),
                           **case.get("moe", {}))
        initial = copy.deepcopy(model.state_dict())
        plan = case.get("plan")
        mode = case.get("mode", "zebra")
        cut = pieces(plan, mode) if plan is not None else None
        # train_loss is logged without sync_dist: rank 0 shows its own share, as under DDP
        stats: dict = {"ce_rows": plan.seqs_per_rank[plan.attention_ranks[0]] if plan is not None else None}
        tk = case.get("trainer", {})
        expected = reference_fit(model, STEPS, global_batch=GLOBAL[world], windows=WINDOWS[world], pieces=cut,
                                 stats=stats,
                                 accumulate=tk.get("accumulate_grad_batches", 1), clip=tk.get("gradient_clip_val"),
                                 clip_algorithm=tk.get("gradient_clip_algorithm", "norm"),
                                 overfit=tk.get("overfit_batches", 0))
        for key in case.get("exercises", ()):
            assert stats.get(key, 0) > 0, f"the case never exercised {key}: {stats}"
        assert_same_params(actual["state"], expected, initial)
        if plan is not None and mode != "ep":
            for r in plan.expert_ranks:  # expert ranks hold no dense weights, no dense optimizer state
                assert per_rank[r][c]["dense_numel"] == 0 and per_rank[r][c]["dense_state"] == 0, r
            for r in plan.attention_ranks:
                assert per_rank[r][c]["dense_numel"] > 0 and per_rank[r][c]["dense_state"] > 0, r
        if case.get("validate"):
            # self.log in the user's steps, once per step, reduced over the attention ranks
            want = validation_loss(stats["model"], GLOBAL[world])
            assert abs(actual["val"][0]["val_loss"] - want) < 1e-4, (actual["val"], want)
            assert abs(actual["train_metrics"]["train_loss"] - stats["last_ce"]) < 1e-4, stats["last_ce"]
    return per_rank
