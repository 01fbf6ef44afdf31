"""The LM head's cross-entropy rows as one Triton kernel on CUDA, behind a custom op.

:func:`lightning_hetermoe.model.loss.linear_cross_entropy` forms a chunk's logits with a
GEMM, then needs each row's loss and, for the backward, ``softmax - onehot`` in place of
the logits. On torch's ops that is an fp32 log-softmax of the 16-bit logits (reading
them two or three times, writing 4 bytes), its exponential in place (8) and a cast back
(6): about 24 bytes moved per token and vocabulary entry on CUDA beside the GEMM's own
write. ``triton_src.cross_entropy_rows_kernel`` reads each row twice and writes it once (6
bytes at 16 bits): for D1's 32K vocabulary and a 16K-token micro-batch, about 10 GB less
(arithmetic, not a measurement; some 14 ms on an A40's 696 GB/s). The cost model prices 12
bytes (``CostModel.head_time``).

It runs where the logits are on a CUDA device that runs Triton; on CPU torch's ops run
(the interpreter is for tests). The custom op keeps the launch opaque to ``torch.compile``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .availability import Setting, triton_available

_NS = "lightning_hetermoe"
fused = Setting(True)  # fused(False): torch's ops everywhere, for side-by-side benchmarks


def runs_fused(logits: Tensor) -> bool:
    """Whether the rows of ``logits`` run on the kernel (CUDA with Triton, 16-bit or fp32)."""
    return (fused.value and logits.device.type == "cuda"
            and logits.dtype in (torch.bfloat16, torch.float16, torch.float32) and triton_available(logits.device))


@torch.library.custom_op(f"{_NS}::cross_entropy_rows", mutates_args=("logits",))
def cross_entropy_rows(logits: Tensor, targets: Tensor, write_grad: bool) -> Tensor:
    """Each row's ``logsumexp - logit[target]`` in fp32 (``[n]``); with ``write_grad`` the
    logits become ``softmax - onehot(target)`` in place."""
    from .launch import cross_entropy_rows as launch_rows

    return launch_rows(logits, targets, write_grad)


@cross_entropy_rows.register_fake
def _(logits: Tensor, targets: Tensor, write_grad: bool) -> Tensor:
    return logits.new_empty(logits.shape[0], dtype=torch.float32)
