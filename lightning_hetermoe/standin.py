"""A stand-in compute device for CPU runs, so that device traffic is not host memory.

On a machine without a GPU the compute device and the host are one: a host tensor handed
to a device collective looks right on CPU and fails on the first GPU (NCCL: "No backend
type associated with device type cpu"). The stand-in is a device of its own,
``standin:0``: PyTorch's PrivateUse1 key set up as a Python backend
(``torch.utils.backend_registration._setup_privateuseone_for_python_backend``), whose
tensors (:class:`StandInTensor`) hold CPU memory and compute with the CPU's kernels but
report ``standin:0`` as their device. An op that mixes one with a CPU tensor of more than
0 dimensions raises, as CUDA does; ``.cpu()``, ``.to("cpu")`` and ``.item()`` leave it as on
a GPU; autograd runs its backward on a device thread of its own, as for CUDA; and
``comm``'s device/host check sees a CPU tensor on device traffic for what it is. Gloo takes
CPU tensors only: :func:`host_view` is what ``comm`` hands it.

Turned on by ``HETERMOE_STANDIN=1`` in the environment of a CPU run: the strategy then
computes on ``standin:0`` (:func:`requested`). Every op goes through Python, so a step is
several times slower: a check for tests, not a way to train.

Every op passing through Python also lets the stand-in see the host syncs a GPU would
make, on CPU: inside :func:`counting_syncs` each read of device values by the host
(``.item()``, ``bool()``, ``.tolist()``, ``.cpu()``, a copy into a host tensor, an op whose
output size depends on the values, as ``nonzero`` or a boolean mask) and each blocking copy
from the host to the device (``torch.tensor(list, device=...)`` among them) is noted with
the file:line that asked for it, as CUDA's sync debug mode warns for each.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import sys
import threading
from typing import Any, Iterator, NamedTuple

import torch
from torch.utils._pytree import tree_map

NAME = "standin"
ENV = "HETERMOE_STANDIN"
_CPU = torch.device("cpu")
DEVICE: torch.device = _CPU  # standin:0 once enabled
_library: Any = None
_factories: Any = None
_OUT_FILLED = ("arange.default", "arange.start", "arange.start_step", "linspace.default", "logspace.default",
               "range.default", "range.step", "eye.default", "eye.m", "randperm.default", "randperm.generator")

# ops that move values between devices, or index a device tensor with host indices (CUDA
# takes both); every other op mixing the stand-in with CPU tensors raises
_CROSSING = {"copy_", "_copy_from", "_copy_from_and_resize", "_to_copy", "index", "index_put", "index_put_",
             "_index_put_impl_", "lift_fresh", "lift_fresh_copy", "detach", "alias"}


# what a GPU must wait for, by the host-side kind noted (see :func:`counting_syncs`)
READS = ("item", "tolist", "to_host", "value_sized")  # device -> host: the host waits for the stream
COPIES = ("h2d_list", "h2d")  # blocking host -> device copies (from a Python list; from a host tensor)
# ops whose output size depends on the values (CUDA reads a count or min/max on the host)
_VALUE_SIZED = {"nonzero", "masked_select", "_unique", "_unique2", "unique_dim", "unique_consecutive",
                "unique_dim_consecutive", "bincount", "equal", "histc"}


class Sync(NamedTuple):
    """One host sync: its kind (:data:`READS`, :data:`COPIES`), the op, and where the code
    outside torch asked for it (innermost first: file:line of each caller, up to four)."""

    kind: str
    where: str
    op: str
    callers: tuple[str, ...]


_syncs: list[Sync] | None = None  # where syncs are noted, while counting
_quiet = threading.local()  # a sync noted once, not again for the copy inside it
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_HERE = os.path.abspath(__file__)


@contextlib.contextmanager
def counting_syncs() -> Iterator[list[Sync]]:
    """Note every host sync the stand-in sees while inside (every thread: zebra's fibers and
    the autograd device thread too): ``with counting_syncs() as syncs: ...``, then
    ``syncs`` holds a :class:`Sync` (kind, where, op, callers) for each. Off outside, so a
    stand-in run pays nothing for it."""
    global _syncs
    outer, _syncs = _syncs, []
    try:
        yield _syncs
    finally:
        _syncs = outer


def _note(kind: str, op: str) -> None:
    syncs = _syncs
    if syncs is None or getattr(_quiet, "on", False):
        return
    frame, callers = sys._getframe(1), []
    while frame is not None and len(callers) < 4:
        name = os.path.abspath(frame.f_code.co_filename)
        if not name.startswith(_TORCH_DIR) and name != _HERE and not name.endswith(os.sep + "contextlib.py"):
            callers.append(f"{short_path(name)}:{frame.f_lineno}")
        frame = frame.f_back
    if not callers:  # a C++ thread with no Python above it (autograd's device thread)
        callers = [f"<{threading.current_thread().name}: no Python caller>"]
    syncs.append(Sync(kind, callers[0], op, tuple(callers)))


def short_path(path: str) -> str:
    """A source path from its package down (``lightning/pytorch/...``,
    ``lightning_hetermoe/...``), as :class:`Sync` names callers."""
    path = os.path.abspath(path)
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if marker in path:
            return path.split(marker, 1)[1].replace(os.sep, "/")
    ours = os.path.dirname(os.path.dirname(_HERE)) + os.sep
    if path.startswith(ours):
        return os.path.relpath(path, ours).replace(os.sep, "/")
    return "/".join(path.split(os.sep)[-3:])


def _note_op(name: str, args: tuple, kwargs: dict) -> None:
    """The sync the op ``name`` is on a GPU, if any."""
    if name == "_local_scalar_dense":
        _note("item", name)
    elif name == "_to_copy":
        target = kwargs.get("device")
        if target is not None and torch.device(target).type == "cpu" and isinstance(args[0], StandInTensor):
            _note("to_host", name)
    elif name == "copy_":
        dst, src = args[0], args[1]
        blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        if isinstance(src, StandInTensor) and not isinstance(dst, StandInTensor):
            _note("to_host", name)
        elif isinstance(dst, StandInTensor) and not isinstance(src, StandInTensor) and blocking:
            _note("h2d", name)
    elif name in _VALUE_SIZED:
        _note("value_sized", name)
    elif name == "repeat_interleave" and kwargs.get("output_size") is None and isinstance(args[0], StandInTensor):
        _note("value_sized", name)
    elif name in ("index", "index_put", "index_put_", "_index_put_impl_") and _bool_index(args):
        if not (name != "index" and len(args[1]) == 1 and args[2].numel() == 1):  # CUDA: masked_fill_
            _note("value_sized", f"{name} (boolean mask)")


def _bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


class _Module:
    """``torch.standin``: what torch asks of a device module (autocast asks for its dtypes;
    no autocast policy is registered for the stand-in, so under mixed precision its ops
    run in their own dtypes)."""

    def is_initialized(self) -> bool:
        return True

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed_all(self, seed: int) -> None:
        pass  # its random numbers are the CPU generator's

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    # one stream, in order with the host (what checkpoint writers ask of a device)
    def current_stream(self, device: Any = None) -> "_Stream":
        return _STREAM

    def stream(self, stream: Any) -> Any:
        return contextlib.nullcontext()

    def synchronize(self, device: Any = None) -> None:
        pass


class _Stream:
    def wait_stream(self, other: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_STREAM = _Stream()


def requested() -> bool:
    """``HETERMOE_STANDIN`` asks CPU runs to compute on the stand-in device."""
    return os.environ.get(ENV, "") not in ("", "0")


def enable() -> torch.device:
    """Register the stand-in device in this process (once) and return it. Before the
    process's first backward: autograd sizes its per-device queues then, and a device
    registered later has none (an internal assert in the engine)."""
    global _library, DEVICE
    if _library is None:
        from torch.utils import backend_registration

        backend_registration._setup_privateuseone_for_python_backend(NAME, backend_module=_Module())
        _library = torch.library.Library("_", "IMPL")  # kept: the fallback lives as long as it does
        _library.fallback(lambda keys, op, *args, **kwargs: _run(op, args, kwargs), "PrivateUse1",
                          with_keyset=True)
        # factories whose composite fills an empty result through its out= form (a wrapper's
        # shape cannot follow that resize): run on the CPU and wrapped, as every other op
        global _factories
        _factories = torch.library.Library("aten", "IMPL")
        for name in _OUT_FILLED:
            op = torch.ops.aten
            for part in name.split("."):
                op = getattr(op, part)
            _factories.impl(name.removesuffix(".default"), functools.partial(_factory, op), "PrivateUse1")
        DEVICE = torch.device(NAME, 0)  # a name torch knows only once registered
        # torch.tensor(data, device=...) builds on a Python backend's device through a path
        # that fails (an internal assert in torch 2.13): build on the CPU, then move
        torch.tensor, torch.as_tensor = _built_then_moved(torch.tensor), _built_then_moved(torch.as_tensor)
    return DEVICE


def _factory(op: Any, *args: Any, **kwargs: Any) -> Any:
    return _run(op, args, kwargs)


def _built_then_moved(make: Any) -> Any:
    @functools.wraps(make)
    def made(data: Any, *args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        if device is not None and torch.device(device).type == NAME:
            if _syncs is None or isinstance(data, torch.Tensor):
                return make(data, *args, **kwargs).to(DEVICE)
            # on a GPU: the values are laid out in pageable host memory, then copied over
            # while the host waits (a sync, per call)
            _note("h2d_list", make.__name__)
            _quiet.on = True
            try:
                return make(data, *args, **kwargs).to(DEVICE)
            finally:
                _quiet.on = False
        return make(data, *args, device=device, **kwargs)
    return made


def is_standin(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == NAME


def host_view(t: torch.Tensor) -> torch.Tensor:
    """The CPU memory a stand-in tensor holds (the tensor itself otherwise): what gloo gets.
    Writing into it writes the stand-in tensor."""
    return t.inner if isinstance(t, StandInTensor) else t


class StandInTensor(torch.Tensor):
    """A tensor on ``standin:0`` around the CPU tensor that holds its values."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> "StandInTensor":
        out = torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(),
                                                  storage_offset=inner.storage_offset(), dtype=inner.dtype,
                                                  device=DEVICE, requires_grad=False)
        out.inner = inner
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return _run(func, args, kwargs or {})

    # ``p.data = new`` is no op the dispatcher sees: torch swaps the tensor's C++ shape and
    # storage only. A wrapper's values live in ``inner``, so it must follow, or every later
    # op on ``p`` computes with the old memory while ``p.shape`` reports the new (a
    # parameter emptied this way saved its old values, and was not empty to ``detach``).
    @property
    def data(self) -> torch.Tensor:
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        torch._C.TensorBase.data.__set__(self, new)
        self.inner = host_view(new)

    # torch's deepcopy of a tensor with storage sets a copied storage into a new empty one,
    # whose C++ shape a wrapper does not follow (a copied module's weights were all shape
    # []): a copy is a wrapper around a copy of the values, as ``clone`` makes, with the
    # tensor's flags and attributes (a parameter stays one)
    def __deepcopy__(self, memo: dict) -> "StandInTensor":
        if id(self) in memo:
            return memo[id(self)]
        out = StandInTensor(copy.deepcopy(self.inner, memo))
        if self.requires_grad:
            out.requires_grad_()
        if self.grad is not None:
            out.grad = copy.deepcopy(self.grad, memo)
        out.__dict__.update({k: copy.deepcopy(v, memo) for k, v in self.__dict__.items() if k != "inner"})
        memo[id(self)] = out
        return out

    def tolist(self) -> Any:  # as on a GPU: read from the device (a sync there)
        if _syncs is not None:
            _note("tolist", "tolist")
        return self.inner.tolist()

    # the memory it holds, as a device tensor has some (views share it)
    def untyped_storage(self) -> Any:
        return self.inner.untyped_storage()

    def data_ptr(self) -> int:
        return self.inner.data_ptr()

    def __repr__(self) -> str:
        return f"StandInTensor({self.inner!r})"


