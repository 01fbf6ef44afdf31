"""``bench/fiber_threads.py``: zebra's micro-batch threads at one intra-op thread beside the
rank's count, both run in turn in one process."""

import json
import subprocess
import sys

import pytest

from helpers_bench import BENCH, load_bench


@pytest.mark.parametrize("argv, message", [
    (["--steps", "10"], "--steps=10 is invalid: must be > 10"),
    (["--microbatches", "1,x"], "--microbatches='1,x' is invalid: give integers"),
    (["--microbatches", "0"], "--microbatches='0' is invalid: every R must be >= 1"),
    (["--threads", "0"], "--threads=0 is invalid: must be >= 1"),
])
def test_bad_arguments_are_refused_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit):
        load_bench("fiber_threads").main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_both_settings_run_and_the_ratio_is_theirs(tmp_path):
    out = tmp_path / "fiber_threads.json"
    # a new interpreter: two threads' fit in a process forked from the tests' fork server ran
    # 2-3x slower in the full suite (20-31 s against 10 s), though not alone
    proc = subprocess.run([sys.executable, str(BENCH / "fiber_threads.py"), "--threads", "2", "--steps", "11",
                           "--rounds", "1", "--microbatches", "1", "--json", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["threads"] == 2 and json.loads(proc.stdout.strip().splitlines()[-1]) == result
    (row,) = result["rows"]
    one, own = row["step_s"]["one thread"], row["step_s"]["rank's count"]
    assert row["microbatches"] == 1 and one > 0 and own > 0
    assert row["rank_count_over_one"] == pytest.approx(own / one)
    assert "R=1 at 2 threads: one thread" in proc.stdout
