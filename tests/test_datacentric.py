"""Data-centric expert training (HEXA-MoE, ``mode="datacentric"``) on real gloo processes:
experts sharded over every rank in proportion to memory and gathered per layer, tokens
never leaving their rank, batch shares by device speed. It equals one process training
on the global batch, keeps at most two layers' full experts alive, and its checkpoints
resume under other modes (and theirs under it)."""

from __future__ import annotations

import copy

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning as L

from harness import run_ranks
from lightning_hetermoe.kernels import grouped_mm_available, grouped_mm_unavailable_reason
from lightning_hetermoe.emulate.hooks import installed
from lightning_hetermoe import HeterMoEStrategy, OptimConfig
from reference import assert_same_params, data, make_model, mixed_cluster, reference_fit, trainer, whole_checkpoint
from helpers_zebra import make_test_plan

STEPS, SAVED = 5, 3
EMULATED_STEPS = 5
EMULATED = dict(name="emu", devices=["a40", "v100"], emulate=True, time_scale=1.5,
                emulate_workload={"model": "d1", "seq_len": 4096})


def model(seed: int, layers: int = 2):
    return make_model(4, n_layers=layers, seed=seed, optim=OptimConfig())


def fit_deep(rank: int, world: int) -> dict | None:
    m = model(rank, layers=4)
    s = HeterMoEStrategy(mode="datacentric", cluster=mixed_cluster(world))
    trainer(s, world, max_steps=STEPS).fit(m, datamodule=data(world, 12, windows=72))
    b = s.backend
    sizes = [sh.sizes for layer in b.shards for sh in layer.values()]
    return {"state": m.state_dict(), "shares": b.shares, "peak": b.peak_alive_bytes, "layer_bytes": b.layer_bytes,
            "sizes": sizes} if rank == 0 else None


@pytest.mark.slow
@pytest.mark.standin
def test_three_ranks_unequal_shares_equal_one_process_with_two_layers_of_experts_alive_at_most():
    got = run_ranks(3, fit_deep, 3)[0]
    m = model(0, layers=4)
    initial = copy.deepcopy(m.state_dict())
    expected = reference_fit(m, STEPS, global_batch=12, windows=72)
    assert got["shares"][0] > got["shares"][1] == got["shares"][2], got["shares"]
    assert all(s[0] > s[1] for s in got["sizes"]), f"the A40's range must be the larger: {got['sizes']}"
    one = max(got["layer_bytes"])
    assert one <= got["peak"] <= 2 * one, f"peak {got['peak']} bytes of full experts, one layer is {one}"
    assert_same_params(got["state"], expected, initial)


def fit_on_kernels(rank: int, world: int) -> dict | None:
    m = make_model(4, seed=rank, optim=OptimConfig(), expert_backend="grouped_mm")
    trainer(HeterMoEStrategy(mode="datacentric", cluster=mixed_cluster(world)), world, max_steps=KERNEL_STEPS).fit(
        m, datamodule=data(world))
    return m.state_dict() if rank == 0 else None


KERNEL_STEPS = 3


@pytest.mark.slow
def test_experts_on_the_grouped_kernels_keep_their_counts_on_the_device_and_equal_one_process():
    """With experts that take their counts on the device (grouped_mm), every choice kept: the
    dispatch sorts without reading the counts back (both the data-centric one and, in the
    reference, the single-process one), and two ranks still equal one process."""
    if not grouped_mm_available("cpu"):
        pytest.skip(grouped_mm_unavailable_reason("cpu"))
    got = run_ranks(2, fit_on_kernels, 2)[0]
    m = make_model(4, seed=0, optim=OptimConfig(), expert_backend="grouped_mm")
    initial = copy.deepcopy(m.state_dict())
    assert_same_params(got, reference_fit(m, KERNEL_STEPS), initial)


