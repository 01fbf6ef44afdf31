"""A script's run as a test starts it (``python script.py args``), in a process forked by the
harness's fork server (:mod:`harness`) instead of a new interpreter.

A new interpreter that runs a recipe spends 6-7 s of CPU importing torch, Lightning (and
through torchmetrics, transformers and matplotlib) before the first line of its job: about
three quarters of a short two-rank run, and on the 2-core CI machine the largest single cost
of the suite's tests that start commands. Forked from a server that imported them once, the
same run starts at its first line. The process is still a process of its own, with the
script as ``__main__``, the command's arguments, environment, working directory, session,
pipes and exit code, and its ranks are the processes the pack starts from it.

What a warm process cannot show is what happens *before* the imports: which modules a
command loads, and in which order. The tests whose subject is that (a config error answered
before torch loads, the names Lightning registers when it loads after the pack, the README's
first example and the main job as a newcomer runs them, torchrun's ranks) start a new
interpreter with :mod:`subprocess`, as before.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import logging
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
from multiprocessing import reduction
from pathlib import Path

import torch.multiprocessing as mp

import harness


class _Fd:
    """A file descriptor handed to the forked process (the fork server passes it over its
    socket: a plain int would name a descriptor of the server, not of the caller)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return _inherited, (reduction.DupFd(self.fd),)


def _inherited(dup) -> int:
    return dup.detach()


def _split(cmd: list[str]) -> tuple[list[str], str, list[str]]:
    """``[python, flags..., script, args...]`` -> (flags, script, args)."""
    if not cmd or cmd[0] != sys.executable:
        raise ValueError(f"not a Python script's command: {cmd[:3]}")
    flags, i = [], 1
    while i < len(cmd) and (cmd[i] in ("-u", "-B") or cmd[i:i + 2] == ["-X", "faulthandler"]):
        step = 2 if cmd[i] == "-X" else 1
        flags += cmd[i:i + step]
        i += step
    if i >= len(cmd) or cmd[i].startswith("-"):
        raise ValueError(f"a warm run takes `python [-u] [-X faulthandler] script.py args`, not {cmd[:4]}")
    return flags, cmd[i], cmd[i + 1:]


def _stream(fd: int, unbuffered: bool) -> io.TextIOWrapper:
    raw = io.FileIO(fd, "w", closefd=False)
    if unbuffered:
        return io.TextIOWrapper(raw, encoding="utf-8", errors="backslashreplace", write_through=True)
    return io.TextIOWrapper(io.BufferedWriter(raw), encoding="utf-8", errors="backslashreplace")


class _AsIfImportedNow(logging.Handler):
    """Lightning's console handler, decided at its first record instead of at its import.
    Imported into a new interpreter, Lightning logs through the root logger's handlers where
    the root has some by then (a Hydra job configured them before its job imported
    Lightning) and else through a handler of its own on stderr; the server imported it before
    any of that."""

    def __init__(self) -> None:
        super().__init__()
        self.own = logging.StreamHandler()  # on this process's stderr

    def emit(self, record: logging.LogRecord) -> None:
        root = logging.getLogger()
        for handler in root.handlers or [self.own]:
            if record.levelno >= handler.level:
                handler.handle(record)


def _decide_lightning_logging_late() -> None:
    for name in ("lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        own = [h for h in logger.handlers if type(h) is logging.StreamHandler]
        if own and not logger.propagate:
            for h in own:
                logger.removeHandler(h)
            logger.addHandler(_AsIfImportedNow())


def _main(flags: list[str], script: str, args: list[str], env: dict[str, str], cwd: str, out: _Fd, err: _Fd,
          new_session: bool) -> None:
    """The forked process: become ``python [flags] script args`` and run it to its exit as
    the interpreter would (threads joined, exit hooks run, streams flushed)."""
    if new_session:
        os.setsid()
    # a new interpreter's Ctrl-C (the server ignores it, as its caller may)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in {out, err}:
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    unbuffered = "-u" in flags or bool(env.get("PYTHONUNBUFFERED"))
    sys.stdout = sys.__stdout__ = _stream(1, unbuffered)
    sys.stderr = sys.__stderr__ = _stream(2, True)
    _decide_lightning_logging_late()
    if "faulthandler" in flags:
        import faulthandler

        faulthandler.enable()
    # the path `python script.py` starts with: the script's folder, then PYTHONPATH, then the
    # interpreter's own (not the tests' folder nor the checkout the server was handed)
    here = {harness.TESTS, str(Path(harness.TESTS).parent)}
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(os.path.abspath(script)), *extra,
                   *[p for p in sys.path if p and p not in here and p not in extra]]
    sys.argv = [script, *args]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        if not isinstance(done.code, (int, type(None))):
            print(done.code, file=sys.stderr)
    except BaseException:
        sys.last_type, sys.last_value, sys.last_traceback = sys.exc_info()
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # as the interpreter joins its threads before its exit hooks
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a stream whose reader left
            stream.flush()
    os._exit(code)


