"""The GPU self-check's CPU side: the command as CI runs it (gloo, Triton's interpreter,
CUDA-only checks skipped), and the report's rules (a check that raises is a FAIL row, the
others still run, the exit code says so)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers_exit import EXIT_S, run_to_exit
from lightning_hetermoe import selfcheck

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("selfcheck") / "out.json"
    # through the recipe, which runs the module's main: both commands users are told about;
    # timed to its exit (issue #38: every entry point exits within seconds of its work)
    code, output, exit_after_s = run_to_exit([sys.executable, "recipes/gpu_selfcheck.py", "--device", "cpu",
                                              "--quick", "--json", str(out)], "selfcheck passed", cwd=ROOT,
                                             timeout=300)
    proc = SimpleNamespace(returncode=code, stdout=output, stderr=output, exit_after_s=exit_after_s)
    return proc, json.loads(out.read_text()) if out.exists() else None


def interpreter_reason() -> str:
    """Why Triton's interpreter cannot run the kernels here ('' where it can)."""
    from lightning_hetermoe.kernels.availability import unavailable_reason

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        return unavailable_reason("cpu")


@pytest.mark.slow
def test_the_cpu_run_passes_and_reports_every_check(cpu_run):
    proc, report = cpu_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report is not None, proc.stdout + proc.stderr
    assert report["complete"] is True  # written after each row (complete False) and at the end
    rows = {r["check"]: r for r in report["rows"]}
    assert list(rows) == [c.name for c in selfcheck.CHECKS]
    for check in selfcheck.CHECKS:
        if check.cuda_only:
            assert rows[check.name]["result"] == "skipped" and "no CUDA" in rows[check.name]["detail"]
    assert rows["collectives ep"]["result"] == "ok" and "ep.rows" in rows["collectives ep"]["detail"]
    assert rows["collectives zebra"]["result"] == "ok" and "zebra.rows" in rows["collectives zebra"]["detail"]
    assert rows["memory"]["result"] == "ok", rows["memory"]
    assert rows["memory in R"]["result"] == "ok" and "R=8" in rows["memory in R"]["detail"], rows["memory in R"]
    wire = rows["wire dtype"]
    assert wire["result"] == "ok" and "ep.rows" in wire["detail"] and "zebra.rows" in wire["detail"], wire
    assert "float32" not in wire["detail"]
    sync = rows["gradient sync memory"]  # on CPU the sync runs and is checked; the peak needs CUDA
    assert sync["result"] == "skipped" and "every gradient intact" in sync["detail"], sync
    # triton ships with the dev environment: the interpreter ran the kernels on every dtype,
    # or, where this triton's interpreter cannot run, the rows say why
    interpreter = interpreter_reason()
    for name in ("kernels fp32", "kernels bf16", "kernels fp16", "kernels tma bf16"):
        if interpreter:
            assert rows[name]["result"] == "skipped" and rows[name]["detail"] == interpreter, rows[name]
        else:
            assert rows[name]["result"] == "ok", rows[name]
    assert rows["kernels tma bf16"]["detail"].startswith("TMA loads: ") or interpreter
    assert "selfcheck passed" in proc.stdout
    assert proc.exit_after_s < EXIT_S and "terminate called" not in proc.stdout
    for row in report["rows"]:  # the table printed each row
        assert row["check"] in proc.stdout


def test_every_check_is_documented_in_the_readme_and_the_first_gpu_run_page():
    readme = (ROOT / "README.md").read_text()
    page = (ROOT / "docs" / "first_gpu_run.md").read_text()
    assert "docs/first_gpu_run.md" in readme
    for check in selfcheck.CHECKS:
        name = check.name.replace(" fp32", "").replace(" bf16", "").replace(" fp16", "")
        assert f"`{name}" in readme, check.name
        assert f"`{name}" in page, check.name


def _fine(ctx):
    return "all good"


def _boom(ctx):
    raise RuntimeError("the engine caught fire")


def _skips(ctx):
    raise selfcheck.Skip("not here")


def _hangs(ctx):
    import time

    time.sleep(3600)  # a collective that never completes, a compile that never ends


def _dies(ctx):
    sys.stderr.write("about to lose the process\n")
    sys.stderr.flush()
    os._exit(7)  # a crash: no row, no exception


def _environment_seen(ctx):
    return f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')} pid={os.getpid()}"


