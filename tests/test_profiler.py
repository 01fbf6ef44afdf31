"""The profiler on emulated devices (one process, and one rank per kind on 2 gloo processes),
on a virtual clock: only the emulation's padding takes time, so a profile holds exactly
what the profiler decided to measure, not how loaded the machine was."""

import pytest
import torch
import torch.distributed as dist

import lightning_hetermoe.measure as measure
from harness import run_ranks
from helpers_clock import VirtualClock
from lightning_hetermoe import ClusterConfig, ModelConfig
from lightning_hetermoe.emulate import clock as emulate_clock
from lightning_hetermoe.cluster.devices import get_device
from lightning_hetermoe.emulate import emulation_cost_model
from lightning_hetermoe.profile.profile import Profile
from lightning_hetermoe.measure import expert_capacities, profile_cluster
from lightning_hetermoe.profile.timer import make_timer

SEQ = 64
MODEL = ModelConfig()
# "slow" is a custom device: a V100 whose every task pays 0.1 ms of launch overhead, so the
# two kinds differ by far more than timing noise.
CLUSTER = ClusterConfig(name="emu_test", devices=["a40", "slow"], emulate=True, time_scale=500.0,
                        custom_devices={"slow": {"base": "v100", "launch_overhead_s": 1e-4}})
POINTS = dict(seq_len=SEQ, attention_seqs=(1, 4), expert_tokens=(64, 256), repeats=3, warmup=1)
# fewer points on the two gloo ranks, which measure on the same virtual clock
FEW_POINTS = dict(seq_len=SEQ, attention_seqs=(4,), expert_tokens=(256,), repeats=1, warmup=1)


def modelled(kind: str, task: str, tokens: int, backward: bool) -> float:
    cm, dev = emulation_cost_model(), get_device(kind, CLUSTER.custom_devices)
    if task == "attention":
        return cm.attention_time(dev, tokens=tokens, seq_len=SEQ, d_model=MODEL.d_model, n_heads=MODEL.n_heads,
                                 num_experts=MODEL.moe.num_experts, backward=backward)
    return cm.expert_time(dev, tokens=tokens, d_model=MODEL.d_model, d_ff=MODEL.moe.d_ff, backward=backward)


def check_consistent(profile: Profile, points: dict = POINTS) -> None:
    assert profile.source == "emulated" and profile.seq_len == SEQ
    assert sorted(profile.devices) == ["a40", "slow"]
    for kind, dp in profile.devices.items():
        tables = {("attention", False): dp.attention_fwd_s, ("attention", True): dp.attention_bwd_s,
                  ("expert", False): dp.expert_fwd_s, ("expert", True): dp.expert_bwd_s}
        for (task, backward), table in tables.items():
            want_tokens = ([n * SEQ for n in points["attention_seqs"]] if task == "attention"
                           else list(points["expert_tokens"]))
            assert sorted(table) == want_tokens
            for tokens, got in table.items():
                want = modelled(kind, task, tokens, backward)
                assert got == pytest.approx(want, rel=1e-9), (kind, task, tokens, backward, got, want)
        assert dp.head_s == {}  # the LM head is not emulated: the planner takes the cost model's
    # the slow kind really is slower, by the modelled factor
    a40, slow = profile.get("a40"), profile.get("slow")
    ratio = slow.attention_fwd_s[4 * SEQ] / a40.attention_fwd_s[4 * SEQ]
    want = modelled("slow", "attention", 4 * SEQ, False) / modelled("a40", "attention", 4 * SEQ, False)
    assert want > 3 and ratio == pytest.approx(want, rel=1e-9)


@pytest.fixture(scope="module")
def profile() -> Profile:
    prev = torch.get_num_threads()
    clock = VirtualClock()
    with pytest.MonkeyPatch.context() as patch:
        for module in (measure, emulate_clock):
            patch.setattr(module, "time", clock)
        try:
            return profile_cluster(MODEL, CLUSTER, **POINTS)
        finally:
            torch.set_num_threads(prev)


def test_emulated_profile_matches_the_cost_model(profile):
    check_consistent(profile)


def test_profile_json_round_trip_feeds_the_planner_timer(profile, tmp_path):
    path = tmp_path / "profile.json"
    profile.to_json(str(path))
    back = Profile.from_json(str(path))
    assert back == profile
    assert Profile.from_json(profile.to_json()) == profile
    timer = make_timer(MODEL, SEQ, profile=back)
    dev = get_device("slow", CLUSTER.custom_devices)
    assert timer.attention(dev, 4 * SEQ) == back.get("slow").attention_fwd_s[4 * SEQ]
    assert timer.expert(dev, 256, backward=True) == back.get("slow").expert_bwd_s[256]


def test_memory_capacity_follows_device_memory(profile):
    a40, slow = profile.get("a40"), profile.get("slow")
    assert a40.memory_gb == 48 and slow.memory_gb == 32
    assert a40.max_experts_expert > slow.max_experts_expert > 0
    # holding the attention stack leaves room for fewer experts
    assert 0 < a40.max_experts_attention < a40.max_experts_expert
    big = ModelConfig(name="big", d_model=4096, n_heads=32, n_layers=32, max_seq_len=4096,
                      moe=dict(num_experts=64, d_ff=14336))
    n_att, n_exp = expert_capacities(big, get_device("t4"), mb_tokens=4096)
    assert n_att == -1 and 0 <= n_exp < 64  # a T4 cannot hold this attention stack


def test_bad_profile_requests():
    with pytest.raises(ValueError, match="seq_len"):
        profile_cluster(MODEL, CLUSTER, seq_len=4096)
    with pytest.raises(ValueError, match="cannot measure"):
        profile_cluster(MODEL, ClusterConfig(name="real", devices=["a40", "v100"]), seq_len=SEQ)


def _worker(rank: int, world: int) -> dict:
    VirtualClock().install(measure, emulate_clock)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        return profile_cluster(MODEL, CLUSTER, **FEW_POINTS).to_json()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_distributed_profile_measures_each_kind_on_its_rank_and_gathers():
    got = run_ranks(2, _worker, 2)
    assert got[0] == got[1]  # every rank returns the same profile
    check_consistent(Profile.from_json(got[0]), FEW_POINTS)