class WarmPopen:
    """The part of :class:`subprocess.Popen` the tests use, for a warm run."""

    def __init__(self, cmd: list[str], *, cwd: str | Path, env: dict[str, str] | None = None,
                 stdout=None, stderr=None, text: bool = True, start_new_session: bool = False) -> None:
        flags, script, args = _split([str(c) for c in cmd])
        harness._start_fork_server()
        self.args = cmd
        self.stdout = self.stderr = None
        keep: list[int] = []

        def pipe() -> tuple[int, io.TextIOWrapper]:
            r, w = os.pipe()
            keep.append(w)
            return w, open(r, encoding="utf-8", errors="backslashreplace") if text else open(r, "rb")

        if stdout == subprocess.PIPE:
            out_fd, self.stdout = pipe()
        else:
            out_fd = os.dup(1)
            keep.append(out_fd)
        if stderr == subprocess.STDOUT:
            err_fd = out_fd
        elif stderr == subprocess.PIPE:
            err_fd, self.stderr = pipe()
        else:
            err_fd = os.dup(2)
            keep.append(err_fd)
        ctx = mp.get_context(harness.START_METHOD)
        self._proc = ctx.Process(target=_main, args=(flags, script, args, dict(os.environ if env is None else env),
                                                     str(cwd), _Fd(out_fd), _Fd(err_fd), start_new_session),
                                 daemon=False)
        try:
            self._proc.start()
        finally:
            for fd in keep:  # the process has its copies: end-of-file comes when it (and its ranks) close theirs
                os.close(fd)
        self.pid = self._proc.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self._proc.is_alive():
            self.returncode = self._proc.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        got: dict[str, str] = {}
        readers = [threading.Thread(target=lambda n=n, s=s: got.__setitem__(n, s.read()), daemon=True)
                   for n, s in (("out", self.stdout), ("err", self.stderr)) if s is not None]
        for t in readers:
            t.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        self.wait(timeout)
        for t in readers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        for s in (self.stdout, self.stderr):
            if s is not None:
                s.close()
        return got.get("out"), got.get("err")


def run(cmd: list[str], *, cwd: str | Path, env: dict[str, str] | None = None, timeout: float | None = None,
        capture_output: bool = True, text: bool = True) -> subprocess.CompletedProcess:
    """:func:`subprocess.run` of ``python script.py args``, warm, in a session of its own
    (its ``pid``, kept on the result, names it for :func:`left_behind`)."""
    pipe = subprocess.PIPE if capture_output else None
    proc = WarmPopen(cmd, cwd=cwd, env=env, stdout=pipe, stderr=pipe, text=text, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    done = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    done.pid = proc.pid
    return done


def left_behind(pattern: str, session: int | None = None) -> list[str]:
    """The processes still alive whose command line holds ``pattern`` (a new interpreter's
    ranks repeat its command) or, given ``session``, that are in that session (a warm run's
    ranks carry the fork server's command line, and the run's session is its pid)."""
    found = set(subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split())
    if session is not None:
        found |= set(subprocess.run(["pgrep", "-s", str(session)], capture_output=True, text=True).stdout.split())
    return sorted(pid for pid in found if _alive(pid))


def _alive(pid: str) -> bool:
    """Not a zombie: a rank that ended after its parent did waits for the container's init
    to reap it (pgrep's -s lists it, its empty command line kept -f from ever matching it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
