"""The suite's own rule: the quick loop starts no process (``conftest.py``)."""

import subprocess
import sys

import pytest


def test_a_quick_test_that_starts_a_process_is_told_to_mark_itself_slow():
    with pytest.raises(AssertionError, match=r"test_suite_rules\.py.* starts a process \(subprocess\): mark it "
                                             r"@pytest\.mark\.slow"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.mark.slow
def test_a_slow_test_starts_processes_freely():
    assert subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True,
                          check=True).stdout.strip() == "42"
