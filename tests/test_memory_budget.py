"""Memory is a budget: each rank's state priced per mode (sharded optimizer state included),
a mode that cannot fit refused before launch with what would fit, and a rank that passes its
device's budget (``cluster.memory_scale``) at run time stopped with its name and what it held."""

from __future__ import annotations

import dataclasses
import re

import pytest
from lightning.pytorch.callbacks import EMAWeightAveraging

from harness import run_ranks
from lightning_hetermoe import HeterMoEStrategy
from lightning_hetermoe.cluster import get_device
from lightning_hetermoe.configs import ConfigError
from lightning_hetermoe.profile.memory import MemoryModel, RankMemory, spread_memory
from lightning_hetermoe.strategy.memory_watch import MemoryBudgetError
from reference import data, make_model, trainer


def test_rank_state_prices_sharded_optimizer_state_and_memory_proportional_shares():
    plain = RankMemory.of(dense_params=100, expert_params=50)
    sharded = RankMemory.of(dense_params=100, expert_params=50, dense_shards=4)
    assert plain.state == 150 * 16 and sharded.optimizer == (25 + 50) * 8
    cfg = make_model(8).model_cfg
    a40, v100 = get_device("a40"), get_device("v100")
    dc = spread_memory(cfg, "datacentric", [a40, v100])
    experts = [m.weights / 4 - MemoryModel(cfg).attention_stack_params() for m in dc]
    assert experts[0] / experts[1] == pytest.approx(a40.memory_gb / v100.memory_gb)
    ep = spread_memory(cfg, "ep", [a40, v100], shard_optimizer_state=False)
    ep_sharded = spread_memory(cfg, "ep", [a40, v100])
    dense = MemoryModel(cfg).attention_stack_params()
    assert ep[0].optimizer - ep_sharded[0].optimizer == pytest.approx(dense * 8 / 2)


def test_a_mode_that_cannot_fit_is_refused_before_launch_with_what_would_fit():
    cluster = {"name": "small", "devices": ["cpu", "cpu"], "memory_scale": 2e-6}
    t = trainer(HeterMoEStrategy(mode="ep", cluster=cluster), 2)
    # with more than one layer of experts, the optimizer step's temporaries outweigh DDP's
    # buckets and one layer's expert gradients: the message names the step
    with pytest.raises(ConfigError, match=r"mode='ep' does not fit: rank \d \(cpu.*of temporaries at its optimizer "
                                          r"step\. What would fit.*such devices"):
        t.fit(make_model(4), datamodule=data(2))


def test_the_check_before_launch_prices_the_models_optimizer():
    """EP on two CPUs at a budget where AdamW's 8 bytes of state a parameter do not fit and
    plain SGD's none do: refused for the one, let through for the other (the model's own
    ``optim``), no process started."""
    from lightning_hetermoe import OptimConfig

    cluster = {"name": "small", "devices": ["cpu", "cpu"], "memory_scale": 1.5e-5}
    with pytest.raises(ConfigError, match=r"mode='ep' does not fit: rank \d .*would hold 204 kB of weights"):
        HeterMoEStrategy(mode="ep", cluster=cluster).args.check_memory(make_model(4, optim=OptimConfig()), 2)
    HeterMoEStrategy(mode="ep", cluster=cluster).args.check_memory(make_model(4, optim=OptimConfig(name="sgd")), 2)


