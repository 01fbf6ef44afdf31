"""``bench/host_overhead.py``: zebra's loopback beside Lightning's own training of the same
model, whole and in R accumulated micro-batches, all in turn in one process."""

import json
import sys

import pytest
import warm_script

from helpers_bench import BENCH, load_bench


@pytest.mark.parametrize("argv, message", [
    (["--steps", "10"], "--steps=10 is invalid: must be > 10"),
    (["--microbatches", "1,x"], "--microbatches='1,x' is invalid: give integers"),
    (["--microbatches", "3"], "--microbatches='3' is invalid: every R must divide the batch of 4"),
    (["--rounds", "0"], "--rounds=0 is invalid: must be >= 1"),
    (["--op-steps", "0"], "--op-steps=0 is invalid: must be 1 to 7 (warm-up steps after the first 3)"),
    (["--op-steps", "8"], "--op-steps=8 is invalid: must be 1 to 7"),
    (["--core", "-2"], "--core=-2 is invalid: give a core this process may run on, or -1 for any"),
])
def test_bad_arguments_are_refused_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit):
        load_bench("host_overhead").main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_every_contender_runs_and_the_ratios_are_theirs(tmp_path):
    out = tmp_path / "host_overhead.json"
    proc = warm_script.run([sys.executable, str(BENCH / "host_overhead.py"), "--steps", "11", "--rounds", "1",
                            "--microbatches", "2", "--core", "-1", "--ops", "--op-steps", "1", "--json", str(out)],
                           cwd=tmp_path, timeout=300)
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


def test_aten_calls_counts_the_ops_no_other_op_called_in_every_thread():
    """Against torch's own event tree (each event's parents) on a small profile: ops in the
    main thread and in another, nested ops and ops inside a non-aten range."""
    import threading

    import torch

    aten_calls = load_bench("host_overhead").aten_calls
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], experimental_config=config)
    a = torch.randn(8, 8)
    with prof:
        b = a @ a + 1  # matmul (calling mm) and add (calling to and copies): 2
        with torch.profiler.record_function("not an op"):
            b.sum()  # 1
        worker = threading.Thread(target=lambda: [torch.nn.functional.linear(a, a) for _ in range(3)])
        worker.start()  # linear (calling t and matmul) 3 times: 3
        worker.join()

    def called_by_aten(e) -> bool:
        p = e.cpu_parent
        while p is not None:
            if p.name.startswith("aten::"):
                return True
            p = p.cpu_parent
        return False

    tree = sum(1 for e in prof.events() if e.name.startswith("aten::") and not called_by_aten(e))
    assert aten_calls(prof) == tree == 6
