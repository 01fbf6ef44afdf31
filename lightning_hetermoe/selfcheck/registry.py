"""Every check the self-check runs, in order (``CHECKS``), and where a check runs
(:func:`resolve_device`): what the command line and each check's child process both read."""

from __future__ import annotations

import torch

from .autotuning import check_autotuning
from .checkpoints import check_sharded_checkpoint
from .clocks import check_clocks
from .collectives import check_collectives
from .environment import check_environment
from .forking import check_fork_after_imports
from .grad_sync import check_grad_sync
from .host_syncs import check_host_syncs
from .kernel_numerics import (DTYPE_NAMES, check_cross_entropy, check_kernels, check_kernels_tma, check_large_gemm,
                              check_rms_norm, check_rotary)
from .memory import check_memory
from .memory_in_r import check_memory_in_r
from .receive_order import check_receive_order
from .report import Check
from .streams import check_streams
from .wire_dtype import check_wire_dtype


# Triton compiles (and on CUDA autotunes) every kernel from an empty cache on a first run
KERNEL_TIMEOUT_S = 180.0

CHECKS: list[Check] = [
    Check("environment", check_environment),
    Check("fork after imports", check_fork_after_imports, cuda_only=True),
    *(Check(f"kernels {name}", check_kernels(dtype), timeout_s=KERNEL_TIMEOUT_S)
      for dtype, name in DTYPE_NAMES.items()),
    Check("kernels 4.5M rows", check_large_gemm, cuda_only=True, timeout_s=KERNEL_TIMEOUT_S),
    Check("grouped_mm bf16", check_kernels(torch.bfloat16, "grouped_mm"), timeout_s=KERNEL_TIMEOUT_S),
    Check("cross-entropy kernel", check_cross_entropy, timeout_s=KERNEL_TIMEOUT_S),
    Check("rms norm kernels", check_rms_norm, timeout_s=KERNEL_TIMEOUT_S),
    Check("rotary kernel", check_rotary, timeout_s=KERNEL_TIMEOUT_S),
    Check("receive order", check_receive_order, cuda_only=True),
    Check("host syncs", check_host_syncs, cuda_only=True),
    Check("collectives ep", check_collectives("ep")),
    Check("collectives zebra", check_collectives("zebra")),
    Check("collectives datacentric", check_collectives("datacentric")),
    Check("checkpoint sharded", check_sharded_checkpoint),
    Check("wire dtype", check_wire_dtype),
    Check("streams", check_streams, cuda_only=True),
    Check("clocks", check_clocks, cuda_only=True),
    Check("memory", check_memory),
    Check("memory in R", check_memory_in_r),
    Check("gradient sync memory", check_grad_sync),
    Check("autotuning", check_autotuning, cuda_only=True),
    # last: a path off by default, tried on the GPU before it is; it must not push the rows
    # above past bench/gpu.py's deadline for the self-check
    Check("kernels tma bf16", check_kernels_tma, timeout_s=KERNEL_TIMEOUT_S),
]


def resolve_device(choice: str) -> torch.device:
    """The device a check runs on (in its child process: this initialises CUDA)."""
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device("cuda", torch.cuda.current_device()) if choice == "cuda" and torch.cuda.is_available() \
        else torch.device(choice)
