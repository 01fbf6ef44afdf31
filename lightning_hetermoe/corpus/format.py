"""The tokenised corpus on disk: its files, its metadata, and the writer that makes one.

A prepared directory (``recipes/prepare_data.py`` writes it through :mod:`.prepare`; the layout nanoGPT and
Megatron keep, in plain numpy files):

================  ===========================================================================
``tokens.bin``    every document's tokens, each followed by the end-of-document token, back to
                  back: a flat ``uint16`` array (vocabularies up to 65,536) or ``uint32``, read
                  through ``numpy.memmap`` (nothing is loaded; pages come in as rows need them)
``index.npy``     ``int64 [num_documents + 1]``: document ``d`` is ``tokens[index[d]:index[d+1]]``
                  (its end token included), ``index[-1]`` is the token count
``meta.json``     ``format``, ``version``, ``vocab_size``, ``dtype``, ``tokenizer`` (what made the
                  tokens), ``eos_id``, ``num_documents``, ``num_tokens``
``tokenizer.json``  the tokenizer, to decode with (``tokenizers.Tokenizer.from_file``)
================  ===========================================================================

Reading it needs numpy alone: the config check (``read_meta``) and the preparing recipe run
before torch or Lightning loads; the rows a run trains on are :mod:`lightning_hetermoe.model.corpus`'s.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..configs import ConfigError

FORMAT = "lightning-hetermoe tokenized corpus"
VERSION = 1
TOKENS, INDEX, META, TOKENIZER = "tokens.bin", "index.npy", "meta.json", "tokenizer.json"


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type holding every id below ``vocab_size``."""
    if vocab_size <= 2**16:
        return np.dtype(np.uint16)
    if vocab_size <= 2**32:
        return np.dtype(np.uint32)
    raise ValueError(f"vocab_size={vocab_size} does not fit uint32 token ids")


@dataclass(frozen=True)
class CorpusMeta:
    vocab_size: int
    dtype: str
    eos_id: int
    num_documents: int
    num_tokens: int
    tokenizer: dict[str, Any] = field(default_factory=dict)
    format: str = FORMAT
    version: int = VERSION


class CorpusWriter:
    """Streams documents' token ids into ``out``: :meth:`add` appends one document (its end
    token added), :meth:`close` writes the index and the metadata. Ids are checked against
    ``vocab_size`` as they come."""

    def __init__(self, out: str | os.PathLike, vocab_size: int, eos_id: int, tokenizer: dict[str, Any]) -> None:
        if not 0 <= eos_id < vocab_size:
            raise ValueError(f"the end-of-document id {eos_id} is outside the vocabulary of {vocab_size}")
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.vocab_size, self.eos_id, self.tokenizer = vocab_size, eos_id, tokenizer
        self.dtype = token_dtype(vocab_size)
        self._file = open(self.out / TOKENS, "wb")
        self._offsets = [0]

    @property
    def num_tokens(self) -> int:
        return self._offsets[-1]

    @property
    def num_documents(self) -> int:
        return len(self._offsets) - 1

    def add(self, ids: Sequence[int] | np.ndarray) -> None:
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            bad = int(arr.max() if arr.max() >= self.vocab_size else arr.min())
            raise ValueError(f"token id {bad} of document {self.num_documents} is outside the vocabulary of "
                             f"{self.vocab_size}")
        arr = np.append(arr, self.eos_id).astype(self.dtype)
        self._file.write(arr.tobytes())
        self._offsets.append(self._offsets[-1] + arr.size)

    def close(self) -> CorpusMeta:
        self._file.close()
        np.save(self.out / INDEX, np.asarray(self._offsets, dtype=np.int64))
        meta = CorpusMeta(vocab_size=self.vocab_size, dtype=self.dtype.name, eos_id=self.eos_id,
                          num_documents=self.num_documents, num_tokens=self.num_tokens, tokenizer=self.tokenizer)
        (self.out / META).write_text(json.dumps(asdict(meta), indent=2) + "\n")
        return meta


def read_meta(path: str | os.PathLike, field_name: str = "data.path") -> CorpusMeta:
    """The metadata of a prepared directory; a :class:`ConfigError` naming ``field_name``
    when ``path`` is not one."""
    p = Path(path)
    where = f"{field_name}={str(path)!r} is invalid"
    if not p.is_dir():
        raise ConfigError(f"{where}: no such directory (write one with python recipes/prepare_data.py)")
    missing = [name for name in (META, TOKENS, INDEX) if not (p / name).is_file()]
    if missing:
        raise ConfigError(f"{where}: it has no {', '.join(missing)} (not a corpus recipes/prepare_data.py wrote)")
    try:
        raw = json.loads((p / META).read_text())
        meta = CorpusMeta(**raw)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{where}: unreadable {META} ({err})") from None
    if meta.format != FORMAT or meta.version != VERSION:
        raise ConfigError(f"{where}: {META} says format {meta.format!r} version {meta.version}; this reads "
                          f"{FORMAT!r} version {VERSION}")
    size = (p / TOKENS).stat().st_size
    if size != meta.num_tokens * np.dtype(meta.dtype).itemsize:
        raise ConfigError(f"{where}: {TOKENS} holds {size} bytes, {META} says {meta.num_tokens} {meta.dtype} tokens")
    return meta