def fits_and_resumes(rank: int, world: int, ckpt_dir: str) -> dict | None:
    out = {}
    m = model(rank)
    save = ModelCheckpoint(dirpath=f"{ckpt_dir}/dc", filename="{step}", every_n_train_steps=SAVED, save_top_k=-1)
    trainer(HeterMoEStrategy(mode="datacentric", cluster=mixed_cluster(world)), world, max_steps=STEPS,
            callbacks=[save], enable_checkpointing=True).fit(m, datamodule=data(world))
    out["datacentric"] = m.state_dict()

    m = model(100 + rank)  # the checkpoint decides
    trainer(HeterMoEStrategy(mode="ep"), world, max_steps=STEPS).fit(
        m, datamodule=data(world), ckpt_path=f"{ckpt_dir}/dc/step={SAVED}.ckpt")
    out["datacentric -> ep"] = m.state_dict()

    m = model(rank)
    save = ModelCheckpoint(dirpath=f"{ckpt_dir}/zebra", filename="{step}", every_n_train_steps=SAVED, save_top_k=-1)
    trainer(HeterMoEStrategy(mode="zebra", plan=make_test_plan(world, [0], R=2)), world, max_steps=STEPS,
            callbacks=[save], enable_checkpointing=True).fit(m, datamodule=data(world))

    m = model(100 + rank)
    trainer(HeterMoEStrategy(mode="datacentric", cluster=mixed_cluster(world)), world, max_steps=STEPS).fit(
        m, datamodule=data(world), ckpt_path=f"{ckpt_dir}/zebra/step={SAVED}.ckpt")
    out["zebra -> datacentric"] = m.state_dict()

    # on an emulated A40+V100 (the D1 4K clock): the gathers and reduce-scatters are padded
    # like any transfer, and the step takes what the simulator predicts
    m = model(rank)
    s = HeterMoEStrategy(mode="datacentric", cluster=EMULATED)
    steps = StepTimes()
    trainer(s, world, max_steps=EMULATED_STEPS, callbacks=[steps]).fit(m, datamodule=data(world))
    # the fastest step after the first: the clock pads each task up to its modelled time, so a
    # busy host only ever makes a step slower than predicted, never faster
    emulated = {"measured": min(steps.seconds[1:]), "predicted": s.clock.prediction["step_time_s"],
                "transfers": steps.transfers, "attention": steps.attention}
    return (out, emulated) if rank == 0 else None


class StepTimes(L.Callback):
    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.transfers = 0

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.seconds.append(trainer.strategy.clock.last_step_s)
        stats = installed(pl_module).stats
        self.transfers = stats["transfer"].count
        self.attention = {"count": stats["attention"].count, "overruns": stats["attention"].overruns}


@pytest.mark.slow
def test_two_ranks_equal_one_process_and_checkpoints_resume_across_modes(tmp_path):
    got, emulated = run_ranks(2, fits_and_resumes, 2, str(tmp_path))[0]
    # steps x 2 layers x (forward gather, backward gather, reduce-scatter of 2 tensors)
    assert emulated["transfers"] == EMULATED_STEPS * 2 * 4, emulated
    print(f"emulated datacentric: {emulated}")
    assert abs(emulated["measured"] / emulated["predicted"] - 1) < 0.25, emulated
    # a reduce-scatter autograd runs inside the block's backward is a transfer, not attention
    # work: counted there, every backward attention task (half of them) overran by its time;
    # a busy host makes some overrun (a quarter of them, seen on a loaded 2-core machine)
    attention = emulated["attention"]
    assert attention["count"] == EMULATED_STEPS * 2 * 2 and attention["overruns"] < attention["count"] / 2, attention
    m = model(0)
    initial = copy.deepcopy(m.state_dict())
    expected = reference_fit(m, STEPS)
    ckpt = whole_checkpoint(tmp_path / "dc" / f"step={SAVED}.ckpt")
    w_up = ckpt["state_dict"]["model.blocks.0.moe.experts.w_up"]
    assert w_up.shape == (4, 16, 24), "a data-centric checkpoint holds every expert, whole"
    moments = [s for s in ckpt["optimizer_states"][0]["state"].values() if s["exp_avg"].shape == (4, 16, 24)]
    assert moments, "the experts' optimizer state is saved whole too"
    for run, state in got.items():
        assert_same_params(state, expected, initial)


def test_the_simulator_prices_where_each_side_wins_and_what_does_not_fit():
    """HEXA-MoE's trade in the model: sending the experts to the tokens wins when a step's
    tokens outweigh the expert weights (long sequences, few experts), expert parallelism
    otherwise; a rank that cannot hold its shard plus two gathered layers is refused."""
    import pytest

    from lightning_hetermoe import LinkConfig, ModelConfig, MoEConfig, get_device
    from lightning_hetermoe.profile import make_timer
    from lightning_hetermoe.simulate import ep_setup, simulate_step
    from lightning_hetermoe.simulate.datacentric import datacentric_step_time

    devs, link = [get_device("a40"), get_device("v100")], LinkConfig(bandwidth_gbps=100)

    def both(seq: int, experts: int, d_ff: int = 2048) -> tuple[float, float]:
        m = ModelConfig(d_model=1024, n_layers=8, n_heads=16, max_seq_len=seq,
                        moe=MoEConfig(num_experts=experts, top_k=2, d_ff=d_ff))
        t = make_timer(m, seq)
        dc = datacentric_step_time(devs, m, seq_len=seq, total_seqs=16, link=link, timer=t)
        setup = ep_setup(devs, m, seq_len=seq, total_seqs=16, link=link, timer=t, balanced=True, num_microbatches=1)
        return dc, simulate_step(setup, t, "ep").step_time

    dc, ep = both(16384, 4)
    assert dc < ep, (dc, ep)
    dc, ep = both(1024, 64)
    assert ep < 0.5 * dc, (dc, ep)
    with pytest.raises(ValueError, match="cannot hold its expert shard"):
        both(1024, 256, d_ff=16384)


