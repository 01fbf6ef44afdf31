"""A regular (non-editable) install ships every package: pyproject lists each one."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_in_pyproject():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(conf["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "lightning_hetermoe").rglob("__init__.py")}
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"
    assert conf["package-dir"]["lightning_hetermoe.kernels"] == "kernels" and "lightning_hetermoe.kernels" in listed
    assert "lightning_hetermoe.emulate" in listed and "lightning_hetermoe.strategy.zebra" in listed
