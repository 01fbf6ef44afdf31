"""Every batch that fits gets a plan: the planner's largest plannable batch against a brute
force over every layout the plan format can express, on clusters small enough to enumerate.

The brute force is written out here from the memory model's own terms (``MemoryModel``):
every subset of ranks as the attention ranks, every count of identical ZP groups, every R,
sequences apportioned as the plan gives them (in proportion to the ranks' speed), experts
anywhere in a group (they fit iff the members' capacities add up to every expert), the
dense optimizer state sharded over the attention ranks in proportion to their memory.
"""

from __future__ import annotations

import math
import random

import pytest

from lightning_hetermoe.apportion import apportion
from lightning_hetermoe.cluster import ClusterConfig
from lightning_hetermoe.cluster.spec import resolve_cluster
from lightning_hetermoe.configs import ModelConfig, MoEConfig, OptimConfig
from lightning_hetermoe.plan import Plan, largest_batch, make_plan
from lightning_hetermoe.profile import make_timer
from lightning_hetermoe.profile.memory import MemoryModel
from lightning_hetermoe.simulate.schedules import ep_speed

SEQ = 512
MAX_R = 6


def small_model(layers: int, experts: int, d: int) -> ModelConfig:
    return ModelConfig(name="m", vocab_size=1024, d_model=d, n_layers=layers, n_heads=4, max_seq_len=SEQ,
                       moe=MoEConfig(num_experts=experts, top_k=2, d_ff=3 * d))


def small_cluster(big: int, small: int, big_gb: float, small_gb: float) -> ClusterConfig:
    return ClusterConfig(name="tiny_mix", devices=["big"] * big + ["small"] * small, custom_devices={
        "big": {"base": "a40", "memory_gb": big_gb, "reserved_gb": 0.0},
        "small": {"base": "v100", "memory_gb": small_gb, "reserved_gb": 0.0}})


def group_fits(mem: MemoryModel, devs, attention: list[int], experts: list[int], all_attention: list[int],
               group_seqs: int, seqs: list[int], R: int, sharded: bool, seq_len: int = SEQ) -> list[int] | None:
    """Each member's expert capacity (attention members first), ``None`` where an attention
    member cannot hold the rest."""
    m = mem.model
    k, E = m.moe.top_k, m.moe.num_experts
    flight = group_seqs * seq_len * k / E
    mb = math.ceil(group_seqs / R) * seq_len * k / E
    total_gb = sum(devs[r].memory_gb for r in all_attention)
    caps = []
    for r, s in zip(attention, seqs, strict=True):
        share = devs[r].memory_gb / total_gb if sharded and len(all_attention) > 1 else 1.0
        c = mem.expert_capacity(devs[r], tokens_in_flight_per_expert=flight, mb_tokens_per_expert=mb,
                                attention_tokens_in_flight=s * seq_len,
                                attention_mb_tokens=math.ceil(s / R) * seq_len,
                                holds_attention=True, optimizer_share=share)
        if c < 0:
            return None
        caps.append(c)
    caps += [max(mem.expert_capacity(devs[r], tokens_in_flight_per_expert=flight, mb_tokens_per_expert=mb), 0)
             for r in experts]
    return caps


