"""The cost model must reproduce the HeterMoE paper's measured ratios within +-20%."""

import dataclasses

import pytest

from lightning_hetermoe.cluster import LinkConfig, get_device
from lightning_hetermoe.profile import CostModel

CM = CostModel(activation_checkpointing=True)  # as the paper trained
# the paper's D-series layer shape
D, H, FF = 1024, 16, 3584


def attn(dev, seq_len, **kw):
    # at least two sequences' worth of tokens, as one micro-batch
    return CM.attention_time(
        get_device(dev), tokens=max(2 * seq_len, 8192), seq_len=seq_len, d_model=D, n_heads=H, **kw
    )


def expert(dev, tokens=8192, **kw):
    return CM.expert_time(get_device(dev), tokens=tokens, d_model=D, d_ff=FF, **kw)


def within(x, target, tol=0.20):
    return abs(x - target) <= tol * target


def test_v100_is_about_0_8x_a40_on_experts():
    ratio = expert("a40") / expert("v100")  # V100 throughput relative to A40
    assert within(ratio, 0.8), ratio


def test_l40s_over_t4_about_7x_on_experts():
    ratio = expert("t4") / expert("l40s")
    assert within(ratio, 7.0), ratio


def test_a40_over_v100_on_attention_grows_with_seq_len_to_3_7x_at_64k():
    ratios = [attn("v100", s) / attn("a40", s) for s in (1024, 4096, 16384, 65536)]
    assert ratios == sorted(ratios) and ratios[0] < ratios[-1] * 0.6, ratios
    assert within(ratios[-1], 3.7), ratios


def test_l40s_over_t4_on_attention_9_9x_at_4k_and_13_6x_at_64k():
    assert within(attn("t4", 4096) / attn("l40s", 4096), 9.9)
    assert within(attn("t4", 65536) / attn("l40s", 65536), 13.6)


def test_flash_attention_and_causality_matter():
    dev = get_device("a40")
    no_flash = dev.__class__(**{**dev.to_dict(), "flash_attention": False, "compute_capability": (8, 6)})
    core = CM.attention_core_time(dev, tokens=65536, seq_len=65536, d_model=D)
    core_nf = CM.attention_core_time(no_flash, tokens=65536, seq_len=65536, d_model=D)
    assert core_nf == pytest.approx(2 * core, rel=1e-6)  # no causal block skipping
    # the quadratic term: doubling S at fixed tokens doubles the core time
    assert CM.attention_core_time(dev, tokens=65536, seq_len=32768, d_model=D) == pytest.approx(core / 2, rel=1e-6)


def test_backward_is_three_forwards_with_checkpointing_and_two_without():
    f = expert("a40")
    assert expert("a40", backward=True) == pytest.approx(3 * f)
    assert CostModel(activation_checkpointing=False).expert_time(
        get_device("a40"), tokens=8192, d_model=D, d_ff=FF, backward=True
    ) == pytest.approx(2 * f)
    assert attn("v100", 4096, backward=True) == pytest.approx(3 * attn("v100", 4096))


def test_recomputing_the_hidden_activation_costs_the_up_projection_again():
    """``moe.recompute_activation``: each expert backward forms the hidden activation again
    (the up-projection), except inside a checkpointed block, which recomputes it anyway."""
    from dataclasses import replace

    from lightning_hetermoe.configs import workload_model
    from lightning_hetermoe.profile import make_timer

    dev = get_device("v100")
    plain = workload_model("d1")
    recompute = replace(plain, moe=replace(plain.moe, recompute_activation=True))
    up = CostModel().gemm_time(dev, 8192, plain.d_model, 2 * plain.moe.d_ff)  # SwiGLU's gate and up
    t, r = make_timer(plain, 4096), make_timer(recompute, 4096)
    assert r.expert(dev, 8192) == t.expert(dev, 8192)
    assert r.expert(dev, 8192, backward=True) == pytest.approx(t.expert(dev, 8192, backward=True) + up)
    both = make_timer(replace(recompute, activation_checkpointing=True), 4096)
    assert both.expert(dev, 8192, backward=True) == pytest.approx(3 * both.expert(dev, 8192))


