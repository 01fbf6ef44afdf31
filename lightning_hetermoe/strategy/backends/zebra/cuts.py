"""Cut the model's autograd graph at block boundaries, per micro-batch.

Forward hooks on every MoE block replace each tensor that enters or leaves the block (and
requires grad) by a fresh leaf, and remember ``(original, leaf)`` in the step's
:class:`~.records.BlockRecord`. A block's forward on a micro-batch is then its own small
graph: from the input leaves to the original outputs, with the dispatched rows and the
experts' answer (another leaf) as the cut in the middle. The executor drives
``torch.autograd.backward`` over those graphs itself, block by block.

A hook on each MoE layer cuts its balance, z (and custom gate) losses the same way (kept in the record's
``aux``), so their gradient enters the block's backward whichever way the model carries
them to its loss.

The hooks also tell the step's work log when a block's forward begins and when its
backward reaches the block's input. They act only inside a zebra fiber; anywhere else
(a plain forward, or a block recomputed by activation checkpointing inside its own
backward) the model runs as usual.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from ...batch import map_tensors
from . import fibers
from .records import Cut


def _cutter(pairs: list[Cut], on_grad: Callable[[], None] | None = None, already: list[Cut] | None = None
            ) -> Callable[[Tensor], Tensor]:
    """``already``: cuts made inside the block (its MoE layer's losses); one of those leaving
    through the block stays as it is, its gradient lands where the executor looks for it."""
    made = {id(leaf) for _, leaf in already or []}

    def cut(t: Tensor) -> Tensor:
        if not t.requires_grad or id(t) in made:
            return t
        leaf = t.detach().requires_grad_()
        if on_grad is not None:
            leaf.register_hook(lambda g: on_grad())
        pairs.append((t, leaf))
        return leaf

    return cut


class BlockCuts:
    def __init__(self, blocks: list[nn.Module], layers: list[nn.Module]) -> None:
        self.handles = []
        for layer, (block, moe) in enumerate(zip(blocks, layers, strict=True)):
            self.handles.append(block.register_forward_pre_hook(self._pre(layer), with_kwargs=True))
            self.handles.append(block.register_forward_hook(self._post(layer), with_kwargs=True))
            self.handles.append(moe.register_forward_hook(self._aux(layer)))

    @staticmethod
    def _pre(layer: int):
        def hook(module, args, kwargs):
            fiber = fibers.current()
            if fiber is None:
                return None
            run, mb = fiber.owner, fiber.mb
            run.work.note("attn_fwd", layer, mb)
            if not torch.is_grad_enabled():
                return None
            rec = run.record(layer, mb)
            if rec.inputs is not None:
                raise RuntimeError(f"block {layer} ran twice on micro-batch {mb}: the zebra executor needs each MoE "
                                   f"block called once per forward")
            rec.inputs = []
            cut = _cutter(rec.inputs, on_grad=lambda: run.work.note("attn_bwd", layer, mb))
            return map_tensors(args, cut), map_tensors(kwargs, cut)

        return hook

    @staticmethod
    def _post(layer: int):
        def hook(module, args, kwargs, output):
            fiber = fibers.current()
            if fiber is None or not torch.is_grad_enabled():
                return None
            rec = fiber.owner.record(layer, fiber.mb)
            rec.outputs = []
            return map_tensors(output, _cutter(rec.outputs, already=rec.aux))

        return hook

    @staticmethod
    def _aux(layer: int):
        def hook(module, args, output):
            fiber = fibers.current()
            aux = module.aux_of(output)
            if fiber is None or aux is None or not torch.is_grad_enabled():
                return None
            rec = fiber.owner.record(layer, fiber.mb)
            cut = _cutter(rec.aux)
            # the layer's own result object: whoever collects it (the block's return value, or
            # a Hugging Face block's last_aux) gets the cut losses
            aux.balance_loss, aux.z_loss = cut(aux.balance_loss), cut(aux.z_loss)
            if aux.gate_loss is not None:
                aux.gate_loss = cut(aux.gate_loss)
            return None

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
