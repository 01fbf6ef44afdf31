"""Text files to a tokenised corpus on disk (:mod:`.format`'s layout): what
``recipes/prepare_data.py`` runs.

Documents come from a directory (every file under it, sorted by path), a glob or one file:
a ``.jsonl`` file holds one document per line (the line's ``text_field``), any other file
is one document (UTF-8). With no input, the CPython docs that ship with Python, one
document per pydoc topic. The tokenizer is a byte-level BPE trained here with the
``tokenizers`` library, or one on disk (a ``tokenizer.json`` file, or a Hugging Face
tokenizer directory: its ``tokenizer.json``, else ``AutoTokenizer`` with
``local_files_only=True``). Every document is followed by the end-of-document token.
"""

from __future__ import annotations

import glob
import json
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from ..configs import ConfigError, PrepareConfig
from ..staging import StagedDirectory
from .documents import pydoc_documents
from .format import META, TOKENIZER, CorpusMeta, CorpusWriter

EOS = "<|endoftext|>"
GLOB_CHARS = "*?["


def input_files(spec: str) -> list[Path]:
    """The files ``input`` names: a directory's files (recursively, hidden ones left out),
    a glob's matches, or the file itself; sorted by path."""
    if any(c in spec for c in GLOB_CHARS):
        files = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
        if not files:
            raise ConfigError(f"input={spec!r} is invalid: the glob matches no file")
        return files
    path = Path(spec)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*")
                       if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise ConfigError(f"input={spec!r} is invalid: the directory holds no file")
        return files
    raise ConfigError(f"input={spec!r} is invalid: no such file or directory")


def file_documents(files: list[Path], text_field: str = "text") -> Iterator[tuple[str, int]]:
    """``(text, bytes read)`` per document, in order."""
    for path in files:
        if path.suffix == ".jsonl":
            with open(path, "rb") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        yield "", len(line)
                        continue
                    try:
                        record = json.loads(line)
                    except ValueError as err:
                        raise ConfigError(f"input: {path}:{n} is not a JSON line ({err})") from None
                    if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                        raise ConfigError(f"text_field={text_field!r} is invalid: {path}:{n} has no string field "
                                          f"{text_field!r}")
                    yield record[text_field], len(line)
            continue
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ConfigError(f"input: {path} is not UTF-8 text ({err}); name the text files with a glob, e.g. "
                              f"input='dir/**/*.txt'") from None
        yield text, len(raw)


