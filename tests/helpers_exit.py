"""Running a command to its exit and timing how long its processes outlive their work
(issue #38: every entry point exits within a few seconds of its work ending)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import lightning as L
from warm_script import WarmPopen

EXIT_S = 5.0  # from the marker that says the work ended to the last process of the job gone
ROOT = Path(__file__).resolve().parents[1]


def start_main_job(tmp_path: Path, *overrides: str, warm: bool = False) -> subprocess.Popen:
    """The main job (two CPU ranks, ep) in a process group of its own, as a terminal's
    foreground job or a scheduler's task (SIGINT at its default, which a shell's background
    job would not have), its output merged into one text pipe, read as it comes. ``warm``:
    forked from the tests' fork server (:mod:`warm_script`), not a new interpreter."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "TRITON_INTERPRET")}
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [sys.executable, str(ROOT / "recipes" / "train.py"), "cluster=cpu2", "strategy.mode=ep",
           f"hydra.run.dir={tmp_path}", *overrides]
    if warm:
        return WarmPopen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def run_to_exit(cmd: list[str], marker: str, cwd: Path, timeout: float = 240.0, warm: bool = False
                ) -> tuple[int, str, float]:
    """Run ``cmd``; its exit code, its output, and the seconds from the first line holding
    ``marker`` to the moment every process of the job is gone (the launched ranks hold the
    same pipes: both reach end-of-file only when the last of them exits). ``warm``: a Python
    script's command forked from the tests' fork server (:mod:`warm_script`)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "TRITON_INTERPRET")}
    env["PYTHONUNBUFFERED"] = "1"
    start = WarmPopen if warm else subprocess.Popen
    proc = start(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    marked: list[float] = []

    def pump(stream) -> None:
        for text in stream:
            if marker in text and not marked:
                marked.append(time.monotonic())
            lines.append(text)

    pumps = [threading.Thread(target=pump, args=(s,), daemon=True) for s in (proc.stdout, proc.stderr)]
    for t in pumps:
        t.start()
    try:
        proc.wait(timeout=timeout)
        for t in pumps:
            t.join(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    gone = time.monotonic()
    out = "".join(lines)
    assert marked, f"no {marker!r} in the output:\n{out[-3000:]}"
    return proc.returncode, out, gone - marked[0]


class Job:
    """The main job in a session of its own (a terminal's foreground job): its output line by
    line with the moment each came, and the moment its first child process was seen."""

    def __init__(self, tmp_path: Path, *overrides: str, warm: bool = False) -> None:
        self.proc = start_main_job(tmp_path, *overrides, warm=warm)
        self.lines: list[tuple[float, str]] = []
        self.children: set[int] = set()
        self.child_seen: float | None = None
        self.commands: dict[int, list[str]] = {}  # each child's command line, as last seen
        self.running: dict[int, list[str]] = {}  # the children running at the last look, by command line
        # the launcher's own command line (a warm run's is its fork server's): a child forked
        # from it has the same one
        self.own_command: list[str] | None = None
        self._pump = threading.Thread(target=self._read, daemon=True)
        self._pump.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    def watch_children(self, until: float, done: Callable[[], bool] = lambda: False) -> None:
        """Note the launcher's children (and their command lines) every 10 ms until ``until``,
        its exit, or ``done()``."""
        path = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        if self.own_command is None:
            try:
                self.own_command = Path(f"/proc/{self.proc.pid}/cmdline").read_text().split("\0")[:-1]
            except OSError:
                pass
        while time.monotonic() < until and self.proc.poll() is None and not done():
            try:
                kids = {int(pid) for pid in path.read_text().split()}
            except (OSError, ValueError):
                kids = set()
            if kids and self.child_seen is None:
                self.child_seen = time.monotonic()
            self.children |= kids
            running = {}
            for pid in kids:
                try:
                    command = Path(f"/proc/{pid}/cmdline").read_text().split("\0")[:-1]
                except OSError:
                    continue
                if command:  # empty once it has exited and waits to be reaped
                    running[pid] = command
            self.commands |= running
            self.running = running
            time.sleep(0.01)

    def first(self, text: str) -> float | None:
        return next((t for t, line in self.lines if text in line), None)

    def finish(self, timeout: float = 120.0) -> tuple[int, str]:
        try:
            code = self.proc.wait(timeout=timeout)
            self._pump.join(timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
        return code, "".join(line for _, line in self.lines)

    def alive_children(self) -> list[int]:
        alive = []
        for pid in self.children:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                alive.append(pid)
        return alive


class SigtermInFinalValidation(L.Callback):
    """For the main job's ``+callbacks.<name>._target_``: rank 0 gets a real SIGTERM as the
    validation after training starts its second batch."""

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if trainer.global_rank == 0 and trainer.state.fn == "validate" and batch_idx == 1:
            os.kill(os.getpid(), signal.SIGTERM)