def test_the_check_before_launch_prices_ep_groups_smaller_than_the_world():
    """expert_parallel_size=1 on two ranks: each rank holds every expert (two EP groups of
    one), twice what one world-wide group gives it. At a budget where the one group fits,
    the two are refused, naming the setting that fits (they were priced as one group)."""
    from lightning_hetermoe import OptimConfig

    cluster = {"name": "small", "devices": ["cpu", "cpu"], "memory_scale": 1.2e-5}
    model = make_model(4, optim=OptimConfig(name="sgd"))
    HeterMoEStrategy(mode="ep", cluster=cluster).args.check_memory(model, 2)
    HeterMoEStrategy(mode="ep", cluster=cluster, expert_parallel_size=2).args.check_memory(model, 2)
    with pytest.raises(ConfigError, match=r"mode='ep' does not fit: rank 0 .*What would fit: expert_parallel_size=2 "
                                          r"\(one EP group"):
        HeterMoEStrategy(mode="ep", cluster=cluster, expert_parallel_size=1).args.check_memory(model, 2)
    # "auto" takes only sizes that fit: it passes where the world-wide group does, and is
    # refused with it where that does not fit either
    HeterMoEStrategy(mode="ep", cluster=cluster, expert_parallel_size="auto").args.check_memory(model, 2)
    with pytest.raises(ConfigError, match=r"mode='ep' does not fit: rank \d "):
        HeterMoEStrategy(mode="ep", cluster={**cluster, "memory_scale": 0.6e-5},
                         expert_parallel_size="auto").args.check_memory(model, 2)
    cfg, devices = model.model_cfg, [get_device("cpu")] * 4
    experts = [m.weights for m in spread_memory(cfg, "ep", devices, ep_size=2)]
    whole = [m.weights for m in spread_memory(cfg, "ep", devices)]
    per_expert = MemoryModel(cfg).expert_params() * 4 * cfg.n_layers
    assert [a - b for a, b in zip(experts, whole)] == pytest.approx([per_expert * cfg.moe.num_experts / 4] * 4)


def fit_over_budget(rank: int, averaged: bool) -> tuple[str, float]:
    # one process: 16 GB x 1e-5 = 160 kB for a model whose state alone is ~240 kB
    cluster = {"name": "tiny", "devices": ["cpu"], "memory_scale": 1e-5}
    t = trainer(HeterMoEStrategy(cluster=cluster), 1, max_steps=2,
                callbacks=[EMAWeightAveraging()] if averaged else [])
    model = make_model(4)
    try:
        t.fit(model, datamodule=data(1))
    except MemoryBudgetError as err:
        assert t.strategy.memory.budget == pytest.approx(16e9 * 1e-5)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        return str(err), t.strategy.memory.predicted.averages / weights
    return "no error", 0.0


@pytest.mark.slow
@pytest.mark.parametrize("averaged", [False, True], ids=["plain", "weight_average"])
def test_a_rank_past_its_budget_ends_the_run_naming_it_and_what_it_held(averaged):
    """What it held names a weight average kept on the device (Lightning's EMA: a copy of
    the weights, which the prediction counts too) and says where else it could be kept."""
    # its own process: a failed fit leaves a process group behind
    ((message, averages),) = run_ranks(1, fit_over_budget, averaged)
    assert re.search(r"rank 0 \(single device cpu\) used .* over its budget of 160 kB \(memory_scale 1e-05\); it "
                     r"held weights .*optimizer state", message), message
    assert ("weight averages" in message and "WeightAveraging(device='cpu')" in message) == averaged, message
    assert averages == (1.0 if averaged else 0.0)  # the average: the weights' size, counted in the prediction


def test_the_zebra_gradient_sync_is_priced_at_one_bucket_beside_the_state():
    """Zebra sums its dense gradients through one reused buffer of at most one bucket: the
    memory model adds that bucket to an attention rank (or the whole dense part where it is
    smaller), not the dense gradients' size, and never counts it as activations."""
    from lightning_hetermoe.configs import ModelConfig, MoEConfig
    from lightning_hetermoe.profile.memory import GRAD_BUCKET_BYTES, activation_bytes, working_bytes
    from lightning_hetermoe.strategy.backends.zebra import backend as zebra_backend

    assert zebra_backend.BUCKET_BYTES == GRAD_BUCKET_BYTES  # the size the strategy syncs in is the one priced
    small = dataclasses.replace(make_model(4).model_cfg, activation_checkpointing=True)
    large = ModelConfig(d_model=2048, n_layers=4, moe=MoEConfig(num_experts=4), activation_checkpointing=True)
    for cfg in (small, large):  # checkpointed: the activations are what attention_bytes counts beside the state
        mem = MemoryModel(cfg)
        dense_grads = mem.attention_stack_params() * 4
        assert mem.grad_sync_bytes() == min(GRAD_BUCKET_BYTES, dense_grads) > 0
        state = mem.attention_stack_params() * mem.bytes_per_param
        act = activation_bytes(cfg, tokens_in_flight=64, mb_tokens=32, act_bytes=2)
        assert mem.attention_bytes(tokens_in_flight=64, mb_tokens=32) == pytest.approx(
            state + mem.grad_sync_bytes() + act)
    assert MemoryModel(large).grad_sync_bytes() == GRAD_BUCKET_BYTES < MemoryModel(large).attention_stack_params() * 4
    for mode, want in (("zebra", GRAD_BUCKET_BYTES), ("distep", GRAD_BUCKET_BYTES), ("ep", 10 ** 9), ("single", 0)):
        assert working_bytes(mode, layer_expert_bytes=0, local_layer_expert_bytes=0, dense_bytes=10 ** 9) == want, mode
    assert working_bytes("zebra", layer_expert_bytes=0, local_layer_expert_bytes=0, dense_bytes=1000) == 1000