def brute_force_fits(model: ModelConfig, cluster: ClusterConfig, total: int, sharded: bool, *, M: int | None = None,
                     G_pin: int | None = None, R_pin: int | None = None, optimizer: OptimConfig | None = None,
                     weight_averages: int = 0) -> bool:
    devs = resolve_cluster(cluster)
    mem, timer = MemoryModel.for_optimizer(model, optimizer, weight_averages), make_timer(model, SEQ)
    W, need = len(devs), model.n_layers * model.moe.num_experts
    kinds = sorted({d.name for d in devs})
    for mask in range(1, 2**W):
        attn = [r for r in range(W) if mask >> r & 1]
        rest = [r for r in range(W) if not mask >> r & 1]
        if M is not None and len(attn) != M:
            continue
        for G in ([G_pin] if G_pin else range(1, W + 1)):
            by_kind = [(sum(devs[r].name == k for r in attn), sum(devs[r].name == k for r in rest)) for k in kinds]
            if any(a % G or x % G for a, x in by_kind) or total // G < 1:
                continue
            # group 0: a G-th of each kind in each role, listed kind by kind
            g_attn = [next(r for r in attn if devs[r].name == k)
                      for k, (a, _) in zip(kinds, by_kind, strict=True) for _ in range(a // G)]
            g_exp = [next(r for r in rest if devs[r].name == k)
                     for k, (_, x) in zip(kinds, by_kind, strict=True) for _ in range(x // G)]
            seqs = apportion(total // G, [ep_speed(devs[r], timer, model, SEQ) for r in g_attn])
            Rs = range(1, min(MAX_R, max(seqs)) + 1) if R_pin is None else [R_pin] if R_pin <= max(seqs) else []
            for R in Rs:
                caps = group_fits(mem, devs, g_attn, g_exp, attn, total // G, seqs, R, sharded)
                if caps is not None and sum(caps) >= need:
                    return True
    return False


def plan_fits(plan: Plan, model: ModelConfig, cluster: ClusterConfig, sharded: bool) -> bool:
    """Every member of every group holds at most the experts its capacity allows."""
    devs = resolve_cluster(cluster)
    mem = MemoryModel(model)
    counts = plan.expert_counts()
    for grp in plan.zp_groups:
        seqs = [plan.seqs_per_rank[r] for r in grp.attention_ranks]
        caps = group_fits(mem, devs, grp.attention_ranks, grp.expert_ranks, plan.attention_ranks, sum(seqs), seqs,
                          plan.num_microbatches, sharded, plan.seq_len)
        if caps is None or any(sum(c) > cap for c, cap in zip(counts, caps, strict=True)):
            return False
    return True


def random_case(seed: int):
    rng = random.Random(seed)
    model = small_model(rng.choice([1, 2, 3]), rng.choice([2, 4, 6]), rng.choice([128, 256]))
    mem = MemoryModel(model)
    state = (mem.attention_stack_params() + model.n_layers * model.moe.num_experts * mem.expert_params()) * 16 / 1e9
    big, small = rng.choice([(1, 2), (2, 2), (2, 1), (3, 2), (1, 4), (2, 3)])
    # devices of a few times the state between them: memory binds at a few dozen sequences
    per = state * rng.uniform(1.5, 4.0) / (big + small)
    cluster = small_cluster(big, small, round(per * rng.uniform(1.0, 1.6), 4), round(per * rng.uniform(0.5, 1.0), 4))
    return model, cluster, rng.random() < 0.5


def brute_largest(model, cluster, sharded, **pins) -> int:
    """Every batch up to one whose checkpoints alone (every token is in flight) exceed the
    cluster's memory."""
    usable = sum(d.usable_bytes for d in resolve_cluster(cluster))
    cap = int(usable // (SEQ * model.n_layers * model.d_model * 2 * 2)) + 1
    fits = [t for t in range(1, cap + 1) if brute_force_fits(model, cluster, t, sharded, **pins)]
    return fits[-1] if fits else 0


@pytest.mark.parametrize("seed", range(8))
def test_largest_batch_equals_the_brute_force(seed):
    model, cluster, sharded = random_case(seed)
    want = brute_largest(model, cluster, sharded)
    got = largest_batch(cluster, model, seq_len=SEQ, max_microbatches=MAX_R, shard_optimizer_state=sharded)
    assert got == want
    if want == 0:
        with pytest.raises(ValueError, match="not one sequence plans"):
            make_plan(cluster, model, seq_len=SEQ, global_batch_tokens=SEQ, max_microbatches=MAX_R,
                      shard_optimizer_state=sharded)
        return
    plan = make_plan(cluster, model, seq_len=SEQ, global_batch_tokens=want * SEQ, max_microbatches=MAX_R,
                     shard_optimizer_state=sharded, max_waves=1)
    assert plan_fits(plan, model, cluster, sharded)
    with pytest.raises(ValueError, match=rf"the largest batch that plans is {want} sequence"):
        make_plan(cluster, model, seq_len=SEQ, global_batch_tokens=(want + 1) * SEQ, max_microbatches=MAX_R,
                  shard_optimizer_state=sharded, max_waves=1)


@pytest.mark.parametrize("seed", range(8, 12))
def test_every_batch_the_brute_force_fits_plans_and_fits(seed):
    """Below the largest batch too: the planner plans exactly the batches the brute force
    fits, and each plan it returns fits."""
    model, cluster, sharded = random_case(seed)
    want = brute_largest(model, cluster, sharded)
    for total in sorted({1, want // 2, want - 1, want, want + 1, want + 3} - {-1, 0}):
        kw = dict(seq_len=SEQ, global_batch_tokens=total * SEQ, max_microbatches=MAX_R, shard_optimizer_state=sharded,
                  max_waves=1)
        if brute_force_fits(model, cluster, total, sharded):
            assert plan_fits(make_plan(cluster, model, **kw), model, cluster, sharded)
        else:
            with pytest.raises(ValueError, match="binds|not one sequence plans"):
                make_plan(cluster, model, **kw)


@pytest.mark.parametrize("seed,pins", [(11, dict(M=1)), (11, dict(M=2, R_pin=2)), (11, dict(G_pin=1, R_pin=1)),
                                       (11, dict(M=3, G_pin=1)), (2, dict(R_pin=3)), (12, dict(G_pin=2))])
def test_pinned_choices_bound_the_largest_batch_as_in_the_brute_force(seed, pins):
    """Pins make the batches that plan a union of ranges with gaps (R pinned at 3: 3 and 5
    sequences may plan where 4 do not), and the largest is still found."""
    model, cluster, sharded = random_case(seed)
    want = brute_largest(model, cluster, sharded, **pins)
    kw = dict(num_attention_ranks=pins.get("M"), num_zp_groups=pins.get("G_pin"),
              num_microbatches=pins.get("R_pin"))
    got = largest_batch(cluster, model, seq_len=SEQ, max_microbatches=MAX_R, shard_optimizer_state=sharded, **kw)
    assert got == want
    if want:
        plan = make_plan(cluster, model, seq_len=SEQ, global_batch_tokens=want * SEQ, max_microbatches=MAX_R,
                         shard_optimizer_state=sharded, max_waves=1, **kw)
        assert plan_fits(plan, model, cluster, sharded)
        assert kw["num_attention_ranks"] in (None, len(plan.attention_ranks))
        assert kw["num_microbatches"] in (None, plan.num_microbatches)


def test_sharded_optimizer_state_fits_more():
    """ZeRO over the attention ranks frees their memory: never fewer sequences, and here more
    (here nothing plans with the dense optimizer state whole on every attention rank)."""
    model = small_model(2, 4, 256)
    mem = MemoryModel(model)
    state = (mem.attention_stack_params() + 8 * mem.expert_params()) * 16 / 1e9
    cluster = small_cluster(3, 3, round(state * 0.35, 4), round(state * 0.3, 4))
    whole = largest_batch(cluster, model, seq_len=SEQ, max_microbatches=MAX_R, shard_optimizer_state=False)
    sharded = largest_batch(cluster, model, seq_len=SEQ, max_microbatches=MAX_R, shard_optimizer_state=True)
    assert whole == brute_largest(model, cluster, False)
    assert sharded == brute_largest(model, cluster, True)
    assert sharded > whole


@pytest.mark.slow  # computes for seconds (the quick loop stays about a minute)
def test_the_optimizer_a_run_trains_with_is_what_the_plan_prices():
    """SGD keeps 4 bytes of state a parameter with momentum and none without, where AdamW
    keeps 8 (a fused step, ``auto`` under the strategy, allocates nothing beside it): the
    largest batch grows as the state shrinks, each equal to the brute force priced the same
    way, and the default (no optimizer named: a user's own) is unfused AdamW's."""
    model = small_model(2, 4, 256)
    mem = MemoryModel(model)
    state = (mem.attention_stack_params() + 8 * mem.expert_params()) * 16 / 1e9
    cluster = small_cluster(3, 3, round(state * 0.4, 4), round(state * 0.35, 4))
    got = {}
    for name, optimizer in [("default", None), ("unfused", OptimConfig(fused=False)), ("adamw", OptimConfig()),
                            ("momentum", OptimConfig(name="sgd", momentum=0.9)), ("sgd", OptimConfig(name="sgd"))]:
        got[name] = largest_batch(cluster, model, seq_len=SEQ, max_microbatches=MAX_R, shard_optimizer_state=False,
                                  optimizer=optimizer)
        if name != "default":  # the default prices as unfused AdamW: equal to its brute force below
            assert got[name] == brute_largest(model, cluster, False, optimizer=optimizer), name
    assert got["default"] == got["unfused"] <= got["adamw"] < got["momentum"] < got["sgd"], got
    plan = make_plan(cluster, model, seq_len=SEQ, global_batch_tokens=got["sgd"] * SEQ, max_microbatches=MAX_R,
                     shard_optimizer_state=False, optimizer=OptimConfig(name="sgd"), max_waves=1)
    assert plan.total_seqs == got["sgd"]
    with pytest.raises(ValueError, match="no layout"):
        make_plan(cluster, model, seq_len=SEQ, global_batch_tokens=got["sgd"] * SEQ, max_microbatches=MAX_R,
                  shard_optimizer_state=False, max_waves=1)


def test_a_weight_average_kept_on_the_device_is_priced_as_the_callback_keeps_it():
    """Lightning's ``EMAWeightAveraging`` keeps a copy of every fp32 weight: the memory model
    prices 4 bytes a parameter per average (what the callback's copy of the pack's model
    holds), the largest batch shrinks by it, still equal to the brute force priced alike,
    and a batch that plans without the average is refused with it."""
    from torch.optim.swa_utils import AveragedModel

    from reference import make_model

    module = make_model(4)
    copy = AveragedModel(module)  # what WeightAveraging builds in its set-up
    params = sum(p.numel() for p in module.parameters())
    held = sum(t.numel() * t.element_size() for t in copy.module.parameters())
    assert held / params == 4.0
    model = small_model(2, 4, 256)
    assert MemoryModel.for_optimizer(model, None, 1).bytes_per_param - MemoryModel.for_optimizer(
        model, None).bytes_per_param == held / params
    with pytest.raises(ValueError, match="weight_averages=-1 is invalid"):
        MemoryModel.for_optimizer(model, None, -1)

    mem = MemoryModel(model)
    state = (mem.attention_stack_params() + 8 * mem.expert_params()) * 16 / 1e9
    cluster = small_cluster(3, 3, round(state * 0.4, 4), round(state * 0.35, 4))
    got = {n: largest_batch(cluster, model, seq_len=SEQ, max_microbatches=MAX_R, shard_optimizer_state=False,
                            optimizer=OptimConfig(), weight_averages=n) for n in (0, 1)}
    assert got[1] == brute_largest(model, cluster, False, optimizer=OptimConfig(), weight_averages=1)
    assert 0 < got[1] < got[0], got
    kw = dict(seq_len=SEQ, global_batch_tokens=got[0] * SEQ, max_microbatches=MAX_R, shard_optimizer_state=False,
              optimizer=OptimConfig(), max_waves=1)
    assert make_plan(cluster, model, **kw).total_seqs == got[0]
    with pytest.raises(ValueError, match="no layout"):
        make_plan(cluster, model, weight_averages=1, **kw)


def test_the_issue_case_plans_up_to_its_largest_batch():
    """Issue 41: a Mixtral-8x7B-sized model on 16 A40 + 16 V100, 4K sequences. A refused
    batch names the binding constraint and the largest batch that plans; that batch plans
    and fits, one more does not."""
    from lightning_hetermoe.configs import from_cfg

    import yaml

    with open("conf/model/mixtral_8x7b.yaml") as f:
        model = from_cfg(ModelConfig, {**yaml.safe_load(f), "activation_checkpointing": True})
    cluster = ClusterConfig(name="a40x16_v100x16", devices=["a40"] * 16 + ["v100"] * 16)
    with pytest.raises(ValueError, match=r"binds; the largest batch that plans is (\d+) sequence") as err:
        make_plan(cluster, model, seq_len=4096, global_batch_tokens=64 * 4096, max_waves=1)
    n = int(err.value.args[0].split("the largest batch that plans is ")[1].split(" ")[0])
    assert 32 < n < 64
    assert n == largest_batch(cluster, model, seq_len=4096)
    plan = make_plan(cluster, model, seq_len=4096, global_batch_tokens=n * 4096, max_waves=1)
    assert plan.total_seqs == n
    assert plan_fits(plan, model, cluster, sharded=True)
    # in waves (gradient accumulation) the batch that was refused plans: all of its 64
    # sequences, in as many waves as the search found fastest (two of 32 would fit)
    plan = make_plan(cluster, model, seq_len=4096, global_batch_tokens=64 * 4096)
    assert plan.waves >= 2 and plan.waves * plan.total_seqs == 64 and plan.global_batch_tokens == 64 * 4096
    assert plan_fits(plan, model, cluster, sharded=True)


def test_apportioning_alike_ranks_block_by_block_is_apportioning_them_one_by_one():
    """The layout search splits a group's sequences over its kinds of rank at once
    (``apportion_alike``): the same split as over every rank, ties and zero shares included."""
    import random

    from lightning_hetermoe.apportion import apportion_alike

    rng = random.Random(0)
    for _ in range(3000):
        blocks = [(rng.choice([0.5, 1.0, 1.0, 2.0, 3.7, rng.random() * 5]), rng.randint(1, 9))
                  for _ in range(rng.randint(1, 4))]
        total = rng.randint(0, 60)
        flat = apportion(total, [w for w, n in blocks for _ in range(n)])
        got = [s for (base, plus), (_, n) in zip(apportion_alike(total, blocks), blocks)
               for s in [base + 1] * plus + [base] * (n - plus)]
        assert got == flat, (total, blocks)
    with pytest.raises(ValueError, match="cannot split"):
        apportion_alike(3, [(1.0, 0)])


def test_the_plan_recipe_takes_the_optimizer_group():
    """``recipes/plan.py optim=sgd optim.momentum=0.9``: the optimizer the plan prices is
    chosen as the training recipe chooses it (AdamW by default)."""
    from helpers_recipe import compose
    from lightning_hetermoe.configs import from_cfg

    assert from_cfg(OptimConfig, compose(config_name="plan").optim) == OptimConfig()
    sgd = from_cfg(OptimConfig, compose("optim=sgd", "optim.momentum=0.9", config_name="plan").optim)
    assert (sgd.name, sgd.momentum) == ("sgd", 0.9)
    # and the weight averages it keeps on the GPU: none unless told
    assert compose(config_name="plan").plan.weight_averages == 0
    assert compose("plan.weight_averages=1", config_name="plan").plan.weight_averages == 1
