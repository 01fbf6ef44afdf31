"""The GPU self-check: the rules this pack relies on on a GPU, checked with one command.

    python -m lightning_hetermoe.selfcheck               # on the GPU (auto: cuda if available)
    python -m lightning_hetermoe.selfcheck --device cpu --quick --json out.json   # CI

Prints one row per check (``ok``, ``FAIL`` or ``skipped``, and what was seen), one summary
line, and exits 1 if anything failed. The checks:

* ``environment``: versions, the device and its compute capability, NCCL, bf16.
* ``kernels <dtype>``: the Triton expert MLP against the pure-torch path, output and every
  gradient, on ragged, empty-expert, single-expert and large-M cases. On CPU the kernels
  run through Triton's interpreter (small shapes).
* ``collectives ep`` / ``collectives zebra``: one-rank training under a real Trainer on a
  real process group (NCCL on CUDA, gloo on CPU); every recorded collective must carry
  its tensors where its traffic kind says, in sequences NCCL would accept.
* ``streams`` (CUDA): the zebra exchange's NCCL all-to-all kernels ran off the compute stream.
* ``memory``: what the zebra executor holds in a forward-only step does not grow with depth.

Everything runs in this one process, one check after the other; a check that raises
becomes a FAIL row and the others still run.
"""

from .command import CHECKS, main, parse_args, run
from .report import FAIL, OK, SKIPPED, Check, Context, Failed, Row, Skip
from .streams import judge_streams

__all__ = ["CHECKS", "FAIL", "OK", "SKIPPED", "Check", "Context", "Failed", "Row", "Skip", "judge_streams", "main",
           "parse_args", "run"]
