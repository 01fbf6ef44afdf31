"""Output from the libraries under the pack that no user of its entry points can act on,
muted there (the main job, the self-check); a library user's own script keeps it."""

from __future__ import annotations

import logging
import warnings

# (message pattern, category): Lightning's loops test ``isinstance(spec, LeafSpec)``, which
# torch 2.13 deprecates: one FutureWarning per loop and rank
NOISE = ((r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),)
# Lightning's rank-zero messages that advertise (every Trainer a process builds prints a
# "Tip" for a cloud logger): what they start with, and the logger they come from
ADVERTS = ("💡 Tip:",)
ADVERTS_LOGGER = "lightning.pytorch.utilities.rank_zero"


class _NoAdverts(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(ADVERTS)


def mute_dependency_noise() -> None:
    """Ignore :data:`NOISE` and :data:`ADVERTS` in this process."""
    for message, category in NOISE:
        warnings.filterwarnings("ignore", message=message, category=category)
    logger = logging.getLogger(ADVERTS_LOGGER)
    if not any(isinstance(f, _NoAdverts) for f in logger.filters):
        logger.addFilter(_NoAdverts())
