"""Outputs that appear whole or not at all.

A command that writes a corpus, a consolidated checkpoint or an exported model, and the
strategy saving a sharded checkpoint, write it first into a hidden sibling of its output
(``.<name>.partial-*``, on the same file system) and move it into place once every byte is
there. A run that fails or is stopped (an error, Ctrl-C, a full disk, a node lost in the
middle of a save) leaves what was at the output before as it was, none of its own
half-written files, and no parent directory it made for the output. Torch-free: the corpus
preparation uses it too.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Any, Iterable

from .configs import ConfigError

PARTIAL = ".partial-"  # a staging name's mark, after the hidden output name
OLD = ".old-"  # the mark of an output's earlier copy, moved aside while its replacement moved in


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _discard(p: Path) -> None:
    """Remove ``p``, a directory (not through a link), a file or a link, if it is there."""
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def missing_parents(out: str | os.PathLike) -> list[Path]:
    """The parent directories of ``out`` that are not there yet, innermost first: what a write
    makes for it, and removes again if it fails."""
    parent = Path(out).parent
    return [p for p in (parent, *parent.parents) if not p.exists()]


def remove_empty(dirs: Iterable[Path]) -> None:
    """Remove each of ``dirs`` (innermost first) that is still empty."""
    for p in dirs:
        with contextlib.suppress(OSError):
            p.rmdir()


class _Staged:
    def __init__(self, out: str | os.PathLike) -> None:
        self.out = Path(out)
        if self.out.exists() and self.out.is_dir() != self._directory:
            raise (IsADirectoryError(21, "it is a directory") if self.out.is_dir()
                   else NotADirectoryError(20, "it is a file"))
        if self.out.is_dir() and not os.access(self.out, os.W_OK | os.X_OK):
            raise PermissionError(13, "it is not writable")
        self.made = missing_parents(self.out)  # removed again if the run fails
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.stale = remove_stale(self.out)  # an earlier write of it killed before its end
            self.path = self._make(prefix=f".{self.out.name}{PARTIAL}", dir=self.out.parent)
        except OSError:
            remove_empty(self.made)
            raise

    _directory = False

    @staticmethod
    def _make(prefix: str, dir: Path) -> Path:
        raise NotImplementedError

    def _move_in(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        done = False
        try:
            if kind is None:
                self._move_in()
                done = True
                remove_stale(self.out)  # an earlier copy kept while the output was missing
        finally:
            _discard(self.path)  # (gone already where it was renamed into place)
            if not done:
                remove_empty(self.made)


class StagedFile(_Staged):
    """``with StagedFile(out) as tmp:`` write the file ``tmp``; it becomes ``out`` when the
    block ends without an error (``out`` replaced in one rename). Raises ``OSError`` at
    construction where ``out`` cannot be written (a directory, a parent that is a file)."""

    @staticmethod
    def _make(prefix: str, dir: Path) -> Path:
        fd, name = tempfile.mkstemp(prefix=prefix, dir=dir)
        os.close(fd)
        return Path(name)

    def _move_in(self) -> None:
        os.chmod(self.path, 0o666 & ~_umask())  # mkstemp's is private: the output gets a file's usual mode
        os.replace(self.path, self.out)


class StagedDirectory(_Staged):
    """``with StagedDirectory(out, last=(...)) as tmp:`` write files into the directory
    ``tmp``; they move into ``out`` when the block ends without an error: the directory
    renamed where ``out`` is not there yet, else file by file (what ``out`` held besides
    stays), the names in ``last`` moved last, in that order (what a reader checks the
    others against). Raises ``OSError`` at construction where ``out`` cannot be written."""

    _directory = True

    def __init__(self, out: str | os.PathLike, last: Iterable[str] = ()) -> None:
        self.last = tuple(last)
        super().__init__(out)

    @staticmethod
    def _make(prefix: str, dir: Path) -> Path:
        return Path(tempfile.mkdtemp(prefix=prefix, dir=dir))

    def _move_in(self) -> None:
        if not self.out.exists():
            os.chmod(self.path, 0o777 & ~_umask())  # mkdtemp's is private
            os.replace(self.path, self.out)
            return
        names = sorted(p.name for p in self.path.iterdir())
        for name in [n for n in names if n not in self.last] + [n for n in self.last if n in names]:
            target = self.out / name
            if (self.path / name).is_dir() and target.is_dir():
                shutil.rmtree(target)
            os.replace(self.path / name, target)


def staged(kind: type[_Staged], out: str | os.PathLike, **kwargs: Any) -> _Staged:
    """``kind`` (:class:`StagedFile` or :class:`StagedDirectory`) for ``out``, checked before any
    work: an output that cannot be written is a :class:`ConfigError` naming it."""
    try:
        return kind(out, **kwargs)
    except OSError as err:
        raise ConfigError(f"out={str(out)!r} is invalid: it cannot be written ({err.strerror or err})") from None


def unfinished(out: str | os.PathLike) -> list[Path]:
    """What writes of ``out`` left beside it: their hidden partial copies (killed before
    their end) and earlier copies moved aside (a write killed between its two renames, or
    an old copy that could not be removed): where ``out`` itself is missing, the reason it is."""
    out = Path(out)
    name = glob.escape(out.name)
    return sorted(out.parent.glob(f".{name}{PARTIAL}*")) + sorted(out.parent.glob(f".{name}{OLD}*"))


def is_earlier_copy(p: Path, out: str | os.PathLike) -> bool:
    """Whether ``p``, one of :func:`unfinished`'s, is an earlier copy of ``out``, whole (by the
    mark after the output's own name, which may hold either mark itself)."""
    return p.name.startswith(f".{Path(out).name}{OLD}")


