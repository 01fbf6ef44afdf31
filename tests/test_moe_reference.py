"""Every router and the MoE layer against the naive per-token reference: output, auxiliary
losses and every gradient, in fp32."""

import math

import pytest
import torch

from helpers_moe import assert_close, check
from lightning_hetermoe.configs import MoEConfig
from lightning_hetermoe.moe import MoELayer, apply_capacity, expert_capacity

ROUTER_CASES = [
    ("topk", 1), ("topk", 2), ("topk", 5), ("switch", 1), ("gshard", 2), ("noisy_topk", 2), ("noisy_topk", 3),
]


@pytest.mark.parametrize("router,top_k", ROUTER_CASES)
@pytest.mark.parametrize("capacity_factor", [0.0, 0.6])
@pytest.mark.parametrize("activation,bias", [("swiglu", False), ("gelu", True)])
def test_layer_matches_reference(router, top_k, capacity_factor, activation, bias):
    cfg = MoEConfig(num_experts=5, top_k=top_k, d_ff=9, router=router, capacity_factor=capacity_factor,
                    activation=activation, bias=bias, jitter_eps=0.1)
    _, aux = check(cfg)
    if capacity_factor > 0 and router != "gshard":
        assert aux.dropped > 0, "the capacity case must actually drop something"


def test_eval_mode_is_deterministic_and_matches_reference():
    cfg = MoEConfig(num_experts=4, top_k=2, d_ff=6, router="noisy_topk")
    check(cfg, train=False)


def test_expert_with_no_tokens():
    def pin_router(layer):
        layer.router.weight.zero_()
        layer.router.weight[2, 0] = 50.0  # x0 > 0 -> expert 2, else expert 4
        layer.router.weight[4, 0] = -50.0

    cfg = MoEConfig(num_experts=6, top_k=1, d_ff=5, router="topk")
    layer, aux = check(cfg, d_model=4, tokens=9, prepare=pin_router)
    idle = [0, 1, 3, 5]
    assert (aux.tokens_per_expert[idle] == 0).all()
    assert aux.tokens_per_expert.sum() == 9


def test_one_expert_equals_dense_mlp():
    cfg = MoEConfig(num_experts=1, top_k=1, d_ff=11, router="topk", activation="gelu", bias=True)
    torch.manual_seed(0)
    layer = MoELayer(6, cfg)
    x = torch.randn(10, 6)
    y, _ = layer(x)
    ex = layer.experts
    dense = torch.nn.functional.gelu(x @ ex.w_up[0] + ex.b_up[0]) @ ex.w_down[0] + ex.b_down[0]
    assert_close(y, dense, "single expert vs dense MLP")


def test_dropless_equals_large_capacity():
    base = dict(num_experts=4, top_k=2, d_ff=8, router="topk")
    torch.manual_seed(0)
    dropless = MoELayer(5, MoEConfig(**base))
    big = MoELayer(5, MoEConfig(**base, capacity_factor=4.0))  # cap = all tokens: nothing can drop
    big.load_state_dict(dropless.state_dict())
    x = torch.randn(17, 5)
    y1, a1 = dropless(x)
    y2, a2 = big(x)
    assert a2.dropped == 0
    assert torch.equal(y1, y2)


def test_capacity_policy_is_first_choice_then_token_order():
    # 4 tokens all choose expert 0 first and expert 1 second; capacity 2 per expert.
    idx = torch.tensor([[0, 1]] * 4)
    keep = torch.ones(4, 2, dtype=torch.bool)
    cf = 2 / (4 * 2 / 2)  # cap = ceil(cf * T * k / E) = 2
    assert expert_capacity(4, 2, 2, cf) == 2
    out = apply_capacity(idx, keep, 2, cf)
    assert out[:, 0].tolist() == [True, True, False, False]
    assert out[:, 1].tolist() == [True, True, False, False]
    # first choices get priority over earlier tokens' second choices
    idx2 = torch.tensor([[1, 0], [0, 1], [0, 1]])
    out2 = apply_capacity(idx2, torch.ones(3, 2, dtype=torch.bool), 2, 1 / 3)  # cap = 1
    assert out2.tolist() == [[True, False], [True, False], [False, False]]


def test_capacity_size_formula():
    assert expert_capacity(10, 2, 4, 1.0) == 5
    assert expert_capacity(10, 2, 4, 1.25) == math.ceil(1.25 * 5)


@pytest.mark.parametrize("field,value,match", [
    ("top_k", 9, "top_k"), ("top_k", 0, "top_k"), ("num_experts", 0, "num_experts"),
    ("capacity_factor", -1.0, "capacity_factor"), ("router", "hash", "router"),
    ("activation", "relu", "activation"), ("expert_backend", "cuda", "expert_backend"),
])
def test_bad_moe_config(field, value, match):
    kwargs = dict(num_experts=4, top_k=2)
    kwargs[field] = value
    with pytest.raises(ValueError, match=match):
        MoEConfig(**kwargs)


