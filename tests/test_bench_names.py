"""The benchmarks' jobs run with ``bench/`` on ``PYTHONPATH`` (``bench/runs.py``: a job's
callbacks are bench modules, named by ``_target_``). A bench script named like an installed
package would shadow it in every such job: ``bench/kernels.py`` hid the Hugging Face
``kernels`` package, so transformers, finding its metadata, imported the script instead and
every converted-Mixtral job failed as if transformers were missing."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


def test_no_bench_module_shadows_an_importable_name():
    path = [p for p in sys.path if Path(p or ".").resolve() != BENCH]
    clashes = []
    for script in sorted(BENCH.glob("*.py")):
        # a bench module an earlier test imported (a script's own `import runs`) is found in
        # sys.modules first, whatever the path: set aside while the path is searched
        cached = sys.modules.get(script.stem)
        mine = cached is not None and Path(getattr(cached, "__file__", None) or "").resolve().parent == BENCH
        saved, sys.path[:] = list(sys.path), path
        if mine:
            del sys.modules[script.stem]
        try:
            spec = importlib.util.find_spec(script.stem)
        finally:
            sys.path[:] = saved
            if mine:
                sys.modules[script.stem] = cached
        if spec is not None:
            clashes.append(f"bench/{script.name} shadows {spec.origin}")
    assert not clashes, clashes


@pytest.mark.slow
def test_transformers_imports_with_bench_on_the_path_as_a_job_does():
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(BENCH), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", "from transformers import MixtralConfig, MixtralForCausalLM"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
