"""A tokenised corpus on disk (:mod:`lightning_hetermoe.corpus.format`'s layout), packed into
fixed rows with its documents' boundaries kept.

Packing (:class:`PackedRows`): the documents of a split are laid back to back and cut into
rows of ``seq_len + 1`` tokens at a stride of ``seq_len`` (every token is a target once; a
document runs on into the next row). A row is ``(input, target, segments)``: ``segments``
numbers the documents within the row (it changes exactly where a document starts), from
which the model builds a block-diagonal causal mask; the target that would predict a
document's first token from the previous document (the one after its end token) is
:data:`~.lm.IGNORE_INDEX`. Validation holds out whole documents.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from ..configs import ConfigError, DataConfig
from ..corpus.format import INDEX, META, TOKENS, CorpusMeta, read_meta
from .sampling import GlobalOrderDataModule
from .lm import IGNORE_INDEX


class TokenCorpus:
    """A prepared directory: the token array and the index as memory maps (opened on first
    use, so the object pickles small into loader workers)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.meta = read_meta(self.path)
        self._tokens: np.ndarray | None = None
        self._index: np.ndarray | None = None
        if int(self.index[-1]) != self.meta.num_tokens or len(self.index) != self.meta.num_documents + 1:
            raise ConfigError(f"data.path={str(path)!r} is invalid: {INDEX} does not match {META}")

    @property
    def tokens(self) -> np.ndarray:
        if self._tokens is None:
            self._tokens = np.memmap(self.path / TOKENS, dtype=self.meta.dtype, mode="r")
        return self._tokens

    @property
    def index(self) -> np.ndarray:
        if self._index is None:
            self._index = np.load(self.path / INDEX, mmap_mode="r")
        return self._index

    def document(self, d: int) -> np.ndarray:
        """Document ``d``'s tokens, its end token included."""
        return np.asarray(self.tokens[self.index[d] : self.index[d + 1]])

    def __len__(self) -> int:
        return self.meta.num_documents

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokens": None, "_index": None}


def split_documents(lengths: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Hold out whole documents: a seeded random order of the documents, taken until the
    held-out ones reach ``val_fraction`` of the tokens (at least one, never all).
    Returns ``(train, val)`` document numbers, each ascending."""
    n = len(lengths)
    if n < 2:
        raise ConfigError(f"data.path: the corpus has {n} document(s); holding out validation documents needs "
                          f"at least 2")
    order = np.random.default_rng(seed).permutation(n)
    taken = np.cumsum(np.asarray(lengths, dtype=np.int64)[order])
    k = int(np.searchsorted(taken, val_fraction * taken[-1], side="left")) + 1
    k = min(max(k, 1), n - 1)
    return np.sort(order[k:]), np.sort(order[:k])


class PackedRows(Dataset):
    """The documents ``docs`` of ``corpus`` back to back, cut into rows of ``seq_len + 1``
    tokens at a stride of ``seq_len``; item ``i`` is row ``rows[i]`` (all rows when ``rows``
    is None) as ``(input, target, segments)`` int64 tensors of ``[seq_len]``, or
    ``(input, target)`` with ``document_mask=False`` (no ignored targets then)."""

    def __init__(self, corpus: TokenCorpus, docs: np.ndarray, seq_len: int, rows: np.ndarray | None = None,
                 document_mask: bool = True) -> None:
        self.corpus, self.seq_len, self.document_mask = corpus, seq_len, document_mask
        index = np.asarray(corpus.index)
        docs = np.asarray(docs, dtype=np.int64)
        self.doc_ids = docs
        self.file_starts = index[docs]
        self.starts = np.concatenate([[0], np.cumsum(index[docs + 1] - index[docs])]).astype(np.int64)
        self.num_rows = max(int(self.starts[-1] - 1) // seq_len, 0)
        self.rows = rows

    @property
    def num_tokens(self) -> int:
        return int(self.starts[-1])

    def __len__(self) -> int:
        return self.num_rows if self.rows is None else len(self.rows)

    def locate(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Row of item ``i``: for each of its ``seq_len + 1`` tokens the position in
        ``tokens.bin``, the document (index into ``docs``) and whether it is that document's
        first token."""
        row = int(self.rows[i]) if self.rows is not None else int(i)
        if not 0 <= row < self.num_rows:
            raise IndexError(f"row {row} of {self.num_rows}")
        at = np.arange(row * self.seq_len, row * self.seq_len + self.seq_len + 1, dtype=np.int64)
        doc = np.searchsorted(self.starts, at, side="right") - 1
        offset = at - self.starts[doc]
        return self.file_starts[doc] + offset, doc, offset == 0

    def __getitem__(self, i: int) -> tuple[Tensor, ...]:
        pos, doc, first = self.locate(i)
        if pos[-1] - pos[0] == self.seq_len:  # contiguous in the file (the usual case): one slice
            raw = self.corpus.tokens[pos[0] : pos[-1] + 1]
        else:
            raw = self.corpus.tokens[pos]
        tokens = torch.from_numpy(np.asarray(raw, dtype=np.int64))
        inputs, targets = tokens[:-1], tokens[1:].clone()
        if not self.document_mask:
            return inputs, targets
        # the target after a document's end token is the next document's first: nothing predicts it
        targets[torch.from_numpy(first[1:])] = IGNORE_INDEX
        return inputs, targets, torch.from_numpy(doc[:-1] - doc[0])


def spread(count: int, total: int) -> np.ndarray | None:
    """``count`` of ``total`` row numbers, evenly spaced (None: all of them)."""
    if count >= total:
        return None
    return np.linspace(0, total - 1, count).round().astype(np.int64)


class TokenizedDataModule(GlobalOrderDataModule):
    """Packed rows of a prepared corpus (``data.corpus=tokenized``, ``data.path``), in the
    same global order per epoch as the byte data, resumable mid-epoch."""

    def __init__(self, cfg: DataConfig | dict) -> None:
        super().__init__(cfg)
        if self.cfg.corpus != "tokenized":
            raise ConfigError(f"data.corpus={self.cfg.corpus!r} is invalid here: TokenizedDataModule reads "
                              f"data.corpus=tokenized")
        self.corpus: TokenCorpus | None = None

    @property
    def meta(self) -> CorpusMeta:
        return read_meta(self.cfg.path)

    def setup(self, stage: str | None = None) -> None:
        cfg = self.cfg
        corpus = self.corpus = TokenCorpus(cfg.path)
        index = np.asarray(corpus.index)
        train_docs, val_docs = split_documents(np.diff(index), cfg.val_fraction, cfg.seed)
        train = PackedRows(corpus, train_docs, cfg.seq_len, document_mask=cfg.document_mask)
        val = PackedRows(corpus, val_docs, cfg.seq_len, document_mask=cfg.document_mask)
        for part, name in ((train, "training"), (val, "validation")):
            if part.num_rows < cfg.batch_size:
                raise ConfigError(
                    f"data.seq_len={cfg.seq_len}, data.batch_size={cfg.batch_size}: the {name} documents of "
                    f"{cfg.path} ({part.num_tokens} tokens) give {part.num_rows} row(s), fewer than one batch "
                    f"(a larger corpus, a shorter seq_len or a smaller batch_size; val_fraction={cfg.val_fraction})")
        if cfg.train_windows is not None:
            train.rows = spread(cfg.train_windows, train.num_rows)
        val.rows = spread(cfg.val_windows, val.num_rows)
        self.train_set, self.val_set = train, val
