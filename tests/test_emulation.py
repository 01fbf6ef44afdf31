"""Emulated devices: the modelled clock in one process, and an emulated EP run on 2 gloo processes."""

import json
import math
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from lightning_hetermoe import ClusterConfig, LinkConfig, ModelConfig, MoELanguageModel
from lightning_hetermoe.cluster.devices import get_device
from lightning_hetermoe.emulation import Emulator, EmulationWarning, apply_emulation, emulation_cost_model, installed

ROOT = Path(__file__).resolve().parents[1]
SCALE = 1000.0


@pytest.fixture(autouse=True)
def one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def tiny_model(seed: int = 0) -> MoELanguageModel:
    torch.manual_seed(seed)
    return MoELanguageModel(ModelConfig())


def batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, 256, (8, 64), generator=g)
    return tok, torch.roll(tok, -1, 1)


def modelled_step(model: MoELanguageModel, out, device: str, scale: float) -> tuple[float, float]:
    """Forward and backward seconds the emulated device should take, from the cost model."""
    cm, dev, cfg = emulation_cost_model(), get_device(device), model.model_cfg
    tokens = 8 * 64
    fwd = bwd = 0.0
    for counts in out["tokens_per_expert"].tolist():  # per layer, kept choices per expert
        for backward in (False, True):
            t = cm.attention_time(dev, tokens=tokens, seq_len=64, d_model=cfg.d_model, n_heads=cfg.n_heads,
                                  num_experts=cfg.moe.num_experts, backward=backward)
            t += sum(cm.expert_time(dev, tokens=c, d_model=cfg.d_model, d_ff=cfg.moe.d_ff, backward=backward)
                     for c in counts if c > 0)
            if backward:
                bwd += t
            else:
                fwd += t
    return fwd * scale, bwd * scale


def timed_step(model, b):
    t0 = time.perf_counter()
    out = model.losses(b)
    t1 = time.perf_counter()
    out["loss"].backward()
    t2 = time.perf_counter()
    return out, t1 - t0, t2 - t1


def test_padding_makes_tasks_take_the_modelled_time():
    device = "t4"
    model, b = tiny_model(), batch()
    timed_step(model, b)  # warm-up without emulation
    cluster = ClusterConfig(name="one", devices=[device], emulate=True, time_scale=SCALE)
    handle = apply_emulation(model, cluster, 0)
    timed_step(model, b)  # warm-up with it (first calls are not warned about)
    out, fwd, bwd = timed_step(model, b)
    want_fwd, want_bwd = modelled_step(model, out, device, SCALE)
    # Sleeping never ends early; the unpadded rest (embedding, head, loss) and sleep overshoot
    # add a little on top.
    assert want_fwd * 0.99 <= fwd <= want_fwd * 1.1 + 0.02, (fwd, want_fwd)
    assert want_bwd * 0.99 <= bwd <= want_bwd * 1.1 + 0.02, (bwd, want_bwd)
    stats = handle.emulator.summary()["tasks"]
    assert stats["attention"]["count"] == 2 * 2 * 2 and stats["experts"]["count"] == 2 * 2 * 2
    assert stats["transfer"]["count"] == 0
    # Real CPU compute stayed under the modelled times: no warning was due.
    assert handle.emulator.needed_time_scale == 0.0
    handle.remove()


