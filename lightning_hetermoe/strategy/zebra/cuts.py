"""Cut the model's autograd graph at block boundaries, per micro-batch.

Forward hooks on every MoE block replace each tensor that enters or leaves the block (and
requires grad) by a fresh leaf, and remember ``(original, leaf)``. A block's forward on a
micro-batch is then its own small graph: from the input leaves to the original outputs,
with the dispatched rows and the experts' answer (another leaf) as the cut in the middle.
The executor drives ``torch.autograd.backward`` over those graphs itself, block by block.

The hooks act only inside a zebra fiber; called anywhere else the model runs as usual.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass, replace
from typing import Any, Callable

import torch
from torch import Tensor, nn

from . import fibers


def map_tensors(obj: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """Apply ``fn`` to every tensor in tuples, lists, dicts and dataclasses."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(o, fn) for o in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if is_dataclass(obj) and not isinstance(obj, type):
        return replace(obj, **{f.name: map_tensors(getattr(obj, f.name), fn) for f in fields(obj) if f.init})
    return obj


class BlockCuts:
    """Hooks on every block; ``records`` receives ``(layer, mb) -> {"inputs": [...], "outputs": [...]}``."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        self.handles = []
        for layer, block in enumerate(blocks):
            self.handles.append(block.register_forward_pre_hook(self._pre(layer), with_kwargs=True))
            self.handles.append(block.register_forward_hook(self._post(layer), with_kwargs=True))

    @staticmethod
    def _cut(pairs: list) -> Callable[[Tensor], Tensor]:
        def cut(t: Tensor) -> Tensor:
            if not t.requires_grad:
                return t
            leaf = t.detach().requires_grad_()
            pairs.append((t, leaf))
            return leaf

        return cut

    def _pre(self, layer: int):
        def hook(module, args, kwargs):
            fiber = fibers.current()
            if fiber is None or not torch.is_grad_enabled():
                return None
            rec = fiber.owner.record(layer, fiber.mb)
            if rec.get("inputs") is not None:
                raise RuntimeError(f"block {layer} ran twice on micro-batch {fiber.mb}: the zebra executor needs "
                                   f"each MoE block called once per forward")
            rec["inputs"] = pairs = []
            cut = self._cut(pairs)
            return map_tensors(args, cut), map_tensors(kwargs, cut)

        return hook

    def _post(self, layer: int):
        def hook(module, args, kwargs, output):
            fiber = fibers.current()
            if fiber is None or not torch.is_grad_enabled():
                return None
            rec = fiber.owner.record(layer, fiber.mb)
            rec["outputs"] = pairs = []
            return map_tensors(output, self._cut(pairs))

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