@pytest.mark.slow
def test_a_check_that_raises_is_a_fail_row_and_the_others_still_run(capsys, tmp_path):
    checks = [selfcheck.Check("fine", _fine), selfcheck.Check("boom", _boom), selfcheck.Check("skips", _skips),
              selfcheck.Check("gpu only", _fine, cuda_only=True)]
    out = tmp_path / "rows.json"
    code = selfcheck.run(selfcheck.parse_args(["--device", "cpu", "--json", str(out)]), checks)
    assert code == 1
    rows = {r["check"]: r for r in json.loads(out.read_text())["rows"]}
    assert {k: v for k, v in rows["fine"].items() if k != "seconds"} == {"check": "fine", "result": "ok",
                                                                         "detail": "all good"}
    assert rows["boom"]["result"] == "FAIL" and rows["boom"]["detail"] == "RuntimeError: the engine caught fire"
    assert rows["skips"]["result"] == "skipped" and rows["gpu only"]["result"] == "skipped"
    assert rows["gpu only"]["seconds"] == 0.0  # skipped without starting a process
    printed = capsys.readouterr().out
    assert "boom" in printed and "FAIL" in printed and "1 failed" in printed
    assert os.environ.get("TRITON_INTERPRET") is None, "the interpreter setting must not outlive the run"


