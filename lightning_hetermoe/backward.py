"""Whether autograd is running a backward on this thread right now.

Work a forward does once per step (a collective every rank joins, a prefetch, a bias
update, an emulated task's timing) must know when the forward it is in is a checkpointed
block recomputed inside the backward. PyTorch says so only through a private call; it is
asked here, in one place.
"""

from __future__ import annotations

import torch


def inside_backward() -> bool:
    """True inside a backward pass (a recompute, a backward hook), False in a forward."""
    return torch._C._current_graph_task_id() != -1
