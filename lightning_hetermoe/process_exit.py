"""Ending the pack's own commands (the recipes, the self-check) without the interpreter's
finalization, whose garbage collections walk every object torch and Lightning made, twice:
seconds of CPU after the last line is out, seconds a job's other ranks spend waiting on a
collective for this one to go.

This module imports nothing heavy, so a recipe can wrap its ``main`` before it knows whether
the run gets past its config (a config error then answers without Lightning or torch loaded).
What must be left before the process ends (the heartbeat, the watcher threads, the process
group) is registered here by the modules that start it, when they are imported: a process
that never loaded them has nothing of theirs to leave.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

_leaving: list[Callable[[], None]] = []
_failing: list[Callable[[], None]] = []


def when_leaving(hook: Callable[[], None]) -> None:
    """Run ``hook`` in :func:`exit_now`, before the process ends (once, however often given)."""
    if hook not in _leaving:
        _leaving.append(hook)


def when_failing(hook: Callable[[], None]) -> None:
    """Run ``hook`` in :func:`run_and_exit` when the command failed, before the leaving hooks."""
    if hook not in _failing:
        _failing.append(hook)


def exit_now(code: int = 0) -> None:
    """End a command whose work is done and written: run the leaving hooks, flush, and exit
    without finalization."""
    import logging

    for hook in _leaving:
        hook()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def run_and_exit(main: Callable[[], Any]) -> None:
    """Run a command and end the process through :func:`exit_now`, whether its work
    finished or failed. A ``main`` that returns an int returns its exit code (as under
    ``sys.exit(main())``); any other return is 0. A failure is reported as the interpreter
    would report it (the traceback, or a ``SystemExit`` message) with its exit code (1 for an
    uncaught error; a Ctrl-C outside Lightning's loop too, where the interpreter would end on
    SIGINT)."""
    try:
        result = main()
        code = result if isinstance(result, int) and not isinstance(result, bool) else 0
    except SystemExit as done:
        code = done.code
        if code is None:
            code = 0
        elif not isinstance(code, int):  # a message: printed, exit code 1, as the interpreter does
            print(code, file=sys.stderr)
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    if code:
        for hook in _failing:
            hook()
    exit_now(code)


def exit_saying(line: str) -> SystemExit:
    """The ``SystemExit`` a command raises to end on ``line`` (exit code 1). In a job whose
    ranks all meet the same error (a config error found inside the fit), the first rank to
    say it says it and the others end quietly, where each printed it (the job's store
    counts who said it: :func:`lightning_hetermoe.comm.first_to_say`)."""
    if "torch.distributed" not in sys.modules:  # no job yet: nobody else to say it
        return SystemExit(line)
    from .comm import first_to_say

    return SystemExit(line if first_to_say(line) else 1)