def test_router_specific_top_k_is_enforced():
    with pytest.raises(ValueError, match="switch"):
        MoEConfig(router="switch", top_k=2)
    with pytest.raises(ValueError, match="gshard"):
        MoEConfig(router="gshard", top_k=1)


def test_the_sync_free_sort_equals_a_naive_sort():
    """The dispatch sorts every choice with the dropped ones last and takes the kept count it
    read on the host (its one sync): the same slots, tokens and counts as a loop over the
    choices."""
    from lightning_hetermoe.moe.dispatch import position_counts, sort_by_position

    g = torch.Generator().manual_seed(3)
    for T, k, P in ((17, 2, 5), (64, 4, 9), (1, 1, 3)):
        position = torch.randint(0, P, (T, k), generator=g)
        keep = torch.rand(T, k, generator=g) > 0.3
        counts = position_counts(position, keep, P)
        b = sort_by_position(position, keep, P, kept=int(counts.sum()), counts=counts)
        slots, naive_counts = _naive_sort(position, keep, P)
        assert b.slot.tolist() == slots and b.token.tolist() == [s // k for s in slots]
        assert b.counts.tolist() == naive_counts
        assert int(b.counts.sum()) == int(keep.sum())


def _naive_sort(position: torch.Tensor, keep: torch.Tensor, P: int) -> tuple[list[int], list[int]]:
    """Kept choices grouped by position, token order within each, by a loop over Python lists."""
    flat, live = position.reshape(-1).tolist(), keep.reshape(-1).tolist()
    slots = [i for p in range(P) for i in range(len(flat)) if live[i] and flat[i] == p]
    return slots, [sum(1 for i in range(len(flat)) if live[i] and flat[i] == p) for p in range(P)]


def test_sort_choices_equals_a_naive_sort_with_its_one_host_copy():
    """The local and data-centric dispatch (``sort_choices``): counts copied to the host once,
    then a fixed-size sort that takes that many; the same slots, tokens and counts as a
    loop over the choices."""
    from lightning_hetermoe.moe.dispatch import sort_choices

    g = torch.Generator().manual_seed(5)
    for T, k, E in ((23, 2, 6), (64, 4, 9), (1, 1, 3), (5, 2, 8)):
        indices = torch.randint(0, E, (T, k), generator=g)
        keep = torch.rand(T, k, generator=g) > 0.25
        layout = torch.randperm(E, generator=g)  # expert e sits at position layout[e]
        sc = sort_choices(indices, keep, layout)
        slots, counts = _naive_sort(layout[indices], keep, E)
        assert sc.counts.device.type == "cpu" and sc.counts.tolist() == counts
        assert sc.slot.tolist() == slots and sc.token.tolist() == [s // k for s in slots]


def test_one_hot_equals_torchs():
    from lightning_hetermoe.moe.dispatch import one_hot

    idx = torch.randint(0, 7, (5, 3), generator=torch.Generator().manual_seed(0))
    assert torch.equal(one_hot(idx, 7), torch.nn.functional.one_hot(idx, 7))


# ops that read a device tensor on the host (a sync on CUDA) wherever they run
_SYNCING = {"nonzero", "bincount", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
            "unique_consecutive", "argwhere", "is_nonzero", "masked_scatter"}


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Every op of the training path that would wait for the device on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []
        self.scalar_reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _SYNCING:
            self.found.append(name)
        elif name == "repeat_interleave" and kwargs.get("output_size") is None:
            self.found.append("repeat_interleave without output_size")
        elif name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
            self.found.append("boolean-mask indexing")
        elif name == "_local_scalar_dense":
            self.scalar_reads += 1
        return func(*args, **kwargs)


@pytest.mark.parametrize("router,backend", [("topk", "torch"), ("gshard", "grouped_mm"), ("switch", "torch")])
def test_the_moe_layers_training_path_reads_the_device_once(router, backend):
    """A training forward and backward of the layer on its local dispatcher (router, capacity,
    sort, experts, balance and z losses, counts): no op that syncs the host (nonzero,
    bincount, boolean masks, unique, repeat_interleave without its size), and one scalar
    read: the kept count of the dispatch's one host copy."""
    top_k = 1 if router == "switch" else 2
    cfg = MoEConfig(num_experts=5, top_k=top_k, d_ff=16, router=router, capacity_factor=1.25,
                    expert_backend=backend)
    torch.manual_seed(0)
    layer = MoELayer(8, cfg).train()
    x = torch.randn(19, 8, requires_grad=True)
    with _HostReads() as reads:
        y, aux = layer(x)
        (y.square().sum() + aux.balance_loss + aux.z_loss).backward()
    assert reads.found == [] and reads.scalar_reads == 1, (reads.found, reads.scalar_reads)