def test_predictions_of_ep_and_datacentric_price_the_optimizer_the_run_trains_with():
    """EP's fewest micro-batches and data-centric's memory check price the run's optimizer
    state, as the planner does (``None``: unfused AdamW): a layout AdamW's state leaves no
    room for fits with plain SGD's, and the planner's table and a run's clock ask with it."""
    from lightning_hetermoe import LinkConfig, ModelConfig, MoEConfig, get_device
    from lightning_hetermoe.profile import make_timer
    from lightning_hetermoe.simulate import ep_setup, predict_step
    from lightning_hetermoe.simulate.datacentric import datacentric_step_time

    devs, link = [get_device("a40"), get_device("v100")], LinkConfig(bandwidth_gbps=100)
    sgd, adamw = OptimConfig(name="sgd", momentum=0.0), OptimConfig()

    def cfg(experts: int, seq: int = 1024) -> ModelConfig:
        return ModelConfig(d_model=1024, n_layers=8, n_heads=16, max_seq_len=seq,
                           moe=MoEConfig(num_experts=experts, top_k=2, d_ff=16384))

    def fits(experts: int, optimizer) -> bool:
        m = cfg(experts)
        try:
            datacentric_step_time(devs, m, seq_len=1024, total_seqs=16, link=link, timer=make_timer(m, 1024),
                                  optimizer=optimizer)
        except ValueError as err:
            assert "cannot hold" in str(err)
            return False
        return True

    # the most experts each optimizer's state leaves room for, found by trying every count
    most = {name: max(e for e in range(2, 257, 2) if fits(e, opt))
            for name, opt in [("default", None), ("unfused", OptimConfig(fused=False)), ("adamw", adamw), ("sgd", sgd)]}
    assert most["default"] == most["unfused"] <= most["adamw"] < most["sgd"], most
    # the step times agree where both fit: memory is checked, the clock is the same
    m = cfg(most["default"])
    t = make_timer(m, 1024)
    assert datacentric_step_time(devs, m, seq_len=1024, total_seqs=16, link=link, timer=t, optimizer=sgd) == \
        datacentric_step_time(devs, m, seq_len=1024, total_seqs=16, link=link, timer=t)
    with pytest.raises(ValueError, match="cannot hold"):
        predict_step("datacentric", devs, cfg(most["sgd"]), link, make_timer(cfg(most["sgd"]), 1024), seq_len=1024,
                     total_seqs=16)
    assert predict_step("datacentric", devs, cfg(most["sgd"]), link, make_timer(cfg(most["sgd"]), 1024),
                        seq_len=1024, total_seqs=16, optimizer=sgd).step_time > 0

    # EP: the fewest micro-batches that fit, with each optimizer's state
    seq = 4096
    m = ModelConfig(d_model=1024, n_layers=8, n_heads=16, max_seq_len=seq,
                    moe=MoEConfig(num_experts=4, top_k=2, d_ff=16384))
    t = make_timer(m, seq)
    got = {name: ep_setup(devs, m, seq_len=seq, total_seqs=16, link=link, timer=t, optimizer=opt).num_microbatches
           for name, opt in [("default", None), ("unfused", OptimConfig(fused=False)), ("adamw", adamw), ("sgd", sgd)]}
    assert got["default"] == got["unfused"] >= got["adamw"] > got["sgd"], got


