"""Before its process group starts, the strategy has gloo connect pairs on first use (unless
the environment says otherwise) and raises its process's limit on open files as far as the
hard limit allows, saying what to run where even that is short of eager connections. Real
limits, in a process of its own; the bench and the whole suite run with the lazy default."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

resource = pytest.importorskip("resource")  # POSIX only

# the module alone, by its path (it imports nothing of the package's): not torch's seconds
MODULE = str(Path(__file__).resolve().parents[1] / "lightning_hetermoe" / "strategy" / "gloo_at_scale.py")
PROBE = """
import importlib.util, resource, sys
spec = importlib.util.spec_from_file_location("gloo_at_scale", sys.argv[3])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
raise_open_files, wanted = module.raise_open_files, module.wanted
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # a low soft limit, as many hosts start with
world = int(sys.argv[1])
said = raise_open_files(world, warn=sys.argv[2] == '1')
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard, wanted(world), repr(said))
"""


def probe(world: int, warn: bool = True) -> tuple[int, int, int, str]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(world), "1" if warn else "0", MODULE],
                         capture_output=True, text=True, check=True)
    soft, hard, want, said = out.stdout.split(" ", 3)
    return int(soft), int(hard), int(want), eval(said)


@pytest.mark.slow  # a process of its own
def test_the_soft_limit_is_raised_to_what_the_world_needs_within_the_hard_limit():
    soft, hard, want, said = probe(64)
    assert want == 64 * 4 + 512
    if hard != resource.RLIM_INFINITY and hard < want:
        pytest.skip(f"this host's hard limit ({hard}) is under {want}")
    assert soft == want and said is None  # raised from 256, no further than asked


@pytest.mark.slow  # a process of its own
def test_a_hard_limit_short_of_the_world_is_raised_to_and_named_with_what_to_run():
    soft, hard, want, said = probe(10**7)
    if hard == resource.RLIM_INFINITY:
        pytest.skip("no hard limit on this host")
    assert soft == hard  # as far as it goes
    assert said is not None and f"may open {hard} files" in said and f"ulimit -n {want}" in said
    soft, _, _, said = probe(10**7, warn=False)  # lazy connections: raised, nothing to say
    assert soft == hard and said is None


def test_gloo_connects_lazily_unless_the_environment_says_otherwise():
    from lightning_hetermoe.strategy.gloo_at_scale import LAZY, connect_lazily

    env: dict[str, str] = {}
    assert connect_lazily(env) and env == {LAZY: "1"}
    env = {LAZY: "0"}
    assert not connect_lazily(env) and env == {LAZY: "0"}  # the user's choice stands
