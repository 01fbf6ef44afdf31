"""Byte-level language-modelling data over text that ships with Python: no download.

The corpus is the CPython documentation topics in ``pydoc_data`` (~460 KB). The last
``val_fraction`` of the bytes is held out for validation, so no validation window
overlaps a training window. A tokenised corpus on disk is :mod:`.corpus`'s; both load
through :class:`GlobalOrderDataModule`, and :func:`build_datamodule` picks by
``data.corpus``.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.data import Dataset

from ..configs import CORPORA, DataConfig
from ..corpus.documents import pydoc_documents
from .sampling import GlobalOrderDataModule


def load_corpus(name: str) -> bytes:
    if name == "pydoc_topics":
        return "".join(text for _, text in pydoc_documents()).encode("utf-8")
    raise ValueError(f"data.corpus={name!r} is invalid: must be one of {CORPORA}")


class ByteWindows(Dataset):
    """Fixed windows of ``seq_len + 1`` bytes; item i is (input, target) shifted by one."""

    def __init__(self, data: Tensor, seq_len: int, starts: Tensor) -> None:
        self.data, self.seq_len, self.starts = data, seq_len, starts

    def __len__(self) -> int:
        return self.starts.numel()

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        s = int(self.starts[i])
        w = self.data[s : s + self.seq_len + 1].long()
        return w[:-1], w[1:]


class ByteCorpusDataModule(GlobalOrderDataModule):
    """Windows of ``data.seq_len + 1`` bytes of a text that ships with Python
    (``data.corpus="pydoc_topics"``: no download), the last ``val_fraction`` held out for
    validation, in one global order per epoch however many ranks read it (``data``: a
    :class:`DataConfig` or its dict)."""

    def setup(self, stage: str | None = None) -> None:
        cfg = self.cfg
        data = torch.frombuffer(bytearray(load_corpus(cfg.corpus)), dtype=torch.uint8)
        split = int(len(data) * (1 - cfg.val_fraction))
        train, val = data[:split], data[split:]
        for part, name in ((train, "train"), (val, "validation")):
            if len(part) <= cfg.seq_len + 1:
                raise ValueError(f"data.seq_len={cfg.seq_len} is too long for the {name} split ({len(part)} bytes)")
        g = torch.Generator().manual_seed(cfg.seed)
        train_starts = torch.randint(0, len(train) - cfg.seq_len - 1, (cfg.train_windows,), generator=g)
        val_starts = torch.linspace(0, len(val) - cfg.seq_len - 1, cfg.val_windows).long()
        self.train_set = ByteWindows(train, cfg.seq_len, train_starts)
        self.val_set = ByteWindows(val, cfg.seq_len, val_starts)


def build_datamodule(cfg: DataConfig | dict) -> GlobalOrderDataModule:
    """``data.corpus``'s DataModule: byte windows (``pydoc_topics``) or packed rows of a
    tokenised corpus on disk (``tokenized``)."""
    from ..configs import from_cfg

    cfg = from_cfg(DataConfig, cfg, "data")
    if cfg.corpus == "tokenized":
        from .corpus import TokenizedDataModule

        return TokenizedDataModule(cfg)
    return ByteCorpusDataModule(cfg)