@pytest.mark.filterwarnings("ignore::lightning_hetermoe.emulation.EmulationWarning")
def test_emulation_changes_the_clock_not_the_math():
    ref, emu, b = tiny_model(), tiny_model(), batch()
    cluster = ClusterConfig(name="one", devices=["v100"], emulate=True, time_scale=1.0)
    apply_emulation(emu, cluster, 0)
    out_ref, out_emu = ref.losses(b), emu.losses(b)
    out_ref["loss"].backward()
    out_emu["loss"].backward()
    assert torch.equal(out_ref["loss"], out_emu["loss"])
    for (n, p), (_, q) in zip(ref.named_parameters(), emu.named_parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_warning_fires_once_with_the_needed_time_scale():
    model, b = tiny_model(), batch()
    cluster = ClusterConfig(name="one", devices=["a40"], emulate=True, time_scale=0.01)
    handle = apply_emulation(model, cluster, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            model.losses(b)["loss"].backward()
    ours = [w for w in caught if issubclass(w.category, EmulationWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    msg = str(ours[0].message)
    assert "time_scale=0.01" in msg and "set cluster.time_scale >=" in msg
    suggested = int(msg.rsplit(">= ", 1)[1].split()[0])
    assert 0.01 < suggested <= math.ceil(handle.emulator.needed_time_scale)
    assert handle.emulator.stats["attention"].overruns > 0


def hook_counts(model):
    return [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]


def test_remove_restores_the_model_and_reapply_does_not_stack():
    model, b = tiny_model(), batch()
    before = hook_counts(model)
    cluster = ClusterConfig(name="one", devices=["a40"], emulate=True, time_scale=SCALE)
    first = apply_emulation(model, cluster, 0)
    after_one = hook_counts(model)
    second = apply_emulation(model, cluster, 0)  # e.g. trainer.validate after trainer.fit
    assert first.removed and installed(model) is second
    assert hook_counts(model) == after_one != before
    second.remove()
    assert hook_counts(model) == before and installed(model) is None
    t0 = time.perf_counter()
    model.losses(b)["loss"].backward()
    elapsed = time.perf_counter() - t0
    want_fwd, _ = modelled_step(model, model.losses(b), "a40", SCALE)
    assert elapsed < want_fwd / 2, (elapsed, want_fwd)


def test_transfer_padding_uses_the_link_model():
    em = Emulator(get_device("a40"), LinkConfig(bandwidth_gbps=8.0, latency_us=100.0), time_scale=10.0)
    # 1 MB over 8 Gbit/s = 1 ms, + 0.1 ms latency, x10
    assert em.transfer_s(1e6) == pytest.approx(0.011)
    t0 = time.perf_counter()
    em.sleep_for("transfer", "x", em.transfer_s(1e6))
    assert 0.011 <= time.perf_counter() - t0 < 0.05  # upper bound: a loaded CI box oversleeps
    with pytest.raises(ValueError, match="time_scale"):
        Emulator(get_device("a40"), LinkConfig(), time_scale=0)


def test_bad_rank_is_rejected():
    with pytest.raises(ValueError, match="outside cluster"):
        apply_emulation(tiny_model(), ClusterConfig(name="x", devices=["a40"], emulate=True), 3)


def predicted_ep_step(cluster_name: str) -> float:
    """Simulated EP step of the composed train config, in emulated wall seconds."""
    from hydra import compose, initialize_config_dir

    from lightning_hetermoe.cluster.devices import resolve_cluster
    from lightning_hetermoe.config import DataConfig, from_cfg
    from lightning_hetermoe.profile.timer import make_timer
    from lightning_hetermoe.simulate import ep_setup, simulate_step

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"cluster={cluster_name}"])
    model, data = from_cfg(ModelConfig, cfg.model), from_cfg(DataConfig, cfg.data)
    cluster = from_cfg(ClusterConfig, cfg.cluster)
    devs = resolve_cluster(cluster)
    timer = make_timer(model, data.seq_len, cost=emulation_cost_model())
    setup = ep_setup(devs, model, seq_len=data.seq_len, total_seqs=data.batch_size * len(devs), link=cluster.link,
                     timer=timer, num_microbatches=1)
    return simulate_step(setup, timer, "ep", keep_timeline=False).step_time * cluster.time_scale


def test_emulated_two_process_run_tracks_the_model(tmp_path):
    """The real strategy on 2 gloo processes playing an A40 and a V100 (conf/cluster/emu_a40_v100.yaml)."""
    predicted = predicted_ep_step("emu_a40_v100")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "train.py"), "cluster=emu_a40_v100", "trainer.max_steps=4",
         "trainer.limit_val_batches=1", "+trainer.num_sanity_val_steps=0", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["cluster"] == "emu_a40_v100" and summary["world_size"] == 2
    measured = summary["step_time_s"]
    # Without emulation a step of the tiny model takes a few tens of ms: the clock is modelled.
    assert abs(measured - predicted) / predicted < 0.35, (measured, predicted)