@pytest.mark.slow
def test_a_hung_check_is_killed_at_its_deadline_and_the_rows_after_it_still_run(capsys, tmp_path):
    checks = [selfcheck.Check("env", _environment_seen), selfcheck.Check("hangs", _hangs, timeout_s=3.0),
              selfcheck.Check("dies", _dies), selfcheck.Check("fine", _fine)]
    out = tmp_path / "rows.json"
    code = selfcheck.run(selfcheck.parse_args(["--device", "cpu", "--json", str(out)]), checks)
    assert code == 1
    rows = {r["check"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["env", "hangs", "dies", "fine"]
    # a fresh process per check, with the environment the checks had in one process
    assert rows["env"]["result"] == "ok" and "TRITON_INTERPRET=1" in rows["env"]["detail"]
    assert f"pid={os.getpid()}" not in rows["env"]["detail"]
    hung = rows["hangs"]
    assert hung["result"] == "FAIL" and hung["detail"].startswith("timed out after 3 s"), hung
    assert 3.0 <= hung["seconds"] < 30.0, hung
    died = rows["dies"]
    assert died["result"] == "FAIL" and "exit code 7" in died["detail"], died
    assert "about to lose the process" in died["detail"], died  # the tail of its stderr
    assert rows["fine"]["result"] == "ok"
    assert all(isinstance(r["seconds"], float) and r["seconds"] >= 0 for r in rows.values())
    captured = capsys.readouterr()
    table = captured.out.splitlines()
    assert table[0].split() == ["check", "result", "seconds", "detail"]
    printed = {ln.split()[0]: ln.split() for ln in table[2:6]}
    assert printed["hangs"][1:3] == ["FAIL", f"{hung['seconds']:.1f}"]
    assert "_hangs" in captured.err  # the hung child's Python stacks, dumped before the kill
    # --timeout overrides every check's own deadline
    code = selfcheck.run(selfcheck.parse_args(["--device", "cpu", "--timeout", "2", "--only", "h"]),
                         [selfcheck.Check("hangs", _hangs)])
    assert code == 1 and "timed out after 2 s" in capsys.readouterr().out


@pytest.mark.slow
def test_skips_alone_exit_zero_and_only_selects_by_prefix(capsys):
    checks = [selfcheck.Check("fine", _fine), selfcheck.Check("boom", _boom), selfcheck.Check("skips", _skips)]
    assert selfcheck.run(selfcheck.parse_args(["--device", "cpu", "--only", "s"]), checks) == 0
    assert selfcheck.run(selfcheck.parse_args(["--device", "cpu", "--only", "nothing"]), checks) == 2
    assert "boom" not in capsys.readouterr().out


def test_the_stream_verdict_on_a_synthetic_trace():
    compute = [("void gemm_kernel", 7)] * 5 + [("triton_grouped_gemm", 7)]
    apart = compute + [("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage)", 13)] * 4
    assert "all-to-all on streams {13: 4}" in selfcheck.judge_streams(apart)
    with pytest.raises(selfcheck.Failed, match="ran on the compute stream"):
        selfcheck.judge_streams(compute + [("ncclDevKernel_SendRecv", 7)])
    with pytest.raises(selfcheck.Failed, match="no NCCL all-to-all kernel"):
        selfcheck.judge_streams(compute + [("ncclDevKernel_Broadcast_RING_LL", 13)])


def _call(what, dtype):
    from lightning_hetermoe.comm import Call

    return Call("world", (0,), "device", "all_to_all", what, 0, dtype, (4, 16))


def test_the_wire_verdict_wants_every_row_in_the_priced_16_bit_type():
    import torch

    rows = [_call("zebra.rows", "torch.bfloat16"), _call("zebra.answers", "torch.bfloat16"),
            _call("zebra.grads.dense", "torch.float32"), _call("zebra.weights", "torch.float32")]
    assert "zebra.rows 1x bfloat16" in selfcheck.judge_wire(rows, "zebra", torch.bfloat16, 2)
    with pytest.raises(selfcheck.Failed, match="ep.rows sent torch.float32"):  # item 3's defect: fp32 rows
        selfcheck.judge_wire([_call("ep.rows", "torch.bfloat16"), _call("ep.rows", "torch.float32")], "ep",
                             torch.bfloat16, 2)
    with pytest.raises(selfcheck.Failed, match="no ep.rows collective"):
        selfcheck.judge_wire(rows, "ep", torch.bfloat16, 2)
    with pytest.raises(selfcheck.Failed, match="prices rows at 4 B"):
        selfcheck.judge_wire(rows, "zebra", torch.bfloat16, 4)


def test_the_gradient_sync_verdict_tells_one_bucket_from_a_flat_copy():
    cap, dense = 600_000, 2_600_000
    assert "5 buckets" in selfcheck.judge_sync_peak(cap, cap, dense, 5)
    with pytest.raises(selfcheck.Failed, match="peak 2,600,000 B"):  # a flat buffer of every gradient
        selfcheck.judge_sync_peak(dense, cap, dense, 5)
    with pytest.raises(selfcheck.Failed, match="cannot tell"):  # one bucket holds it all: vacuous
        selfcheck.judge_sync_peak(0, cap, cap, 1)


def test_the_memory_in_r_verdict_refuses_growth_and_empty_measures():
    assert "R=8 110 B" in selfcheck.judge_flat_in_r({2: 100, 4: 105, 8: 110}, "held")
    with pytest.raises(selfcheck.Failed, match="R=8 needs 4.00x R=2"):  # R cast copies of the weights
        selfcheck.judge_flat_in_r({2: 100, 4: 200, 8: 400}, "CUDA peak")
    with pytest.raises(selfcheck.Failed, match="nothing measured"):
        selfcheck.judge_flat_in_r({2: 0, 8: 0}, "held")


def test_the_autotuning_verdict_and_its_listener_on_the_real_triton_knobs():
    pytest.importorskip("triton")
    from triton import knobs

    if not hasattr(knobs.autotuning, "listener"):  # triton 3.6 has none: the check skips itself, named
        with pytest.raises(selfcheck.Skip, match="no autotuning listener"), selfcheck.listening(["set-up"]):
            pass
        return
    before = knobs.autotuning.listener
    phase = ["set-up"]
    with selfcheck.listening(phase) as seen:
        # called as Triton's Autotuner.run calls it on a key its cache lacks
        knobs.autotuning.listener(fn=test_the_autotuning_verdict_and_its_listener_on_the_real_triton_knobs,
                                  key=(64, 12, 256, "torch.bfloat16"), best_config=None, configs_timings={},
                                  duration=0.5, cache_hit=False)
        phase[0] = "steps"
    assert knobs.autotuning.listener is before  # put back
    assert [(t.phase, t.key, t.benchmarked) for t in seen] == [("set-up", (64, 12, 256, "torch.bfloat16"), True)]
    assert "set-up tuned 1 keys (1 benchmarked" in selfcheck.judge_autotuning(seen)
    in_step = seen + [selfcheck.Tuning("steps", "grouped_gemm_kernel", (64, 12, 512, "torch.float32"), True)]
    with pytest.raises(selfcheck.Failed, match=r"met 1 new keys: grouped_gemm_kernel .*512.*\(benchmarked\)"):
        selfcheck.judge_autotuning(in_step)
    with pytest.raises(selfcheck.Failed, match="nothing autotuned at set-up"):
        selfcheck.judge_autotuning([])


def test_the_fork_verdict_wants_no_hazard_and_both_processes_computing():
    from lightning_hetermoe.selfcheck.forking import fork_verdict
    from lightning_hetermoe.selfcheck.report import Failed

    fine = {"hazard": "", "child_code": 0, "child_s": 0.4, "parent_ok": True}
    assert fork_verdict(fine, "cuda:0").startswith("no CUDA driver after importing torch, Lightning and the pack; "
                                                    "a forked child computed on cuda:0 (0.4 s")
    for found, says in [({"hazard": "a CUDA driver is loaded"}, "after the imports a CUDA driver is loaded: the main "
                         "job starts its child ranks as new interpreters"),
                        ({**fine, "child_code": 1}, "a child forked after the imports exited 1 computing on cuda:0"),
                        ({**fine, "parent_ok": False}, "the parent computed wrongly on cuda:0"),
                        ({"error": "the probe exited 1: boom"}, "the probe exited 1: boom")]:
        with pytest.raises(Failed, match=says):
            fork_verdict(found, "cuda:0")


@pytest.mark.slow
def test_the_fork_probe_runs_as_the_gpu_will_run_it_here_on_the_cpu():
    """The probe the `fork after imports` row runs in a new interpreter, on the CPU: the imports
    rank 0 makes before it forks leave it safe to fork, and the forked child computes."""
    from lightning_hetermoe.selfcheck.forking import fork_verdict, probe

    found = probe("cpu")
    assert found.get("hazard") == "" and found["child_code"] == 0 and found["parent_ok"] is True, found
    assert "a forked child computed on cpu" in fork_verdict(found, "cpu")
