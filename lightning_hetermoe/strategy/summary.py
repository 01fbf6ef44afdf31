"""Lightning's model summary, counting the whole model where each rank holds a share of it.

Lightning's ``ModelSummary`` (and ``RichModelSummary``, and the default one the Trainer adds)
counts the parameters of the module it is handed. Under the strategy that is rank 0's share:
its experts only under ep, no experts at all on an attention rank under zebra; the summary
printed at the start of every fit would then call a model of 15.1 K parameters 10.4 K. The
strategy records each parameter's whole size by name before it lays the model out, and the
summaries take their counts from that record: per layer, in total, trainable, and the
model's size in MB. Layer names, types, modes and FLOPs are Lightning's own. Where the
layers run only inside the step's executor (zebra, distep), the summary does not run the
model's ``example_input_array`` (Lightning's would, on every rank, and fail there).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ModelSummary, RichModelSummary
from lightning.pytorch.utilities.model_summary import ModelSummary as Summary


class WholeSummary(Summary):
    """Lightning's summary of ``model`` with every count taken from ``numel`` (each
    parameter's whole size by name). ``forward_example=False``: the model's
    ``example_input_array`` is not run (under zebra and distep the layers run only inside
    the step's executor): input and output sizes show as unknown, FLOPs as 0."""

    def __init__(self, model: Any, max_depth: int, numel: dict[str, int], forward_example: bool = True) -> None:
        self._numel = numel
        self._forward_example = forward_example
        # each module's whole count, by its name: every parameter added to each module above it
        self._under: dict[str, int] = {}
        for name, n in numel.items():
            parts = name.split(".")
            for depth in range(1, len(parts)):
                module = ".".join(parts[:depth])
                self._under[module] = self._under.get(module, 0) + n
        super().__init__(model, max_depth)

    def _forward_example_input(self) -> None:
        if self._forward_example:
            super()._forward_example_input()

    @property
    def param_nums(self) -> list[int]:
        return [self._under.get(layer, 0) for layer in self.layer_names]

    @property
    def total_parameters(self) -> int:
        return sum(self._numel.values())

    @property
    def trainable_parameters(self) -> int:
        held = dict(self._model.named_parameters())
        return sum(n for name, n in self._numel.items() if name in held and held[name].requires_grad)


class _CountsWholeModel:
    """Mixed into Lightning's summary callbacks: their summary is a :class:`WholeSummary`."""

    numel: dict[str, int]
    forward_example: bool

    def _summary(self, trainer: Any, pl_module: Any) -> Summary:
        return WholeSummary(pl_module, self._max_depth, self.numel, self.forward_example)


class WholeModelSummary(_CountsWholeModel, ModelSummary):
    pass


class WholeRichModelSummary(_CountsWholeModel, RichModelSummary):
    pass


WHOLE = {ModelSummary: WholeModelSummary, RichModelSummary: WholeRichModelSummary}


def count_whole_model(callbacks: list, numel: dict[str, int], forward_example: bool) -> None:
    """Lightning's own summary callbacks in ``callbacks`` (the one the Trainer adds by default
    among them) count the whole model from now on, and run the model's example input only
    where ``forward_example``. They were made before the strategy knew the layout, so each
    keeps its settings and takes the whole-model class; a subclass of the user's own is left
    as it is."""
    for cb in callbacks:
        whole = WHOLE.get(type(cb))
        if whole is not None:
            cb.__class__ = whole
        if isinstance(cb, _CountsWholeModel):
            cb.numel, cb.forward_example = numel, forward_example