class Source:
    """The documents ``cfg.input`` names (re-readable: the tokenizer trains on one pass, the
    encoding is another)."""

    def __init__(self, cfg: PrepareConfig) -> None:
        self.cfg = cfg
        if cfg.input is None:
            self.files: list[Path] | None = None
            docs = pydoc_documents()
            self.total_bytes = sum(len(text.encode("utf-8")) for _, text in docs)
            self.name = "pydoc_topics (the CPython docs shipped with Python, one document per topic)"
        else:
            self.files = input_files(cfg.input)
            self.total_bytes = sum(p.stat().st_size for p in self.files)
            self.name = cfg.input

    def documents(self) -> Iterator[tuple[str, int]]:
        if self.files is None:
            for _, text in pydoc_documents():
                yield text, len(text.encode("utf-8"))
        else:
            yield from file_documents(self.files, self.cfg.text_field)

    def texts(self, max_bytes: int | None = None) -> Iterator[str]:
        """The non-empty documents' texts (up to about ``max_bytes`` of them)."""
        seen = 0
        for text, size in self.documents():
            if max_bytes is not None and seen >= max_bytes:
                return
            seen += size
            if text:
                yield text


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2, eos: str = EOS) -> Any:
    """A byte-level BPE (GPT-2's scheme: every byte is a token, so any text encodes and
    decodes back exactly) with ``eos`` as its only special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[eos],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def _eos_of_directory(path: Path) -> str | None:
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        f = path / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token")
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str):
                return eos
    return None


def load_tokenizer(spec: str, eos_token: str | None = None) -> tuple[Any, str | None, dict[str, Any]]:
    """A tokenizer on disk (never downloaded): ``(tokenizers.Tokenizer, its end-of-sequence
    token or None, what to record of it)``."""
    from tokenizers import Tokenizer

    path = Path(spec)
    if path.is_file():
        try:
            return Tokenizer.from_file(str(path)), eos_token, {"kind": "file", "path": str(path.resolve())}
        except Exception as err:
            raise ConfigError(f"tokenizer={spec!r} is invalid: not a tokenizers JSON file ({err})") from None
    if not path.is_dir():
        raise ConfigError(f"tokenizer={spec!r} is invalid: no such file or directory (a tokenizer.json file or a "
                          f"Hugging Face tokenizer directory on disk)")
    info = {"kind": "huggingface", "path": str(path.resolve())}
    if (path / "tokenizer.json").is_file():
        return Tokenizer.from_file(str(path / "tokenizer.json")), eos_token or _eos_of_directory(path), info
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError(f"tokenizer={spec!r}: the directory has no tokenizer.json, and loading it another way "
                          f"needs transformers (pip install -e '.[hf]')") from None
    try:
        hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as err:
        raise ConfigError(f"tokenizer={spec!r} is invalid: AutoTokenizer could not load it ({err})") from None
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise ConfigError(f"tokenizer={spec!r} is invalid: {type(hf).__name__} has no fast (tokenizers) backend")
    return backend, eos_token or hf.eos_token, info


def _size(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} KB"


class Progress:
    def __init__(self, total_bytes: int, every_s: float, log: Callable[[str], None]) -> None:
        self.total, self.every_s, self.log = max(total_bytes, 1), every_s, log
        self.started = self.last = time.perf_counter()

    def update(self, done: int, docs: int, tokens: int, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self.last < self.every_s:
            return
        self.last = now
        rate = done / max(now - self.started, 1e-9) / 1e6
        self.log(f"[prepare] {done / self.total:4.0%} of {_size(self.total)}: {docs:,} documents, "
                 f"{tokens:,} tokens ({rate:.1f} MB/s)")


def prepare_corpus(cfg: PrepareConfig, log: Callable[[str], None] = print) -> CorpusMeta:
    """Tokenise ``cfg.input`` into ``cfg.out`` (``tokens.bin``, ``index.npy``, ``meta.json``
    and the tokenizer's ``tokenizer.json``).

    The files are written beside ``out`` first (a hidden ``.<name>.partial-*`` directory)
    and moved into it once all are there: a run that fails or is stopped leaves a corpus
    already in ``out`` as it was, and no directory it made."""
    source = Source(cfg)
    if source.total_bytes == 0:
        raise ConfigError(f"input={cfg.input!r} is invalid: the corpus is empty (0 bytes)")
    out = Path(cfg.out)
    try:  # before the tokenizer trains: an output that cannot be written wastes none of it
        stage = StagedDirectory(out, last=(META,))
    except OSError as err:
        raise ConfigError(f"out={cfg.out!r} is invalid: the directory cannot be made ({err.strerror or err})") from None
    for p in stage.stale:
        log(f"[prepare] removed {p}: a run into {out} that did not finish")
    with stage as staging:
        meta, skipped = _write_corpus(cfg, source, staging, log)
    log(f"[prepare] wrote {out}: {meta.num_documents:,} documents, {meta.num_tokens:,} tokens ({meta.dtype}), "
        f"vocab_size={meta.vocab_size}, eos_id={meta.eos_id}"
        + (f"; {skipped} empty document(s) left out" if skipped else ""))
    return meta


def _write_corpus(cfg: PrepareConfig, source: Source, out: Path, log: Callable[[str], None]
                  ) -> tuple[CorpusMeta, int]:
    """The tokenizer (trained or loaded) and the corpus, written into ``out``; the metadata
    and how many documents were empty."""
    if cfg.tokenizer is None:
        log(f"[prepare] training a byte-level BPE (vocab_size={cfg.vocab_size}) on up to "
            f"{_size(min(source.total_bytes, cfg.tokenizer_train_bytes))} of {source.name}")
        started = time.perf_counter()
        first = next(source.texts(), None)
        if first is None:
            raise ConfigError(f"input={cfg.input!r} is invalid: the corpus is empty (no non-empty document)")
        tok = train_bpe(source.texts(cfg.tokenizer_train_bytes), cfg.vocab_size, cfg.min_frequency,
                        cfg.eos_token or EOS)
        eos = cfg.eos_token or EOS
        info: dict[str, Any] = {"kind": "bpe", "trained_by": "recipes/prepare_data.py (tokenizers byte-level BPE)",
                                "vocab_size_asked": cfg.vocab_size, "min_frequency": cfg.min_frequency}
        learned = tok.get_vocab_size(with_added_tokens=True)
        log(f"[prepare] BPE trained in {time.perf_counter() - started:.1f} s: {learned} tokens"
            + ("" if learned >= cfg.vocab_size else
               f" (fewer than the {cfg.vocab_size} asked: the text has no more pairs seen {cfg.min_frequency} times)"))
    else:
        tok, eos, info = load_tokenizer(cfg.tokenizer, cfg.eos_token)
        if eos is None:
            raise ConfigError(f"eos_token=null: tokenizer={cfg.tokenizer!r} names no end-of-sequence token; "
                              f"set eos_token to the token that ends a document")
    eos_id = tok.token_to_id(eos)
    if eos_id is None:
        raise ConfigError(f"eos_token={eos!r} is invalid: it is not in the tokenizer's vocabulary")
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    vocab_size = max(vocab_size, max(tok.get_vocab(with_added_tokens=True).values()) + 1)
    writer = CorpusWriter(out, vocab_size, eos_id, {**info, "eos_token": eos, "saved_as": TOKENIZER})
    progress = Progress(source.total_bytes, cfg.progress_every_s, log)
    done = skipped = 0
    batch: list[str] = []
    batch_bytes = 0

    def flush() -> None:
        for enc in tok.encode_batch(batch, add_special_tokens=False):
            writer.add(enc.ids)
        batch.clear()

    for text, size in source.documents():
        done += size
        if not text:
            skipped += 1
            continue
        batch.append(text)
        batch_bytes += size
        if len(batch) >= 1024 or batch_bytes >= 8_000_000:
            flush()
            batch_bytes = 0
            progress.update(done, writer.num_documents, writer.num_tokens)
    if batch:
        flush()
    if writer.num_documents == 0:
        writer.close()
        raise ConfigError(f"input={cfg.input!r} is invalid: the corpus is empty (no non-empty document)")
    tok.save(str(out / TOKENIZER))
    meta = writer.close()
    progress.update(done, meta.num_documents, meta.num_tokens, force=True)
    return meta, skipped
