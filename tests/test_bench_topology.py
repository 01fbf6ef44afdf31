"""``bench/topology.py``: its bad arguments are refused before any job starts."""

import pytest

from helpers_bench import BENCH, load_bench


@pytest.mark.parametrize("argv, message", [
    (["--parts", "zebra,eq"], "--parts='zebra,eq' is invalid: a comma-separated choice of ('zebra', 'ep')"),
    (["--steps", "1"], "--steps=1 is invalid: must be >= 2 (the first step is not timed)"),
])
def test_bad_arguments_are_refused_naming_the_flag(argv, message, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # its runs.py, as `python bench/topology.py` finds it
    with pytest.raises(SystemExit):
        load_bench("topology").main(argv)
    assert message in capsys.readouterr().err
