"""Real multi-process runs for tests, started once and reused for several fits.

``run_ranks(world, fn, *args)`` starts ``world`` processes (forked by a fork server that
imported torch, Lightning and the pack once) and sets the variables torchrun would
(``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``NODE_RANK``).
Lightning then sees processes that were created externally and launches none of its own,
so each rank may run several ``Trainer.fit`` calls in one start (gloo process group and
all). ``fn(rank, *args)`` runs in every rank; the return values come back in rank order. A
rank that raises fails the call with its traceback; a run that outlives ``timeout`` is
killed and fails.
"""

from __future__ import annotations

import os
import pickle
import random
import socket
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


# A fork server that has imported torch, Lightning and the pack once starts each rank in a
# fraction of a second, where spawn re-imports them in every rank of every test (seconds
# each). It also imports what every rank would otherwise import for itself: pytest, which
# each test module a rank unpickles its function from imports (0.2 s of CPU a rank, 13 s a
# full run), omegaconf (the configs' reader) and the zebra tests' helpers. The server
# forks before any test touches a process group or a thread pool; its last preload freezes
# what it imported out of the ranks' garbage collections.
START_METHOD = "forkserver"
mp.set_forkserver_preload(["torch", "lightning", "lightning_hetermoe", "pytest", "omegaconf", "harness", "reference",
                           "helpers_zebra", "preload_end"])
TESTS = str(Path(__file__).resolve().parent)


def _start_fork_server() -> None:
    """Start this process's fork server (once) with the tests' folder on its path: Python
    3.11's server imports its preloads on the path of a bare ``python -c`` (it is handed the
    caller's ``sys.path`` but does not apply it), where the tests' own modules, and with
    them ``preload_end``, are not found and are silently skipped."""
    from multiprocessing import forkserver

    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([TESTS, before] if before else [TESTS])
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port rank 0's store can listen on: a free one below the kernel's ephemeral range.
    A port the kernel hands out (binding port 0) is in that range, where every outgoing
    connection takes its local port, gloo's among them: in the seconds before the rank
    binds it, another test's connection could take it (EADDRINUSE, seen once in CI)."""
    low = _ephemeral_low()
    rng = random.Random()  # os.urandom's seed: parallel test workers draw apart
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # nothing free below the range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# the caller's settings every rank gets (the fork server's environment is its first caller's):
# HETERMOE_STANDIN runs the ranks on the stand-in device; PYTHONPATH is the caller's, not the
# server's (which had the tests' folder added for its preloads)
FORWARDED = ("HETERMOE_STANDIN", "PYTHONPATH")


def _entry(rank: int, world: int, port: int, outdir: str, fn: Callable, args: tuple,
           forwarded: dict[str, str] | None = None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0", PL_DISABLE_FORK="1")
    for name in FORWARDED:
        if forwarded and name in forwarded:
            os.environ[name] = forwarded[name]
        else:
            os.environ.pop(name, None)
    torch.set_num_threads(1)
    path = Path(outdir) / f"rank{rank}.pkl"
    try:
        result = fn(rank, *args)
        from lightning_hetermoe import standin

        with open(path, "wb") as f:
            torch.save({"ok": result, "standin": standin.DEVICE.type != "cpu"}, f)
        # Leave the heartbeat (stopped and joined: no peer's beat then finds rank 0's store
        # gone) and the process group together, as the strategy's shutdown() does for the
        # recipes.
        from lightning_hetermoe.strategy import heartbeat

        heartbeat.stop()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
    except BaseException:
        with open(path, "wb") as f:
            pickle.dump({"error": traceback.format_exc()}, f)
        raise


def run_ranks(world: int, fn: Callable, *args: Any, timeout: float = 240.0) -> list[Any]:
    with tempfile.TemporaryDirectory(prefix="ranks_") as outdir:
        forwarded = {name: os.environ[name] for name in FORWARDED if name in os.environ}
        _start_fork_server()
        ctx = mp.start_processes(_entry, args=(world, free_port(), outdir, fn, args, forwarded), nprocs=world,
                                 join=False, start_method=START_METHOD)
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world}-rank run did not finish in {timeout:.0f} s")
        except mp.ProcessRaisedException as err:
            errors = []
            for r in range(world):
                p = Path(outdir) / f"rank{r}.pkl"
                if p.exists():
                    with open(p, "rb") as f:
                        try:
                            rec = pickle.load(f)
                        except Exception:
                            continue
                    if isinstance(rec, dict) and "error" in rec:
                        errors.append(f"--- rank {r} ---\n{rec['error']}")
            raise RuntimeError("\n".join(errors) or str(err)) from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for name in ctx.error_files:  # torch writes a failed rank's there and never removes it
                if name and os.path.exists(name):
                    os.unlink(name)
        records = [torch.load(Path(outdir) / f"rank{r}.pkl", weights_only=False) for r in range(world)]
        if forwarded.get("HETERMOE_STANDIN", "") not in ("", "0"):
            off = [r for r, rec in enumerate(records) if not rec["standin"]]
            if off:  # a check on the stand-in that never ran there would pass vacuously
                raise AssertionError(f"HETERMOE_STANDIN is set but ranks {off} never computed on the stand-in")
        return [rec["ok"] for rec in records]