def test_a_timer_prices_the_recomputation_its_model_does():
    """A plan prices what the run does: left unset, the cost model takes the timed model's
    ``activation_checkpointing`` (as the memory model does); set, it holds."""
    from dataclasses import replace

    from lightning_hetermoe.configs import workload_model
    from lightning_hetermoe.profile import make_timer

    dev = get_device("a40")
    plain = workload_model("d1")
    assert not plain.activation_checkpointing
    ckpt = replace(plain, activation_checkpointing=True)
    for model, extra in ((plain, 0.0), (ckpt, 1.0)):
        t = make_timer(model, 4096, cost=CostModel())
        assert t.cost.activation_checkpointing is model.activation_checkpointing
        for task in (t.expert, lambda d, n, backward=False: t.attention(d, n, backward)):
            assert task(dev, 8192, backward=True) == pytest.approx((2.0 + extra) * task(dev, 8192))
    forced = make_timer(plain, 4096, cost=CostModel(activation_checkpointing=True))
    assert forced.expert(dev, 8192, backward=True) == pytest.approx(3 * forced.expert(dev, 8192))
    assert CostModel().expert_time(dev, tokens=8192, d_model=D, d_ff=FF, backward=True) == pytest.approx(
        2 * CostModel().expert_time(dev, tokens=8192, d_model=D, d_ff=FF))


def test_small_token_counts_are_memory_bound_and_zero_is_free():
    dev = get_device("a40")
    t1 = CM.expert_time(dev, tokens=1, d_model=D, d_ff=FF)
    weights = 3 * D * FF * 2  # fp16 bytes read once
    assert t1 >= weights / dev.stream_bw
    assert CM.expert_time(dev, tokens=0, d_model=D, d_ff=FF) == 0.0
    assert CM.attention_time(dev, tokens=0, seq_len=128, d_model=D, n_heads=H) == 0.0


def test_comm_time_is_latency_plus_bytes_over_bandwidth():
    link = LinkConfig(bandwidth_gbps=100.0, latency_us=10.0)
    assert CM.comm_time(0, link) == 0.0
    assert CM.comm_time(12.5e9, link) == pytest.approx(1.0 + 10e-6)
    assert CM.comm_time(2e6, link) < CM.comm_time(4e6, link)
    assert CM.allreduce_time(1e9, 1, link) == 0.0
    # ring all-reduce moves 2(n-1)/n of the buffer
    assert CM.allreduce_time(1e9, 4, link) == pytest.approx(6 * 10e-6 + 1.5 * 1e9 * 8 / 100e9)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="activation"):
        CM.expert_time(get_device("a40"), tokens=10, d_model=D, d_ff=FF, activation="relu")
    with pytest.raises(ValueError, match="n_heads"):
        CM.attention_time(get_device("a40"), tokens=10, seq_len=10, d_model=1000, n_heads=16)


def test_the_plan_prices_the_precision_it_runs():
    """fp32 runs GEMMs on CUDA cores (or TF32 where torch allows it), 16-bit precisions on
    tensor cores: on a GEMM-bound task the times differ by the ratio of the device's peaks;
    a plan for the same cluster and batch says which it priced."""
    from lightning_hetermoe.plan import make_plan
    from lightning_hetermoe.profile import make_timer

    fp16, fp32, tf32 = CostModel(precision="16-mixed"), CostModel(precision="32-true"), \
        CostModel(precision="32-true", tf32=True)
    for name in ("a40", "v100", "h100"):
        dev = get_device(name)
        # a large GEMM is compute-bound in every precision: exactly the ratio of the peaks
        gemm = {c: c.gemm_time(dev, 65536, 4096, 14336) for c in (fp16, fp32, tf32)}
        assert gemm[fp32] / gemm[fp16] == pytest.approx(dev.fp16_tflops / dev.fp32_tflops, rel=1e-9), name
        peak = dev.tf32_tflops or dev.fp32_tflops  # V100 has no TF32: fp32 either way
        assert gemm[tf32] / gemm[fp16] == pytest.approx(dev.fp16_tflops / peak, rel=1e-9), name
        # a whole expert task adds a bandwidth-bound pass (twice the bytes in fp32, not 4-8x)
        t16 = fp16.expert_time(dev, tokens=65536, d_model=4096, d_ff=14336, backward=True)
        t32 = fp32.expert_time(dev, tokens=65536, d_model=4096, d_ff=14336, backward=True)
        assert 0.9 < (t32 / t16) / (dev.fp16_tflops / dev.fp32_tflops) <= 1.0, name
    # bf16-mixed prices like fp16; fp32 moves twice the bytes
    assert CostModel(precision="bf16-mixed").expert_time(get_device("a40"), tokens=4096, d_model=1024, d_ff=3584) == \
        pytest.approx(fp16.expert_time(get_device("a40"), tokens=4096, d_model=1024, d_ff=3584))
    assert fp32.dtype_bytes == 2 * fp16.dtype_bytes
    with pytest.raises(ValueError, match="precision='fp8' is invalid"):
        CostModel(precision="fp8")
    # the step of one plan on a compute-bound mix: slower in fp32 by about the peaks' ratio
    from lightning_hetermoe import ModelConfig
    from lightning_hetermoe.cluster import LinkConfig
    from lightning_hetermoe.simulate import simulate_plan

    model = ModelConfig(name="w1", vocab_size=32000, d_model=2048, n_layers=4, n_heads=16, max_seq_len=16384,
                        moe={"num_experts": 12, "d_ff": 7168})
    devices = [get_device("a40"), get_device("a40")]
    plan = make_plan(devices, model, seq_len=16384, global_batch_tokens=8 * 16384, cost_model=fp16)
    assert "precision 16-mixed (fp16 tensor cores)" in str(plan)
    steps = {p: simulate_plan(plan, devices, model, LinkConfig(bandwidth_gbps=1000.0), make_timer(model, 16384, cost=c),
                              keep_timeline=False).step_time for p, c in (("16-mixed", fp16), ("32-true", fp32))}
    ratio = get_device("a40").fp16_tflops / get_device("a40").fp32_tflops
    assert 0.8 * ratio < steps["32-true"] / steps["16-mixed"] <= 1.01 * ratio, (steps, ratio)
    plan32 = make_plan(devices, model, seq_len=16384, global_batch_tokens=8 * 16384, cost_model=fp32)
    assert "precision 32-true (fp32 CUDA cores)" in str(plan32)


