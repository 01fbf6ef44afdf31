"""The GPU self-check: the rules this pack relies on on a GPU, checked with one command.

    python -m lightning_hetermoe.selfcheck               # on the GPU (auto: cuda if available)
    python -m lightning_hetermoe.selfcheck --device cpu --quick --json out.json   # CI

Prints one row per check (``ok``, ``FAIL`` or ``skipped``, its seconds, and what was seen),
one summary line, and exits 1 if anything failed. The checks:

* ``environment``: versions, the device and its compute capability, NCCL, bf16.
* ``kernels <dtype>``: the Triton expert MLP against the pure-torch path, output and every
  gradient, on ragged, empty-expert, single-expert and large-M cases. On CPU the kernels
  run through Triton's interpreter (small shapes).
* ``kernels 4.5M rows`` (CUDA): one grouped GEMM over 4.5M rows (row tiles on grid axis 0)
  against torch.
* ``grouped_mm bf16``: the ``grouped_mm`` backend's expert MLP against the torch loop, on the
  kernel rows' cases.
* ``cross-entropy kernel``, ``rms norm kernels``, ``rotary kernel``: the fused kernels a
  GPU runs instead of torch's ops (the head's loss rows, RMSNorm, rotary), output and
  gradients against torch's ops.
* ``receive order`` (CUDA): a receive into a freshly allocated buffer behind a long queued
  kernel does not overwrite what the kernel reads.
* ``host syncs`` (CUDA): at most one host sync per (layer, micro-batch) in a zebra step,
  counted under ``torch.cuda.set_sync_debug_mode``.
* ``collectives ep`` / ``collectives zebra``: one-rank training under a real Trainer on a
  real process group (NCCL on CUDA, gloo on CPU); every recorded collective must carry
  its tensors where its traffic kind says, in sequences NCCL would accept.
* ``wire dtype``: under mixed precision every row and answer of one-rank EP and zebra
  training travels in the 16-bit type, the width the cost model prices.
* ``streams`` (CUDA): the zebra exchange's NCCL all-to-all kernels ran off the compute stream.
* ``clocks`` (CUDA): a zebra loopback step's transfers timed by CUDA events, and attention,
  experts, communication and idle adding up to the step on the same clock.
* ``memory``: what the zebra executor holds in a forward-only step does not grow with depth.
* ``memory in R``: a zebra training step at a fixed global batch with R = 2, 4, 8
  micro-batches: what the executor holds, and (CUDA) the step's peak allocation, flat in R.
* ``gradient sync memory``: zebra's dense gradient sync needs at most one bucket beyond the
  gradients (CUDA's allocator peak; on CPU the sync runs, its sums are checked, the row skips).
* ``autotuning`` (CUDA): no Triton autotuning inside a training step (all of it at set-up).
* ``kernels tma bf16``: the ``kernels bf16`` row with the operands loaded by TMA descriptor
  (NVIDIA sm90+, and the interpreter).

Each check runs in a fresh child process (:mod:`.child`), one after the other, with a
deadline (``Check.timeout_s``: 120 s, 180 s for the kernels; ``--timeout`` sets every
one); its row prints as soon as it ends, with its seconds. A check that raises becomes a
FAIL row; one past its deadline is killed (its Python stacks go to stderr) and its row
says "timed out after N s"; one whose process dies is a FAIL row with its exit code and
the tail of its stderr. In every case the others still run.
"""

from .command import main, parse_args, run
from .registry import CHECKS
from .report import FAIL, OK, SKIPPED, Check, Context, Failed, Row, Skip
from .autotuning import Tuning, judge_autotuning, listening
from .grad_sync import judge_sync_peak
from .memory_in_r import judge_flat_in_r
from .streams import judge_streams
from .wire_dtype import judge_wire

__all__ = ["CHECKS", "FAIL", "OK", "SKIPPED", "Check", "Context", "Failed", "Row", "Skip", "Tuning",
           "judge_autotuning", "judge_flat_in_r", "judge_streams", "judge_sync_peak", "judge_wire", "listening",
           "main", "parse_args", "run"]
