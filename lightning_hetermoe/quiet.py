"""Warnings from the libraries under the pack that no user of its entry points can act on,
muted there (the main job, the self-check); a library user's own script keeps them."""

from __future__ import annotations

import warnings

# (message pattern, category): Lightning's loops test ``isinstance(spec, LeafSpec)``, which
# torch 2.13 deprecates: one FutureWarning per loop and rank
NOISE = ((r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),)


def mute_dependency_noise() -> None:
    """Ignore :data:`NOISE` in this process."""
    for message, category in NOISE:
        warnings.filterwarnings("ignore", message=message, category=category)
