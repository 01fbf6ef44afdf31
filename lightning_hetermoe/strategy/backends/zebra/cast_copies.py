"""A micro-batch's graph keeps no 16-bit copy of a parameter: it keeps the parameter, and
its backward casts it again.

Under mixed precision a linear layer (or an expert MLP) casts its fp32 weight to the
autocast dtype and saves the cast for its backward. Autocast's cast cache is per thread
and every zebra micro-batch runs in a fiber (a thread) of its own, so each micro-batch in
flight held its own copy: R copies of every dense weight on an attention rank, and of every
expert weight a round ran on an expert rank, where one process holds one (measured on an
H200: about one bf16 copy of the weights per micro-batch, the self-check's ``memory in R``).

Saved-tensor hooks (:func:`recast_saved_weights`) replace such a saved tensor by the
parameter it was cast from (a cast of a leaf, or a view of one), and cast it again when
the backward reads it: the same values (a cast rounds the same way each time), for one
more cast of each weight per micro-batch's backward, memory-bound and small beside the
GEMMs that read it. Nothing else is touched: activations, and tensors saved inside an
activation checkpoint (whose own hooks are innermost), are saved as before. Sound because
nothing writes a parameter between a step's forwards and backwards (the optimizer steps
after them). With one micro-batch in flight (R = 1) there is one copy, as in one process,
and the backend enters no hooks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class _Recast:
    """What is saved instead of a 16-bit cast of ``param``: how to make it again."""

    __slots__ = ("param", "dtype", "view")

    def __init__(self, param: Tensor, dtype: torch.dtype, like: Tensor) -> None:
        self.param, self.dtype = param, dtype
        # a view of the cast (a linear layer's transposed weight) is rebuilt by its strides;
        # the cast itself (the experts') is the cast, with no view op
        whole = like.size() == param.size() and like.stride() == param.stride() and like.storage_offset() == 0
        self.view = None if whole else (like.size(), like.stride(), like.storage_offset())


def _cast_parameter(t: Tensor) -> Tensor | None:
    """The leaf parameter ``t`` (or the tensor ``t`` views) is a plain cast of, if any."""
    base = t._base if t._base is not None else t
    fn = base.grad_fn
    if fn is None or fn.name() != "ToCopyBackward0" or base.dtype not in (torch.bfloat16, torch.float16):
        return None
    src = fn.next_functions[0][0] if fn.next_functions else None
    param = getattr(src, "variable", None)  # AccumulateGrad: the cast's input is a leaf
    if not isinstance(param, torch.nn.Parameter) or param.dtype == base.dtype or param.shape != base.shape \
            or param.device != base.device:
        return None
    if not (param.is_contiguous() and base.is_contiguous()):  # a cast keeps the layout: rebuilt by strides
        return None
    return param


def _pack(t: Tensor) -> Any:
    param = _cast_parameter(t)
    return t if param is None else _Recast(param, t.dtype, t)


def _unpack(saved: Any) -> Tensor:
    if not isinstance(saved, _Recast):
        return saved
    # No detach (one op more per weight and micro-batch): autograd takes an unpacked tensor
    # for its values and gives it the saved cast's own place in the graph, whatever graph the
    # hook's result has (a gradient of the gradient reaches the weight either way, tested)
    cast = saved.param.to(saved.dtype)
    return cast if saved.view is None else cast.as_strided(*saved.view)


def recast_saved_weights() -> Any:
    """The hooks, as a context manager (thread-local, as every saved-tensor hook is: each
    fiber and the executor's thread enter it themselves)."""
    return torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
