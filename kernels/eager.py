"""Eager calls take the kernels' implementations directly; ``torch.compile`` sees the ops.

Every kernel of this package is a ``torch.library.custom_op`` (forward, backward and a
shape-only fake), so that ``torch.compile`` traces each as one opaque node. Called eagerly,
though, a custom op runs its body behind several Python layers: ``CustomOpDef.__call__``,
the dispatcher, a Python autograd kernel, a redispatch and a ``torch._dynamo`` disable
wrapper. ``bench/op_overhead.py`` on this project's 2-core CPU machine, forward and
backward at 64 rows: a one-multiply op 79.8 us a call through the op, 51.0 us eagerly; the
``grouped_mm`` expert MLP 666 us against 518. A step of issue #38's model on one H200
makes about a hundred such calls, on a host that bounds the step (its device was busy 54
ms of the step's 83). So an eager call goes through :func:`differentiable` (an
``autograd.Function`` with the op's own ``setup_context`` and backward) or :func:`direct`
(the body itself), and only a call inside a ``torch.compile`` trace goes through the op.
Both run the same body on the same tensors: the values are the same to the bit.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch


def direct(op: Any, impl: Callable[..., Any]) -> Callable[..., Any]:
    """Call ``impl`` (the body of the custom op ``op``) eagerly, ``op`` inside a
    ``torch.compile`` trace. For ops without autograd (a backward's own kernels, or ops
    called under ``no_grad``)."""

    @functools.wraps(impl)
    def call(*args: Any) -> Any:
        if torch.compiler.is_compiling():
            return op(*args)
        return impl(*args)

    return call


def differentiable(op: Any, impl: Callable[..., Any], setup_context: Callable[..., None],
                   backward: Callable[..., Any]) -> Callable[..., Any]:
    """Call ``impl`` eagerly as an ``autograd.Function`` whose ``setup_context`` and
    ``backward`` are the ones registered on the custom op ``op`` (what ``register_autograd``
    took), ``op`` inside a ``torch.compile`` trace."""

    def forward(ctx: Any, *args: Any) -> Any:
        # ctx-style, not a separate ``setup_context`` method: torch routes a Function that
        # has one through functorch's machinery, as slow as the op (20.6 us a call here
        # against 6.2)
        out = impl(*args)
        setup_context(ctx, args, out)
        return out

    fn = type(f"{getattr(impl, '__name__', 'Op')}_function", (torch.autograd.Function,), {
        "forward": staticmethod(forward),
        "backward": staticmethod(backward),
    })

    @functools.wraps(impl)
    def call(*args: Any) -> Any:
        if torch.compiler.is_compiling():
            return op(*args)
        return fn.apply(*args)

    call.function = fn  # type: ignore[attr-defined]
    return call
