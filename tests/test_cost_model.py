"""The cost model must reproduce the HeterMoE paper's measured ratios within +-20%."""

import pytest

from lightning_hetermoe.cluster import LinkConfig, get_device
from lightning_hetermoe.profile import CostModel

CM = CostModel()
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
