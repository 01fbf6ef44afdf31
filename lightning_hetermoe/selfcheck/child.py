"""Each check in a fresh child process with a deadline.

One check that hangs (a collective that never completes, a kernel compile that never ends,
a process that will not exit) must not hide the rows after it, and what one check leaves
behind (a CUDA context, threads, a process group, the allocator's state) must not reach
the next. So every check runs in its own child, forked from a fork server that has
imported torch, Lightning and the pack once (a child starts in a fraction of a second,
and the fork server never touched CUDA). The parent never runs a check itself.

The child sets its own environment (the caller's variables, Triton's interpreter on CPU,
Lightning's banners muted), runs the check, sends its row and ends with ``os._exit``: no
interpreter finalization, where a leftover thread could hang or abort. The parent waits
for the row until the check's deadline; past it the child is asked for its Python stacks
(SIGUSR1, faulthandler: they land in the check's stderr) and killed, and the row says FAIL,
"timed out after N s". A child that dies before sending its row gives a FAIL row with its
exit code or signal and the tail of its stderr. A child that sent its row but does not
exit within ``EXIT_GRACE_S`` is killed; its row stands. Every row carries its seconds.

A check from the registry (``CHECKS``) travels by name; any other (tests inject their own)
travels pickled, so its function must be importable by name (a module-level function).

The fork server and its resource tracker are started with standard output and error on
the null device: they outlive the command by the seconds their own exit takes, and must not
hold the command's pipes open meanwhile (a caller reading them would wait). Each child
writes its stderr to the check's file, which the command copies to its own.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import time
from dataclasses import asdict
from multiprocessing import forkserver
from pathlib import Path
from typing import Any, Iterator, Sequence

from .report import FAIL, Check, Context, Row, run_check

EXIT_GRACE_S = 5.0  # how long a child that sent its row may take to exit
STACKS_S = 1.0  # how long a child past its deadline has to write its Python stacks
PRELOAD = ["torch", "lightning", "lightning_hetermoe"]
TAIL_LINES = 6


def _context() -> Any:
    """The fork-server context, its server importing what every check needs (added to what
    other users of the fork server in this process asked for)."""
    ctx = multiprocessing.get_context("forkserver")
    have = list(getattr(getattr(forkserver, "_forkserver", None), "_preload_modules", None) or [])
    ctx.set_forkserver_preload(have + [m for m in PRELOAD if m not in have])
    return ctx


def _nothing() -> None:
    pass


def start_server() -> None:
    """Start the fork server now and wait for it to import torch, Lightning and the pack
    (seconds; one empty child is forked once it has), so that no row's seconds count it."""
    ctx = _context()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = [os.dup(1), os.dup(2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        forkserver.ensure_running()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)
    warm = ctx.Process(target=_nothing)
    warm.start()
    warm.join()


@contextlib.contextmanager
def environment(device_type: str) -> Iterator[None]:
    """For a check's duration: Triton's interpreter on CPU (the kernels read the variable
    per launch, so a scoped setting is enough), and Lightning's banners and the
    dependencies' noise muted (the child ends with the check)."""
    from ..quiet import mute_dependency_noise

    mute_dependency_noise()
    saved = os.environ.get("TRITON_INTERPRET")
    if device_type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    loggers = [logging.getLogger(n) for n in ("lightning", "lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


def _child(conn: Any, ref: str | Check, device_choice: str, quick: bool, workdir: str, env: dict[str, str],
           stderr_path: str) -> None:
    """In the child: the caller's environment, stderr into the check's file, the row to
    the parent, then out without finalization."""
    code = 0
    try:
        with open(stderr_path, "ab", buffering=0) as err:
            os.dup2(err.fileno(), 2)
        faulthandler.enable()
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        os.environ.clear()
        os.environ.update(env)
        from .registry import CHECKS, resolve_device

        check = ref if isinstance(ref, Check) else next(c for c in CHECKS if c.name == ref)
        device = resolve_device(device_choice)
        with environment(device.type):
            row = run_check(check, Context(device=device, quick=quick, workdir=workdir))
        conn.send(asdict(row))
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _tail(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-TAIL_LINES:])


def _echo(path: Path) -> None:
    """What the child wrote to stderr (warnings, tracebacks, stacks), on the parent's."""
    with contextlib.suppress(OSError):
        text = path.read_text(errors="replace")
        if text:
            sys.stderr.write(text if text.endswith("\n") else text + "\n")
            sys.stderr.flush()


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _stop(proc: Any, stacks: bool) -> None:
    """Kill the child (asking it for its stacks first, where it hung)."""
    if proc.is_alive() and stacks:
        with contextlib.suppress(OSError):
            os.kill(proc.pid, signal.SIGUSR1)
        proc.join(STACKS_S)
    if proc.is_alive():
        proc.kill()
    proc.join()


def run_in_child(check: Check, registry: Sequence[Check], device_choice: str, quick: bool, workdir: str,
                 timeout_s: float) -> Row:
    """Run ``check`` in a fresh child with a deadline of ``timeout_s``; its row and seconds."""
    ctx = _context()
    ref: str | Check = check.name if any(c is check for c in registry) else check
    safe = "".join(ch if ch.isalnum() else "_" for ch in check.name)
    stderr_path = Path(workdir) / f"{safe}.stderr"
    stderr_path.write_bytes(b"")
    started = time.monotonic()
    try:
        pickle.dumps(ref)
    except Exception as err:
        return Row(check.name, FAIL, f"cannot start in a child process ({type(err).__name__}: {err}); a check "
                                     f"outside the registry must be a module-level function", 0.0)
    receive, send = ctx.Pipe(duplex=False)
    # not daemonic: a check may start processes of its own (a daemonic one may not)
    proc = ctx.Process(target=_child, name=f"selfcheck {check.name}",
                       args=(send, ref, device_choice, quick, workdir, dict(os.environ), str(stderr_path)))
    proc.start()
    send.close()
    try:
        row = _wait_for_row(receive, proc, check.name, started, timeout_s, stderr_path)
    finally:
        if proc.is_alive():  # interrupted (Ctrl-C): no child outlives the command
            proc.kill()
            proc.join()
        receive.close()
        _echo(stderr_path)
    row.seconds = round(time.monotonic() - started, 1)
    return row


def _wait_for_row(receive: Any, proc: Any, name: str, started: float, timeout_s: float, stderr_path: Path) -> Row:
    left = started + timeout_s - time.monotonic()
    if receive.poll(max(left, 0.0)):
        try:
            data = receive.recv()
        except (EOFError, OSError):
            data = None  # the child died before sending its row
        if data is not None:
            proc.join(EXIT_GRACE_S)
            _stop(proc, stacks=False)  # the row stands, whatever held the child's exit
            return Row(**data)
        proc.join(EXIT_GRACE_S)
        _stop(proc, stacks=False)
        tail = _tail(stderr_path)
        return Row(name, FAIL, f"the check's process ended with {_exit_text(proc.exitcode)} before reporting"
                               + (f": {tail}" if tail else ""))
    _stop(proc, stacks=True)
    return Row(name, FAIL, f"timed out after {timeout_s:g} s (killed; its stacks are on stderr)")
