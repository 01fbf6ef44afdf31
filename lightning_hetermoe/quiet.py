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
    """Ignore :data:`NOISE` and :data:`ADVERTS` in this process, and print each of
    Lightning's lines once (:func:`one_console_for_lightning`)."""
    for message, category in NOISE:
        warnings.filterwarnings("ignore", message=message, category=category)
    logger = logging.getLogger(ADVERTS_LOGGER)
    if not any(isinstance(f, _NoAdverts) for f in logger.filters):
        logger.addFilter(_NoAdverts())
    one_console_for_lightning()


def one_console_for_lightning() -> None:
    """Lightning's package puts a console handler on its ``lightning`` logger when imported,
    and its subpackages send their lines up to it and on to the root logger when that has
    handlers. Imported after the job's logging is configured (the main job reads its config
    before loading Lightning, and Hydra configures the root logger before that), every line
    would print twice, once in each format: Lightning's own handler goes, and its lines go the
    job's way (Hydra's format, and its log file)."""
    if not logging.getLogger().handlers:
        return  # nothing configured: Lightning's handler is the one that prints
    lightning = logging.getLogger("lightning")
    for handler in list(lightning.handlers):
        if type(handler) is logging.StreamHandler:
            lightning.removeHandler(handler)