def test_the_plan_table_and_a_runs_clock_price_the_optimizer_it_trains_with():
    """The plan's predicted table (EP beside zebra) and a run's clock (what ``mode="auto"``
    and the rebalancer compare) price the run's optimizer: AdamW's state leaves EP (in the
    table) and data-centric (on the clock) no room on this cluster, plain SGD's does."""
    from lightning_hetermoe import ClusterConfig, ModelConfig, MoEConfig, get_device
    from lightning_hetermoe.plan import make_plan
    from lightning_hetermoe.strategy.backends.base import Simulated
    from lightning_hetermoe.strategy.run_clock import RunClock

    m = ModelConfig(d_model=1024, n_layers=8, n_heads=16, max_seq_len=1024,
                    moe=MoEConfig(num_experts=10, top_k=2, d_ff=16384))
    cluster = ClusterConfig(name="a40+v100", devices=["a40", "v100"])
    sgd = OptimConfig(name="sgd", momentum=0.0)
    table = {name: make_plan(cluster, m, seq_len=1024, global_batch_tokens=16 * 1024, optimizer=opt).predicted
             for name, opt in [("adamw", OptimConfig()), ("sgd", sgd)]}
    assert table["adamw"]["ep"]["step_time_s"] is None and "EP does not fit" in table["adamw"]["ep"]["error"]
    assert table["sgd"]["ep"]["step_time_s"] > 0

    # the run's own clock prices EP as the run lays it out (one micro-batch): data-centric's memory binds
    big = ModelConfig(d_model=1024, n_layers=8, n_heads=16, max_seq_len=1024,
                      moe=MoEConfig(num_experts=20, top_k=2, d_ff=16384))
    devices = [get_device("a40"), get_device("v100")]
    for opt, fits in [(OptimConfig(), False), (sgd, True)]:
        clock = RunClock(cluster, None, rank=0)
        clock.bind(big, per_rank=8, seq_len=1024, world_size=2, devices=devices, precision="bf16-mixed", optimizer=opt)
        if fits:
            assert clock.step_time(Simulated("datacentric")) > 0
        else:
            with pytest.raises(ValueError, match="cannot hold"):
                clock.step_time(Simulated("datacentric"))


class WeightCalls(L.Callback):
    """Each layer's weights() calls in the last step: (layer, in a backward, came over the
    wire, issued ahead)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, bool, bool, bool]] = []

    def on_train_start(self, trainer, pl_module) -> None:
        from lightning_hetermoe.backward import inside_backward
        from lightning_hetermoe.model_contract import moe_layers

        for _, layer in moe_layers(pl_module):
            disp, weights = layer.dispatcher, layer.dispatcher.weights

            def watched(names, parts, disp=disp, weights=weights):
                out = weights(names, parts)
                self.calls.append((disp.layer, inside_backward(), disp.gathered, disp.ahead))
                return out

            disp.weights = watched

    def on_train_batch_start(self, *args) -> None:
        self.calls.clear()


def fit_checkpointed(rank: int, world: int) -> dict | None:
    from lightning_hetermoe import comm

    m = make_model(4, seed=rank, optim=OptimConfig(), activation_checkpointing=True)
    s = HeterMoEStrategy(mode="datacentric", cluster=mixed_cluster(world))
    calls = WeightCalls()
    with comm.record() as issued:
        trainer(s, world, max_steps=STEPS, callbacks=[calls]).fit(m, datamodule=data(world))
    gathers = sum(1 for c in issued if c.what.startswith("datacentric.gather."))
    return {"state": m.state_dict(), "gathers": gathers, "peak": s.backend.peak_alive_bytes,
            "alive": s.backend.alive_bytes, "layer_bytes": s.backend.layer_bytes,
            "calls": calls.calls} if rank == 0 else None


@pytest.mark.slow
def test_checkpointed_blocks_gather_each_layer_once_in_the_backward_and_equal_one_process():
    """A checkpointed block's backward runs its experts twice (the block's recompute, then
    the experts' own): the layer gathered for the first serves the second, so a step
    gathers each layer twice (forward, backward), not three times; every gather but the
    top layer's backward was issued ahead of its use (the backward's once the layer above
    was reduce-scattered; the first layer's forward one just before); the weights equal one process's with stored
    activations, and no more than two layers' full experts live."""
    got = run_ranks(2, fit_checkpointed, 2)[0]
    layers, tensors = 2, 2  # each layer's w_up and w_down
    assert got["gathers"] == STEPS * layers * tensors * 2, got["gathers"]
    # (layer, in a backward, came over the wire, issued ahead) per weights() call of the last step
    assert got["calls"] == [(0, False, True, True), (1, False, True, True),  # layer 0's leaves as its experts start
                            (1, True, True, False), (1, True, False, False),
                            (0, True, True, True), (0, True, False, False)], got["calls"]
    assert got["peak"] <= 2 * max(got["layer_bytes"]) * 2, got  # two layers' full tensors (the shards x world)
    assert got["alive"] == 0, got  # every full tensor, kept ones too, counted once and let go
    m = make_model(4, seed=0, optim=OptimConfig())
    initial = copy.deepcopy(m.state_dict())
    assert_same_params(got["state"], reference_fit(m, STEPS), initial)
