"""Initial values that do not depend on which process builds them, or on what else it holds.

A model of real size is built on the meta device and each process materialises only its
share (:mod:`lightning_hetermoe.materialize`). For that share to hold exactly the
values one process would have built whole, the pack's modules initialise from generators of
their own instead of torch's global one:

* every module of the pack that owns tensors draws an ``init_seed`` when it is constructed,
  from the generator of the enclosing :func:`seed_scope` (outside any scope, one draw from
  torch's default CPU generator). Construction runs the same code on the meta device and
  off it, so the seeds are the same either way;
* its ``reset_parameters()`` draws its values on the CPU from :func:`generator` seeded by
  that seed (the same numbers on any device, copied to where the tensor lives);
* stacked experts draw each expert's rows from a generator of that expert
  (``generator(init_seed, e)``): a process holding experts 3 and 4 draws exactly their rows,
  whatever the other processes hold.

Eagerly built modules call :func:`initialise` at the end of their constructor; on the meta
device it does nothing and the strategy fills the tensors later with the same calls.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from typing import Iterator

import torch
from torch import Tensor, nn

_scopes = threading.local()


def derive(seed: int, *keys: object) -> int:
    """A 63-bit seed from ``seed`` and ``keys`` (stable across processes and runs)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(repr((int(seed),) + tuple(keys)).encode())
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


def draw_seed() -> int:
    """The next module seed: from the innermost :func:`seed_scope`, else one draw from
    torch's default CPU generator (which ``seed_everything`` seeds)."""
    stack = getattr(_scopes, "stack", None)
    gen = stack[-1] if stack else None
    # explicitly on the CPU: construction may run under a meta-device context
    return int(torch.randint(0, 1 << 62, (1,), device="cpu", generator=gen))


@contextlib.contextmanager
def seed_scope(seed: int) -> Iterator[None]:
    """Modules constructed inside draw their seeds from a generator seeded by ``seed``, and
    torch's default CPU generator is where it was before (the default inits of torch's own
    modules, which run off the meta device and not on it, leave no trace)."""
    stack = getattr(_scopes, "stack", None)
    if stack is None:
        stack = _scopes.stack = []
    stack.append(torch.Generator(device="cpu").manual_seed(seed))
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        stack.pop()


def generator(seed: int, *keys: object) -> torch.Generator:
    """A CPU generator for ``seed`` (and ``keys``, e.g. an expert id)."""
    return torch.Generator(device="cpu").manual_seed(derive(seed, *keys) if keys else seed)


@contextlib.contextmanager
def seeded_default_generator(seed: int) -> Iterator[None]:
    """torch's default CPU generator seeded by ``seed`` inside, restored after: for code that
    draws from the global generator (a user's expert factory, torch's ``reset_parameters``)."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        yield


@torch.no_grad()
def fill_normal_(t: Tensor, std: float, gen: torch.Generator, mean: float = 0.0) -> Tensor:
    """``t`` filled from N(mean, std^2) drawn on the CPU from ``gen``."""
    if t.numel() and not t.is_meta:
        t.copy_(torch.empty(t.shape, dtype=torch.float32).normal_(mean, std, generator=gen))
    return t


@torch.no_grad()
def fill_(t: Tensor | None, value: float) -> Tensor | None:
    if t is not None and t.numel() and not t.is_meta:
        t.fill_(value)
    return t


def on_meta(module: nn.Module, recurse: bool = True) -> bool:
    """``module`` has a tensor on the meta device (its own, or any in its tree)."""
    tensors = list(module.parameters(recurse=recurse)) + list(module.buffers(recurse=recurse))
    return any(t.is_meta for t in tensors)


def initialise(module: nn.Module) -> None:
    """The eager path: ``module.reset_parameters()`` now, unless tensors of its tree live on
    the meta device (then whoever materialises them calls it)."""
    if not on_meta(module):
        module.reset_parameters()
