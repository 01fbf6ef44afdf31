"""``bench/host_overhead.py``: zebra's loopback beside Lightning's own training of the same
model, whole and in R accumulated micro-batches, all in turn in one process."""

import json
import subprocess
import sys

import pytest

from helpers_bench import BENCH, load_bench


@pytest.mark.parametrize("argv, message", [
    (["--steps", "10"], "--steps=10 is invalid: must be > 10"),
    (["--microbatches", "1,x"], "--microbatches='1,x' is invalid: give integers"),
    (["--microbatches", "3"], "--microbatches='3' is invalid: every R must divide the batch of 4"),
    (["--rounds", "0"], "--rounds=0 is invalid: must be >= 1"),
    (["--op-steps", "0"], "--op-steps=0 is invalid: must be >= 1"),
    (["--core", "-2"], "--core=-2 is invalid: give a core this process may run on, or -1 for any"),
])
def test_bad_arguments_are_refused_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit):
        load_bench("host_overhead").main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_every_contender_runs_and_the_ratios_are_theirs(tmp_path):
    out = tmp_path / "host_overhead.json"
    proc = subprocess.run([sys.executable, str(BENCH / "host_overhead.py"), "--steps", "11", "--rounds", "1",
                           "--microbatches", "2", "--core", "-1", "--ops", "--op-steps", "1",
                           "--json", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == result
    ms = result["ms_per_step"]
    assert set(ms) == {"lightning", "hetermoe", "lightning x2", "zebra 2"} and all(v > 0 for v in ms.values())
    calls = result["aten_calls_per_step"]
    assert result["ratios"] == pytest.approx({"hetermoe / lightning": ms["hetermoe"] / ms["lightning"],
                                              "zebra 2 / lightning x2": ms["zebra 2"] / ms["lightning x2"],
                                              "zebra 2 / lightning x2 aten calls": calls["zebra 2"] / calls["lightning x2"]})
    assert result["shape"]["steps"] == 11 and "zebra 2 / lightning x2:" in proc.stdout
    # the counts: every fiber's ops seen (zebra's two micro-batches run in threads of their
    # own), the single-device strategy adds none to Lightning's step, two micro-batches make
    # about twice one's calls, and zebra's exchange adds its own to Lightning's in two
    assert set(calls) == set(ms) and calls["hetermoe"] == calls["lightning"] > 100
    assert 1.5 < calls["lightning x2"] / calls["lightning"] < 2.5
    assert calls["zebra 2"] > calls["lightning x2"]
