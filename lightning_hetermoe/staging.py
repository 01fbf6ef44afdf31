"""Outputs that appear whole or not at all.

A command that writes a corpus, a consolidated checkpoint or an exported model writes it
first into a hidden sibling of its output (``.<name>.partial-*``, on the same file system)
and moves it into place once every byte is there. A run that fails or is stopped (an
error, Ctrl-C, a full disk) leaves what was at the output before as it was, none of its
own half-written files, and no parent directory it made for the output. Torch-free: the
corpus preparation uses it too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Iterable

PARTIAL = ".partial-"  # a staging name's mark, after the hidden output name


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class _Staged:
    def __init__(self, out: str | os.PathLike) -> None:
        self.out = Path(out)
        if self.out.exists() and self.out.is_dir() != self._directory:
            raise (IsADirectoryError(21, "it is a directory") if self.out.is_dir()
                   else NotADirectoryError(20, "it is a file"))
        if self.out.is_dir() and not os.access(self.out, os.W_OK | os.X_OK):
            raise PermissionError(13, "it is not writable")
        # the parents made for the output, innermost first: removed again if the run fails
        self.made = [p for p in (self.out.parent, *self.out.parent.parents) if not p.exists()]
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.path = self._make(prefix=f".{self.out.name}{PARTIAL}", dir=self.out.parent)

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
        finally:
            if self.path.is_dir():
                shutil.rmtree(self.path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
            for p in [] if done else self.made:
                with contextlib.suppress(OSError):  # where still empty
                    p.rmdir()


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