def _run(func: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``func`` on the CPU tensors the stand-in tensors hold; results stay on the
    stand-in unless the op asked for the CPU (``.cpu()``, ``.to("cpu")``)."""
    name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
    if _syncs is not None:
        _note_op(name, args, kwargs)
    originals: dict[int, Any] = {}  # every tensor the op was given, by the id of what it runs on

    def unwrap(x: Any) -> Any:
        if isinstance(x, StandInTensor):
            originals[id(x.inner)] = x
            return x.inner
        if isinstance(x, torch.Tensor):
            originals[id(x)] = x
        if isinstance(x, torch.device) and x.type == NAME:
            return _CPU
        return x

    host_args, host_kwargs = _map(unwrap, args), _map(unwrap, kwargs)
    _check_devices(func, name, list(originals.values()))
    out = func(*host_args, **host_kwargs)
    target = kwargs.get("device")
    to_host = target is not None and torch.device(target).type == "cpu"

    def wrap(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) in originals:  # in place, or an out= argument: the tensor it was given
            given = originals[id(x)]
            if isinstance(given, StandInTensor) and (given.shape != x.shape or given.stride() != x.stride()):
                return StandInTensor(x)  # resized (an out= filled by a composite): its new shape
            return given
        return x if to_host or isinstance(x, StandInTensor) else StandInTensor(x)

    return _map(wrap, out)


def _map(fn: Any, x: Any) -> Any:
    """``tree_map`` over what an op takes and returns: its plain tuples, lists and dicts
    walked here, since torch's general pytree was most of a stand-in op's cost; any other
    container (a named tuple of results) goes to torch's."""
    kind = type(x)
    if kind is tuple or kind is list:
        return kind(_map(fn, y) for y in x)
    if kind is dict:
        return {k: _map(fn, v) for k, v in x.items()}
    if isinstance(x, (tuple, list, dict)):
        return tree_map(fn, x)
    return fn(x)


def _check_devices(func: Any, name: str, tensors: list[torch.Tensor]) -> None:
    """``tensors``: those ``func`` (its op's ``name``) was given."""
    if name in _CROSSING:
        return
    if not any(isinstance(t, StandInTensor) for t in tensors):
        return
    host = [t for t in tensors if not isinstance(t, StandInTensor) and t.device.type == "cpu" and t.dim() > 0]
    if host:
        raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                           f"{DEVICE} and cpu! (in {func}: a host tensor of shape {tuple(host[0].shape)} beside "
                           f"the compute device's; on a GPU this op fails the same way)")

