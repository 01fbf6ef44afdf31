"""``bench/ep_alone.py``: its bad arguments are refused before any job starts, and its
contender is the exchange the self-check forces (a callback the main job can build)."""

import pytest
from hydra.utils import instantiate

from helpers_bench import BENCH, load_bench


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--steps", "2"]])
def test_bad_arguments_are_refused_naming_the_flags(argv, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # its runs.py, as `python bench/ep_alone.py` finds it
    with pytest.raises(SystemExit):
        load_bench("ep_alone").main(argv)
    assert "at least 1 round and 3 steps" in capsys.readouterr().err


def test_the_contender_override_builds_the_callback_that_forces_the_exchange(monkeypatch):
    import lightning as L

    monkeypatch.syspath_prepend(str(BENCH))
    (override,) = load_bench("ep_alone").EXCHANGE
    target = override.split("=", 1)[1]
    assert isinstance(instantiate({"_target_": target}), L.Callback)
