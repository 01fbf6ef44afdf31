"""The stand-in device (``lightning_hetermoe.standin``, ``HETERMOE_STANDIN=1``): CPU runs whose
compute device is not the host, so that a host tensor on device traffic fails on CPU as it
would on NCCL; and the runtime clean under it in every mode (equal to one process)."""

from __future__ import annotations

import copy
import os
import threading

import lightning as L
import pytest
import torch

from harness import run_ranks
from lightning_hetermoe import HeterMoEStrategy, comm, standin


def standin_semantics(rank: int) -> bool:
    device = standin.enable()
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 4, generator=g), torch.randn(4, 3, generator=g)
    x, w = a.to(device).requires_grad_(), b.to(device).requires_grad_()
    y = (x @ w).relu().sum()
    assert y.device == device and torch.equal(y.cpu(), (a @ b).relu().sum())
    threads: list[str] = []
    x.register_hook(lambda grad: threads.append(threading.current_thread().name))
    y.backward()
    ref_a, ref_b = a.clone().requires_grad_(), b.clone().requires_grad_()
    (ref_a @ ref_b).relu().sum().backward()
    assert torch.equal(x.grad.cpu(), ref_a.grad) and torch.equal(w.grad.cpu(), ref_b.grad)
    assert threads and threads[0] != threading.current_thread().name  # a device thread, as CUDA's
    # factories, host copies, host scalars
    assert torch.tensor([1, 2], device=device).device == device and torch.arange(3, device=device).device == device
    assert x.detach().cpu().device.type == "cpu" and (x * torch.tensor(2.0)).device == device
    with pytest.raises(RuntimeError, match="same device"):
        x + torch.ones(5, 4)
    # what gloo is handed is the memory itself
    z = torch.zeros(3, device=device)
    standin.host_view(z).add_(1)
    assert z.cpu().tolist() == [1.0, 1.0, 1.0]
    return True


def new_data(rank: int) -> bool:
    """``p.data = new`` (how zebra empties the dense weights of an expert rank, how
    ``Module.double()`` converts): every later op on ``p`` sees ``new``. Missed, an emptied
    parameter still detached to its old values and an expert rank wrote its initial dense
    weights into a sharded checkpoint, over the attention rank's trained ones. A deep copy
    (torch sets a copied storage into an empty tensor, the same C++ swap) keeps the shapes."""
    device = standin.enable()
    p = torch.nn.Parameter(torch.arange(4.0).to(device))
    p.data = torch.empty(0, device=device)
    assert p.detach().shape == (0,) and p.data.shape == (0,) and standin.host_view(p).numel() == 0
    p.data = torch.full((3,), 2.0, device=device)
    assert p.detach().cpu().tolist() == [2.0] * 3 and (p * 2).cpu().tolist() == [4.0] * 3
    p.data.mul_(3)  # writes p, as on a GPU
    assert p.cpu().tolist() == [6.0] * 3
    linear = torch.nn.Linear(3, 2).to(device).double()
    assert linear.weight.detach().dtype == torch.float64
    assert linear(torch.ones(1, 3, dtype=torch.float64, device=device)).dtype == torch.float64
    # a module's deep copy (a weight average's, Lightning's AveragedModel): its own parameters,
    # of the same shapes and values (they were all shape [], the storage set into an empty one)
    copied = copy.deepcopy(linear)
    assert isinstance(copied.weight, torch.nn.Parameter) and copied.weight.requires_grad
    assert copied.weight.shape == (2, 3) and copied.weight.device == device
    assert torch.equal(copied.weight.cpu(), linear.weight.cpu())
    copied.weight.data.add_(1)
    assert not torch.equal(copied.weight.cpu(), linear.weight.cpu())
    return True


# Each in a fresh process: autograd sizes its per-device queues when the process's first
# backward starts, so the stand-in must be registered before any backward (as the strategy
# does, at set-up); in pytest's own process other tests ran backward first.
@pytest.mark.slow
def test_standin_tensors_compute_as_the_cpu_and_refuse_host_tensors_as_cuda_does():
    assert run_ranks(1, standin_semantics) == [True]


@pytest.mark.slow
def test_a_parameter_given_new_data_computes_and_saves_with_it_as_on_a_gpu():
    assert run_ranks(1, new_data) == [True]


def collectives_on_the_standin(rank: int, world: int) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    device = standin.enable()
    comm.configure(device)
    group = comm.world()
    t = torch.full((3,), float(rank + 1), device=device)
    comm.all_reduce(group, t, what="test.sum")
    out = torch.empty(world * 2, device=device)
    comm.all_gather_into(group, out, torch.full((2,), float(rank), device=device), what="test.gather")
    errors = {}
    for name, call in {
        "host tensor on device traffic": lambda: comm.all_reduce(group, torch.ones(3), what="test.host_on_device"),
        "device tensor on host traffic": lambda: comm.host_all_reduce(comm.new_group("h", range(world), device=False,
                                                                                     host=True),
                                                                      torch.ones(3, device=device),
                                                                      what="test.device_on_host"),
    }.items():
        try:
            call()
        except comm.CommError as e:
            errors[name] = str(e)
    # a host sum over one member is its own tensor, with no round trip, recorded as any other
    solos = [comm.new_group(f"solo{r}", [r], device=False, host=True) for r in range(world)]
    mine = torch.full((2,), float(rank + 5))
    with comm.record() as calls:
        pending = comm.host_all_reduce(solos[rank], mine, what="test.solo", async_op=True)
    solo = {"done_at_once": pending.completed and pending.work is None, "sum": pending.wait().tolist(),
            "same_tensor": pending.wait() is mine, "recorded": [(c.group, c.what) for c in calls]}
    comm.forget()
    return {"sum": t.cpu().tolist(), "gathered": out.cpu().tolist(), "device": str(t.device), "errors": errors,
            "solo": solo}


