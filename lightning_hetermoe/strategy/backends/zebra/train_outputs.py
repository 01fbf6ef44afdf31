"""What a training step returns on every rank under zebra and DistEP.

Under DDP each rank's ``training_step`` output reaches ``on_train_batch_end`` (callbacks and
the module) as that rank returned it: ``{"loss": ..., **extras}`` with the extras detached.
Here the attention ranks run the user's step once per micro-batch and the expert ranks not
at all, so each rank gets the global batch's figures instead: the loss is already the mean
over every micro-batch of every rank, weighted by its share of the global batch, and each
extra scalar (a 1-element tensor or a number) is averaged the same way, in the loss's own
all-reduce (one collective per step, as before).

Which extras there are is learnt once, from the first training step of the first attention
rank (a host gather, once per fit): the expert ranks know nothing of the user's step. A
step that then returns other keys is refused, naming them. Extras that are not scalars (a
per-token tensor, a string) have no global mean: they are left out, said once.
"""

from __future__ import annotations

import numbers
from typing import Any

from torch import Tensor

from .executor import ZebraContractError


def _scalar(value: Any) -> bool:
    if isinstance(value, Tensor):
        return value.numel() == 1 and (value.is_floating_point() or not value.dtype.is_complex)
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def extras_of(result: Any) -> tuple[list[str], list[str]]:
    """A step result's extra keys beside ``loss``: ``(scalars, left_out)``, each sorted."""
    if not isinstance(result, dict):
        return [], []
    extra = sorted(str(k) for k in result if k != "loss")
    return [k for k in extra if _scalar(result[k])], [k for k in extra if not _scalar(result[k])]


def extra_values(result: Any, keys: list[str], mb: int) -> list[Any]:
    """``result``'s values of ``keys`` (detached), refusing a step whose extras changed."""
    scalars, _ = extras_of(result)
    if scalars != keys:
        raise ZebraContractError(f"training_step of micro-batch {mb} returned the extra scalars {scalars} beside "
                                 f"'loss', where the first step returned {keys}: zebra averages them over the "
                                 f"global batch, so every step must return the same keys")
    return [result[k].detach() if isinstance(result[k], Tensor) else float(result[k]) for k in keys]