def _paper_homogeneous(seq_len):
    """The paper's homogeneous comparison (conf/paper.yaml ``homogeneous``): HeterMoE's plan on
    2xA40+2xV100 and 4xA40, D1 with 8 experts, fp16, 1M tokens per step."""
    import os

    from omegaconf import OmegaConf

    from lightning_hetermoe.cluster import ClusterConfig
    from lightning_hetermoe.configs import ModelConfig, from_cfg
    from lightning_hetermoe.plan import make_plan

    conf = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
    model = from_cfg(ModelConfig, OmegaConf.to_container(OmegaConf.load(os.path.join(conf, "model", "d1_8e.yaml"))))
    model = dataclasses.replace(model, activation_checkpointing=True)  # as the paper trained
    plans = {}
    for name in ("a40x2_v100x2", "a40x4"):
        cluster = from_cfg(ClusterConfig, OmegaConf.to_container(OmegaConf.load(os.path.join(conf, "cluster",
                                                                                             f"{name}.yaml"))))
        plans[name] = make_plan(cluster, model, seq_len=seq_len, global_batch_tokens=1 << 20, shrink_to_fit=2,
                                cost_model=CostModel(precision="16-mixed"), max_microbatches=16,
                                ep_groups="world")  # the paper's EP: one group over the four A40s
    return plans["a40x2_v100x2"], plans["a40x4"]


@pytest.mark.slow  # computes for seconds (the quick loop stays about a minute)
def test_paper_trend_mix_against_4xa40():
    """docs/paper_trend.md. The cost terms: with V100 at ~0.8x an A40 on experts, the mix's
    throughput bound is ~(2 + 2*0.8)/4 = 0.9 of 4xA40's while the experts can absorb the
    V100s (4K-16K), and lower at 32K where attention outweighs what two A40s can carry.
    The simulated HeterMoE-on-the-mix / EP-on-4xA40 ratio falls with the sequence length
    from 4K to 32K (1.19, 1.12, 1.12, 0.93 since EP's checkpointed blocks pay their
    recompute's two exchanges; 1.07, 1.01, 1.03, 0.87 since the planner splits a step into
    waves where activations bind; 1.06, 1.00, 0.93, 0.80 before; 0.92, 0.87, 0.82, 0.74
    before every rank's experts answered a layer's micro-batches back to back): EP on 4xA40
    hides more of its fixed exchange as attention grows. The paper's 95% (arXiv 2504.03871, an average)
    is below the cells up to 16K and above 32K's: see the doc for why."""
    got = {}
    for s in (4096, 16384, 32768):
        mix, homo = _paper_homogeneous(s)
        bound = mix.bound_tokens_per_s / homo.bound_tokens_per_s
        ratio = mix.predicted["zebra"]["tokens_per_s"] / homo.predicted["ep"]["tokens_per_s"]
        got[s] = (bound, ratio)
    for s in (4096, 16384):
        assert 0.85 <= got[s][0] <= 0.93, got  # (2 + 2 * 0.8) / 4 = 0.9
    assert 0.75 <= got[32768][0] < got[16384][0] - 0.03, got
    # the simulated trend: within +-6 points of 1.19 / 1.12 / 0.93, falling with S
    assert 1.13 <= got[4096][1] <= 1.25, got
    assert 1.06 <= got[16384][1] <= 1.18, got
    assert 0.87 <= got[32768][1] <= 0.99, got
    assert got[4096][1] > got[16384][1] > got[32768][1], got


