"""The GPU self-check's CPU side: the command as CI runs it (gloo, Triton's interpreter,
CUDA-only checks skipped), and the report's rules (a check that raises is a FAIL row, the
others still run, the exit code says so)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_hetermoe import selfcheck

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("selfcheck") / "out.json"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MASTER_PORT")}
    # through the recipe, which runs the module's main: both commands users are told about
    proc = subprocess.run([sys.executable, "recipes/gpu_selfcheck.py", "--device", "cpu", "--quick",
                           "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return proc, json.loads(out.read_text()) if out.exists() else None


@pytest.mark.slow
def test_the_cpu_run_passes_and_reports_every_check(cpu_run):
    proc, report = cpu_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report is not None, proc.stdout + proc.stderr
    rows = {r["check"]: r for r in report["rows"]}
    assert list(rows) == [c.name for c in selfcheck.CHECKS]
    for check in selfcheck.CHECKS:
        if check.cuda_only:
            assert rows[check.name]["result"] == "skipped" and "no CUDA" in rows[check.name]["detail"]
    assert rows["collectives ep"]["result"] == "ok" and "ep.rows" in rows["collectives ep"]["detail"]
    assert rows["collectives zebra"]["result"] == "ok" and "zebra.rows" in rows["collectives zebra"]["detail"]
    assert rows["memory"]["result"] == "ok", rows["memory"]
    # triton ships with the dev environment: the interpreter ran the kernels on every dtype
    for name in ("kernels fp32", "kernels bf16", "kernels fp16"):
        assert rows[name]["result"] == "ok", rows[name]
    assert "selfcheck passed" in proc.stdout
    for row in report["rows"]:  # the table printed each row
        assert row["check"] in proc.stdout


def _fine(ctx):
    return "all good"


def _boom(ctx):
    raise RuntimeError("the engine caught fire")


def _skips(ctx):
    raise selfcheck.Skip("not here")


def test_a_check_that_raises_is_a_fail_row_and_the_others_still_run(capsys, tmp_path):
    checks = [selfcheck.Check("fine", _fine), selfcheck.Check("boom", _boom), selfcheck.Check("skips", _skips),
              selfcheck.Check("gpu only", _fine, cuda_only=True)]
    out = tmp_path / "rows.json"
    code = selfcheck.run(selfcheck.parse_args(["--device", "cpu", "--json", str(out)]), checks)
    assert code == 1
    rows = {r["check"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["fine"] == {"check": "fine", "result": "ok", "detail": "all good"}
    assert rows["boom"]["result"] == "FAIL" and rows["boom"]["detail"] == "RuntimeError: the engine caught fire"
    assert rows["skips"]["result"] == "skipped" and rows["gpu only"]["result"] == "skipped"
    printed = capsys.readouterr().out
    assert "boom" in printed and "FAIL" in printed and "1 failed" in printed
    assert os.environ.get("TRITON_INTERPRET") is None, "the interpreter setting must not outlive the run"


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