@pytest.mark.slow
def test_comm_carries_standin_tensors_on_gloo_and_names_a_host_tensor_on_device_traffic():
    """Stand-in tensors travel over gloo, a tensor on the wrong side is named; and a host sum
    over a group of one is its member's own tensor, done at once and recorded."""
    results = run_ranks(2, collectives_on_the_standin, 2)
    for got in results:
        assert got["device"] == "standin:0"
        assert got["sum"] == [3.0, 3.0, 3.0] and got["gathered"] == [0.0, 0.0, 1.0, 1.0]
        assert "test.host_on_device" in got["errors"]["host tensor on device traffic"]
        assert "on cpu" in got["errors"]["host tensor on device traffic"]
        assert "test.device_on_host" in got["errors"]["device tensor on host traffic"]
    for rank, got in enumerate(results):
        assert got["solo"] == {"done_at_once": True, "sum": [rank + 5.0] * 2, "same_tensor": True,
                               "recorded": [(f"solo{rank}", "test.solo")]}, got["solo"]


class LogsANumber(L.Callback):
    """Notes the device the model computed on."""

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.device = str(next(pl_module.parameters()).device)


def fit_logging_a_number(rank: int, world: int, use_standin: bool, replay_on_cpu: bool) -> dict:
    """A zebra fit whose step logs a Python float with ``sync_dist=True``; ``replay_on_cpu``
    puts item 5's bug back (the replay on the CPU instead of the module's device)."""
    from helpers_zebra import make_test_plan

    from lightning_hetermoe.strategy.backends.zebra import logs
    from reference import data, make_model, trainer

    if use_standin:
        os.environ[standin.ENV] = "1"
    original = logs._reduce
    if replay_on_cpu:
        logs._reduce = lambda name, calls, sizes, tokens, device: original(name, calls, sizes, tokens,
                                                                            torch.device("cpu"))
    model = make_model(4)
    step = type(model).training_step

    def training_step(self, batch, batch_idx):
        self.log("a_number", 0.5, sync_dist=True)
        return step(self, batch, batch_idx)

    model.training_step = training_step.__get__(model)
    seen = LogsANumber()
    try:
        trainer(HeterMoEStrategy(mode="zebra", plan=make_test_plan(world, [0], R=2)), world, max_steps=1,
                callbacks=[seen]).fit(model, datamodule=data(world))
        return {"device": seen.device if rank == 0 else None}
    finally:
        logs._reduce = original
        os.environ.pop(standin.ENV, None)


@pytest.mark.slow
def test_a_sync_dist_number_replayed_on_the_cpu_fails_on_the_standin_naming_the_call():
    """Item 5's bug put back: on a plain CPU run nothing can see it; on the stand-in the
    attention rank's reduce names the call, as NCCL would refuse it on the first GPU. The
    fixed replay runs clean on the stand-in."""
    plain = run_ranks(2, fit_logging_a_number, 2, False, True)
    assert plain[0]["device"] == "cpu"
    with pytest.raises(RuntimeError) as caught:
        run_ranks(2, fit_logging_a_number, 2, True, True)
    message = str(caught.value)
    assert "CommError: strategy.reduce (self.log with sync_dist=True)" in message, message[-3000:]
    assert "got a tensor on cpu; the compute device is standin:0" in message
    fixed = run_ranks(2, fit_logging_a_number, 2, True, False)
    assert fixed[0]["device"] == "standin:0"


# The equivalence tests that run on the stand-in (``@pytest.mark.standin``: conftest sets
# HETERMOE_STANDIN for them, the harness forwards it to every rank and fails a run whose
# ranks never computed there): ep with ZeRO, clipping, accumulation, replicas and the speed
# split; zebra with R = 1, 2, 3 and validation; distep; data-centric; each equal to one
# process, as on the CPU. They run there instead of twice (once on the CPU, once in a pytest
# of their own on the stand-in, 63-89 s of the suite): every assertion holds on both.
EQUIVALENCE_ON_THE_STANDIN = [
    "tests/test_zebra.py::test_one_attention_one_expert_rank_zebra_distep_and_ep_agree",
    "tests/test_zebra.py::test_three_ranks_two_attention_and_asym_ea_experts_on_the_attention_rank",
    "tests/test_equivalence.py::test_distributed_equals_single_process_at_default_settings[2]",
    "tests/test_datacentric.py::test_three_ranks_unequal_shares_equal_one_process_with_two_layers_of_experts_alive_at_most",
]


def _marked_standin(nodeid: str) -> bool:
    """Whether the test (a parametrized case: its own marks too) carries ``standin``."""
    import importlib

    path, name = nodeid.split("::")
    fn = getattr(importlib.import_module(os.path.basename(path)[:-3]), name.split("[")[0])
    marks = list(getattr(fn, "pytestmark", []))
    case = name[len(name.split("[")[0]):]
    for m in marks:
        if m.name == "parametrize" and case:
            marks += [x for value in m.args[1] if f"[{getattr(value, 'values', (value,))[0]}]" == case
                      for x in getattr(value, "marks", ())]
    return any(m.name == "standin" for m in marks)


def test_the_equivalence_tests_of_every_mode_run_on_the_standin():
    """The runtime is clean on the stand-in in every mode (ep, zebra, distep, data-centric):
    no host tensor on device traffic, no op mixing host and device tensors. The tests above
    carry the mark that runs them there."""
    unmarked = [n for n in EQUIVALENCE_ON_THE_STANDIN if not _marked_standin(n)]
    assert not unmarked, unmarked