def _step_high_water(optimizer, n_params: int) -> float:
    """Bytes per parameter the second step of ``optimizer`` raised the process's resident
    high-water mark by (the first allocates the state)."""
    import gc

    from lightning_hetermoe.strategy.memory_watch import return_freed_memory, rss_bytes

    return_freed_memory()
    optimizer.step()
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the resident set now
    except OSError as err:
        pytest.skip(f"this kernel cannot reset the resident high-water mark: {err}")
    before = rss_bytes("VmRSS")
    optimizer.step()
    return (rss_bytes("VmHWM") - before) / n_params


@pytest.mark.parametrize("path", ["foreach", "fused", "single"])
def test_the_optimizer_steps_temporaries_are_what_the_memory_model_prices(path):
    """AdamW's step allocates beside its state: the multi-tensor path (torch's default on a
    GPU) the square root of every parameter's second moment at once, 4 bytes per parameter;
    the fused one nothing; the per-parameter one (the CPU's default) a few tensors the size
    of the largest parameter. Measured here, priced by ``optimizer_step_bytes``."""
    import torch

    from lightning_hetermoe.profile.memory import FOREACH_STEP_BYTES
    from lightning_hetermoe.strategy.memory_watch import optimizer_step_bytes

    n, pieces = 20_000_000, 10
    params = [torch.nn.Parameter(torch.randn(n // pieces)) for _ in range(pieces)]
    for p in params:
        p.grad = torch.randn_like(p)
    kw = {"foreach": dict(foreach=True), "fused": dict(fused=True), "single": dict(foreach=False)}[path]
    opt = torch.optim.AdamW(params, lr=1e-3, **kw)
    measured = _step_high_water(opt, n)
    priced = optimizer_step_bytes([opt]) / n
    expected = {"foreach": FOREACH_STEP_BYTES, "fused": 0.0, "single": 3 * 4 / pieces}[path]
    assert priced == pytest.approx(expected)
    # within 0.2 bytes per parameter (a page-granular resident set; allocator slack)
    assert measured == pytest.approx(priced, abs=0.2), (path, measured, priced)
    # plain SGD steps in place
    assert optimizer_step_bytes([torch.optim.SGD(params, lr=0.1, foreach=True)]) == 0.0


def test_an_expert_rank_must_fit_its_optimizer_step_as_well_as_its_tokens_in_flight():
    """At the optimizer step the activations are gone and the step's temporaries are there:
    an expert rank, whose state is nearly all it holds, fits 16/20 as many experts as its
    state alone would allow; a rank's total is its state plus the larger of the two peaks."""
    from lightning_hetermoe.configs import ModelConfig, MoEConfig

    cfg = ModelConfig(d_model=2048, n_layers=8, moe=MoEConfig(num_experts=8, d_ff=8192))
    v100 = get_device("v100")
    fused, default = MemoryModel(cfg, optimizer_step_bytes_per_param=0.0), MemoryModel(cfg)
    per_expert = default.expert_params()
    by_state = int(v100.usable_bytes // (per_expert * 16))
    assert fused.expert_capacity(v100, tokens_in_flight_per_expert=0, mb_tokens_per_expert=0) == by_state
    assert default.expert_capacity(v100, tokens_in_flight_per_expert=0, mb_tokens_per_expert=0) == \
        int(v100.usable_bytes // (per_expert * 20)) < by_state
    # enough tokens in flight that what they leave saved (2 fp16 rows each, and SwiGLU's
    # gate and up) outweighs the step's 4 bytes per parameter: the flight binds, with or
    # without the step's temporaries
    assert default.expert_row_values() == 2 * cfg.d_model + 2 * cfg.moe.d_ff
    flight = 4 * per_expert / default.expert_row_values()
    live = default.expert_bytes(tokens_in_flight_per_expert=flight)
    assert live == pytest.approx(per_expert * (16 + 8))
    for mem in (default, fused):
        assert mem.expert_capacity(v100, tokens_in_flight_per_expert=flight, mb_tokens_per_expert=0) == \
            int(v100.usable_bytes // live) > 0
    rank = RankMemory.of(dense_params=0, expert_params=100, activations=100, working=50)
    assert rank.step == 400 and rank.total == 1600 + 400
    assert RankMemory.of(dense_params=0, expert_params=100, activations=500).total == 1600 + 500
    assert RankMemory.of(dense_params=100, expert_params=100, dense_shards=4).step == (25 + 100) * 4


def test_data_centric_ranks_must_also_fit_their_optimizer_step():
    """A data-centric rank computes with two gathered layers beside its state and steps with
    the step's temporaries instead: a device between the two needs is refused, naming the step."""
    from lightning_hetermoe.cluster import LinkConfig
    from lightning_hetermoe.configs import ModelConfig, MoEConfig
    from lightning_hetermoe.profile import CostModel, make_timer
    from lightning_hetermoe.simulate.datacentric import datacentric_step_time, layer_weight_bytes

    cfg = ModelConfig(d_model=1024, n_layers=16, vocab_size=32000, max_seq_len=4096,
                      moe=MoEConfig(num_experts=16, d_ff=4096))
    timer = make_timer(cfg, 4096, cost=CostModel(precision="16-mixed"))
    mem = MemoryModel(cfg)
    params = (cfg.n_layers * cfg.moe.num_experts * mem.expert_params()) / 2 + mem.attention_stack_params()
    computing = params * 16 + 2 * layer_weight_bytes(cfg, timer)
    stepping = params * 20
    assert computing < stepping  # sixteen layers' 4 bytes per parameter outweigh two gathered layers
    between = dataclasses.replace(get_device("a40"), memory_gb=(computing + stepping) / 2 / 1e9)
    roomy = dataclasses.replace(between, memory_gb=stepping * 1.01 / 1e9)
    kw = dict(seq_len=4096, total_seqs=4, link=LinkConfig(), timer=timer)
    assert datacentric_step_time([roomy, roomy], cfg, **kw) > 0
    with pytest.raises(ValueError, match="at the optimizer step"):
        datacentric_step_time([between, between], cfg, **kw)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("recompute", [False, True])
def test_a_routed_rows_saved_values_are_what_the_experts_keep(activation, recompute):
    """The memory model's values per routed row in flight against what the experts' autograd
    really saves for their backward (the round's record keeps the answer beside them)."""
    import torch

    from lightning_hetermoe.configs import ModelConfig, MoEConfig
    from lightning_hetermoe.moe.experts import Experts

    d, f, E, M = 16, 48, 4, 64
    cfg = ModelConfig(d_model=d, n_heads=2, moe=MoEConfig(num_experts=E, d_ff=f, activation=activation,
                                                          recompute_activation=recompute))
    experts = Experts(E, d, f, activation, False, backend="torch", recompute=recompute)
    params = {p.data_ptr() for p in experts.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        if t.is_floating_point() and t.data_ptr() not in params:
            saved[t.data_ptr()] = t.numel()
        return t

    x = torch.randn(M, d, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        experts(x, torch.randperm(M), torch.full((E,), M // E))
    answer = d  # the round's record keeps the experts' output until the backward (zebra/expert_tasks.py)
    assert sum(saved.values()) / M + answer == MemoryModel(cfg).expert_row_values()
    # a model that checkpoints its blocks runs each round's experts again in its backward
    # (tests/test_activation_checkpointing.py counts them): the round keeps its rows and answer
    checkpointed = MemoryModel(dataclasses.replace(cfg, activation_checkpointing=True))
    assert checkpointed.expert_row_values() == 2 * d


def test_a_rounds_working_set_grows_with_the_experts_a_rank_holds_per_layer():
    """A layer's experts compute as one grouped call over all their rows of a micro-batch: a
    rank's working set is its share of experts per layer times one expert's, which holds per
    row the hidden activation and its output (and their gradients); the hidden activation
    once more where it is recomputed rather than kept with the rows in flight."""
    from lightning_hetermoe.configs import ModelConfig, MoEConfig

    v100 = get_device("v100")
    for activation, hidden in (("swiglu", 2 * 4096), ("gelu", 4096)):
        for recompute in (False, True):
            cfg = ModelConfig(d_model=1024, n_layers=8, moe=MoEConfig(num_experts=8, d_ff=4096, activation=activation,
                                                                     recompute_activation=recompute))
            mem = MemoryModel(cfg)
            assert mem.expert_working_bytes(1000) == 1000 * 2 * (4096 + hidden + (hidden if recompute else 0))
            flight, mb = 20000, 5000
            each = mem.expert_bytes(tokens_in_flight_per_expert=flight) + mem.expert_working_bytes(mb) / 8
            got = mem.expert_capacity(v100, tokens_in_flight_per_expert=flight, mb_tokens_per_expert=mb)
            assert got == min(int(v100.usable_bytes // each), int(v100.usable_bytes // mem.expert_step_bytes()))
            # the working set counts once per expert a layer holds, not once per rank
            assert got < mem.expert_capacity(v100, tokens_in_flight_per_expert=flight, mb_tokens_per_expert=0)


def test_what_a_rank_holds_is_counted_where_it_grows_then_now_and_then_and_at_an_overrun():
    """The walk over every tensor a rank holds runs at the first checks (the gradients and
    the optimizer's state appear there), every COUNT_EVERY-th after (the report), at the
    report's end, and at any check whose peak passes the budget (the message)."""
    import torch

    from lightning_hetermoe.strategy.memory_watch import MemoryWatch, held_state

    module = torch.nn.Linear(8, 8)
    opt = torch.optim.Adam(module.parameters())
    watch = MemoryWatch(0, torch.device("cpu"), None, lambda: "a rank")
    weights = sum(p.numel() * 4 for p in module.parameters())
    watch.check(module, [opt], "step 1")
    assert watch.peak_state.total == weights  # no gradients or state yet
    module(torch.randn(2, 8)).sum().backward()
    opt.step()
    watch.check(module, [opt], "step 2")
    trained = held_state(module, [opt]).total
    assert watch.peak_state.total == trained > weights * 4  # + gradients, Adam's two moments and steps
    assert MemoryWatch.COUNT_FIRST == 3
    watch.check(module, [opt], "step 3")
    grown = torch.nn.Linear(8, 64)  # what it holds grows past the first checks: not walked at every one
    for step in range(4, MemoryWatch.COUNT_EVERY):
        watch.check(grown, [], f"step {step}")
    assert watch.peak_state.total == trained
    watch.check(grown, [], f"step {MemoryWatch.COUNT_EVERY}")
    assert watch.peak_state.total == sum(p.numel() * 4 for p in grown.parameters()) > trained
    over = MemoryWatch(0, torch.device("cpu"), 1.0, lambda: "a rank")
    over.baseline = 0  # the whole process's high-water mark against a 1-byte budget: every check is over
    for step in range(1, MemoryWatch.COUNT_FIRST + 1):
        over._checks = 10 * step  # past its first checks, off the every-50th
        with pytest.raises(MemoryBudgetError, match=r"it held weights 1[67] kB"):  # 16,640 B: counted for it
            over.check(torch.nn.Linear(64, 64), [], "a late step")


@pytest.mark.parametrize("optim", [dict(), dict(name="adam"), dict(name="sgd"), dict(name="sgd", momentum=0.9),
                                   dict(fused=True), dict(fused=False)],
                         ids=["adamw", "adam", "sgd", "sgd-momentum", "adamw-fused", "adamw-unfused"])
def test_the_plan_prices_the_state_the_models_optimizer_really_keeps(optim):
    """``optimizer_pricing`` (what the planner charges a parameter) against the optimizer the
    pack's model builds from the same config, after one step: its state's bytes per
    parameter (less a step counter per tensor); and what the strategy hands the planner."""
    import torch

    from lightning_hetermoe import MoELanguageModel, OptimConfig
    from lightning_hetermoe.profile.memory import optimizer_pricing
    from lightning_hetermoe.strategy.memory_watch import held_state, optimizer_bytes_per_param
    from lightning_hetermoe.strategy.arguments import optimizer_of

    cfg = OptimConfig(**optim)
    model = MoELanguageModel(dict(name="tiny", d_model=16, n_layers=1, n_heads=2, vocab_size=64, max_seq_len=16,
                                  moe=dict(num_experts=2, top_k=1, d_ff=16)), cfg)
    opt = model.configure_optimizers()
    opt = opt["optimizer"] if isinstance(opt, dict) else opt
    for p in model.parameters():  # a gradient for every parameter: each gets its state
        p.grad = torch.ones_like(p)
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    steps = sum(4 for s in opt.state.values() if "step" in s and torch.is_tensor(s["step"]))
    state, step = optimizer_pricing(cfg)
    assert (held_state(model, [opt]).optimizer - steps) / n == state == optimizer_bytes_per_param([opt])
    assert step == (0.0 if state == 0.0 or cfg.fused in (True, "auto") else 4.0)
    assert optimizer_of(model) is model.optim_cfg and optimizer_of(torch.nn.Linear(2, 2)) is None


@pytest.mark.slow
def test_a_run_binds_its_clock_with_the_averages_its_callbacks_keep():
    """What the planner and the run's predictions price: the trainer's EMA on the device."""
    assert run_ranks(1, clock_averages) == [1]


def clock_averages(rank: int) -> int:
    t = trainer(HeterMoEStrategy(), 1, max_steps=1, callbacks=[EMAWeightAveraging()])
    t.fit(make_model(4), datamodule=data(1))
    return t.strategy.clock.weight_averages


def test_weight_averages_on_the_device_are_counted_for_the_planner_and_the_check_before_launch():
    """The planner prices the averages the trainer's callbacks will keep on the device: one
    per ``WeightAveraging`` whose ``device`` is the run's kind or unstated (the module's,
    which the strategy puts there), none for one kept in host memory beside a GPU; the check
    before launch counts them too."""
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint, WeightAveraging

    from lightning_hetermoe.strategy.averaging import averages_on

    gpu = torch.device("cuda", 0)  # only compared by kind: no GPU needed
    assert averages_on([EMAWeightAveraging(), ModelCheckpoint()], gpu) == 1
    assert averages_on([EMAWeightAveraging(device="cpu")], gpu) == 0
    assert averages_on([WeightAveraging(device="cuda"), EMAWeightAveraging(device=0)], gpu) == 2
    assert averages_on([EMAWeightAveraging(device="cpu")], torch.device("cpu")) == 1
    assert averages_on([ModelCheckpoint()], gpu) == 0


    # EP on two CPUs at a budget where the state fits and one more copy of the weights does not
    cluster = {"name": "small", "devices": ["cpu", "cpu"], "memory_scale": 1.5e-5}
    from lightning_hetermoe import OptimConfig

    sgd = make_model(4, optim=OptimConfig(name="sgd"))
    HeterMoEStrategy(mode="ep", cluster=cluster).args.check_memory(sgd, 2)
    with pytest.raises(ConfigError, match=r"weight averages \(.*WeightAveraging\(device='cpu'\)"):
        HeterMoEStrategy(mode="ep", cluster=cluster).args.check_memory(sgd, 2, weight_averages=3)
