"""A process launcher that is safe under Hydra multirun."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any, Callable

import torch.distributed as dist
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher


def hydra_job_command(local_rank: int) -> tuple[list[str], str]:
    """The command that re-runs *this one Hydra job* in a child process.

    Lightning's default re-runs ``sys.argv``, which under ``-m`` re-runs the whole sweep in
    every child. Here the child gets the current job's own overrides (``overrides.task``),
    no ``-m``, and the job's output directory as its run dir.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import get_original_cwd, to_absolute_path

    import __main__

    hc = HydraConfig.get()
    if __main__.__spec__ is None:
        command = [sys.executable, to_absolute_path(sys.argv[0])]
    else:
        command = [sys.executable, "-m", __main__.__spec__.name]
    if hc.job.config_name:
        command += [f"--config-name={hc.job.config_name}"]
    for source in hc.runtime.config_sources:
        if source.provider == "command-line":
            command += [f"--config-dir={source.path}"]
    command += list(hc.overrides.task)
    command += [
        f'hydra.run.dir="{hc.runtime.output_dir}"',
        f"hydra.job.name={hc.job.name}_rank{local_rank}",
        "hydra.output_subdir=null",
        "hydra/job_logging=none",
        "hydra/hydra_logging=none",
    ]
    return command, get_original_cwd()


def _hydra_in_use() -> bool:
    try:
        from hydra.core.hydra_config import HydraConfig
    except ImportError:
        return False
    return HydraConfig.initialized()


_JOB_MARK = "HETERMOE_HYDRA_JOB"
_LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")
_children_of_job: list[subprocess.Popen] = []


def _leave_previous_job() -> None:
    """In the sweep's own process, a new Hydra job must not inherit the last job's world.

    Lightning marks "processes already exist" through LOCAL_RANK & co. in ``os.environ``
    and keeps the process group alive, so that fit-then-validate inside one job reuses
    them. When the Hydra job changes (multirun), those belong to a finished job: reap its
    children, destroy its process group, drop its variables. Children carry the mark of
    their own job, so they never take this path.
    """
    from hydra.core.hydra_config import HydraConfig

    job = HydraConfig.get().runtime.output_dir
    previous = os.environ.get(_JOB_MARK)
    if previous is not None and previous != job:
        for proc in _children_of_job:
            proc.wait()
        _children_of_job.clear()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        for var in _LAUNCH_VARS:
            os.environ.pop(var, None)
    os.environ[_JOB_MARK] = job


class HydraAwareScriptLauncher(_SubprocessScriptLauncher):
    """Subprocess launcher that re-runs only the current Hydra job in each child, and
    starts every job of a multirun sweep from a clean slate."""

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if _hydra_in_use():
            _leave_previous_job()
        return super().launch(function, *args, trainer=trainer, **kwargs)

    def _call_children_scripts(self) -> None:
        if not _hydra_in_use():
            return super()._call_children_scripts()
        self._check_can_spawn_children()
        env = self.cluster_environment
        os.environ["MASTER_ADDR"] = env.main_address
        os.environ["MASTER_PORT"] = str(env.main_port)
        os.environ["NODE_RANK"] = str(env.node_rank())
        os.environ["LOCAL_RANK"] = str(env.local_rank())
        os.environ["WORLD_SIZE"] = f"{self.num_processes * self.num_nodes}"
        for local_rank in range(1, self.num_processes):
            child_env = os.environ.copy()
            child_env["LOCAL_RANK"] = str(local_rank)
            command, cwd = hydra_job_command(local_rank)
            proc = subprocess.Popen(command, env=child_env, cwd=cwd)
            self.procs.append(proc)
            _children_of_job.append(proc)