def test_paper_trend_unit_ratios_at_d1():
    """The cost terms the trend rests on, against the datasheets and the paper: a V100 expert
    pass takes ~1.25x an A40's (paper: V100 ~80% of A40; datasheet fp16 peaks 149.7 vs 125
    TFLOPS = 1.2x, bandwidth 696 vs 900 GB/s favours the V100 on the SwiGLU pass), and a V100
    attention micro-batch 2-3.7x an A40's from 4K to 32K (paper: 3.7x at 64K)."""
    x = expert("v100") / expert("a40")
    assert 1.15 <= x <= 1.40, x
    a = {s: attn("v100", s) / attn("a40", s) for s in (4096, 8192, 16384, 32768)}
    assert 2.0 <= a[4096] < a[8192] < a[16384] < a[32768] <= 3.7, a


@pytest.mark.parametrize("activation, gated", [("swiglu", True), ("swiglu", False), ("gelu", True)])
def test_the_attention_task_prices_the_shared_expert_as_the_layer_computes_it(activation, gated):
    """A shared expert (every token's dense MLP, Qwen2-MoE's gated or DeepSeek's ungated) runs
    where attention runs, before the dispatch: the attention task's price grows by its FLOPs,
    forward and backward, as torch's FLOP counter counts them on the layer's own module
    (a device whose bandwidth never binds and whose launches are free prices FLOPs alone)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from lightning_hetermoe.cluster.devices import DeviceSpec
    from lightning_hetermoe.moe.layer import SharedExpert

    dev = DeviceSpec(name="flops only", memory_gb=80, fp16_tflops=100, mem_bw_gbps=1e15, flash_attention=True,
                     launch_overhead_s=0.0)
    cm = CostModel(activation_checkpointing=False)
    rate = cm._peak(dev) * dev.gemm_efficiency
    tokens, d, ff = 96, 64, 48
    module = SharedExpert(d, ff, activation, bias=False, gated=gated)
    x = torch.randn(tokens, d, requires_grad=True)
    with FlopCounterMode(display=False) as fwd:
        y = module(x)
    with FlopCounterMode(display=False) as bwd:
        y.sum().backward()

    def priced(backward, shared):
        kw = dict(shared_d_ff=ff, shared_activation=activation, shared_gate=gated) if shared else {}
        return cm.attention_time(dev, tokens=tokens, seq_len=32, d_model=d, n_heads=4, backward=backward, **kw)

    assert (priced(False, True) - priced(False, False)) * rate == pytest.approx(fwd.get_total_flops(), rel=1e-6)
    assert (priced(True, True) - priced(True, False)) * rate == pytest.approx(bwd.get_total_flops(), rel=1e-6)


def test_a_model_with_a_shared_expert_plans_its_attention_with_it():
    """The planner's timer passes the model's shared expert to the attention task (the
    profiler's measured attention already ran it: a real block with its experts skipped)."""
    from lightning_hetermoe.configs import ModelConfig, MoEConfig
    from lightning_hetermoe.profile.timer import CostModelTimer

    plain = ModelConfig(d_model=256, n_layers=2, n_heads=4, moe=MoEConfig(num_experts=8, top_k=2, d_ff=128))
    shared = dataclasses.replace(plain, moe=dataclasses.replace(plain.moe, shared_expert_d_ff=512,
                                                                 shared_expert_gate=False))
    a40 = get_device("a40")
    for backward in (False, True):
        timer = CostModelTimer(shared, 128)
        got = timer.attention(a40, 4096, backward)
        assert got == timer.cost.attention_time(a40, tokens=4096, seq_len=128, d_model=256, n_heads=4, num_experts=8,
                                                backward=backward, shared_d_ff=512, shared_gate=False)
        assert got > CostModelTimer(plain, 128).attention(a40, 4096, backward)