def unfinished_note(out: str | os.PathLike) -> str:
    """For a message saying ``out`` is missing: what writes of it left beside it, or ''. An
    earlier copy comes first: it is whole, and renamed back it is the output again."""
    out = Path(out)
    left = unfinished(out)
    earlier = [p for p in left if is_earlier_copy(p, out)]
    if earlier:
        return (f"; beside it, {earlier[-1].name} is its earlier copy, whole, moved aside by a save that did not "
                f"finish: rename it to {out.name} to use it")
    return f"; beside it, {left[0].name} is a save of it that did not finish" if left else ""


def remove_stale(out: str | os.PathLike) -> list[Path]:
    """Remove what writes of ``out`` left beside it (see :func:`unfinished`); returns what was
    removed. Called by the next write of the same output, which owns the name: a partial save
    of a large checkpoint holds as much disk as the checkpoint. An earlier copy stays while
    ``out`` is missing (then it is the one whole copy there is): the write calls this again
    once its output is in place."""
    out = Path(out)
    stale = [p for p in unfinished(out) if out.exists() or not is_earlier_copy(p, out)]
    for p in stale:
        _discard(p)
    return stale


def partial_sibling(out: str | os.PathLike) -> Path:
    """A fresh hidden name beside ``out`` to write its replacement under (not made here: a
    collective save agrees on the name first, then its writer makes it)."""
    out = Path(out)
    return out.parent / f".{out.name}{PARTIAL}{secrets.token_hex(4)}"


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); ``False`` where this
    system or file system cannot (then nothing moved)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(str(a)), at_fdcwd, os.fsencode(str(b)), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(b))


def replace_directory(complete: str | os.PathLike, out: str | os.PathLike) -> tuple[Path, OSError] | None:
    """``complete`` (a directory written whole) becomes ``out`` whole, and what ``out`` was (a
    directory, a file) is removed. Where ``out`` is there, the two are swapped in one step
    on Linux, so ``out`` always holds one complete checkpoint; elsewhere the old one moves
    aside first (for a moment ``out`` is absent, the old one still whole beside it).

    Once the new one is in place the write has succeeded, whatever becomes of the old one: an
    old copy that cannot be removed (a network file system's busy file, a file a user made
    read-only) is returned with the error, under a hidden name the next write of ``out``
    removes (:func:`remove_stale`), not raised."""
    complete, out = Path(complete), Path(out)
    if out.is_symlink():
        out.unlink()
    if not out.exists():
        os.replace(complete, out)
        return None
    aside = out.parent / f".{out.name}{OLD}{secrets.token_hex(4)}"
    if _exchange(complete, out):
        old = complete  # the two names swapped: the old output is where the new one was written
    else:
        old = aside
        os.replace(out, old)
        os.replace(complete, out)
    try:
        _remove_old(old)
    except OSError as err:
        if old != aside:
            with contextlib.suppress(OSError):  # named for what it is: no save that did not finish
                os.replace(old, aside)
                old = aside
        return old, err
    return None


def _remove_old(old: Path) -> None:
    if old.is_dir():
        shutil.rmtree(old)
    else:
        old.unlink()
