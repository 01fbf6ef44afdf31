"""A regular (non-editable) install ships every package: pyproject lists each one."""

from pathlib import Path

import pytest

# the standard library reads TOML from Python 3.11; the project runs on 3.10 too
tomllib = pytest.importorskip("tomllib", reason="Python 3.10 has no tomllib")

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_in_pyproject():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(conf["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "lightning_hetermoe").rglob("__init__.py")}
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"
    assert conf["package-dir"]["lightning_hetermoe.kernels"] == "kernels" and "lightning_hetermoe.kernels" in listed
    assert "lightning_hetermoe.emulate" in listed and "lightning_hetermoe.strategy.backends.zebra" in listed


@pytest.mark.slow
def test_a_wheel_ships_the_configs_the_code_reads(tmp_path):
    """Built as a wheel and installed into a fresh virtual environment (its dependencies
    borrowed from this one, without this checkout's editable finder), the package resolves
    a named workload model from its own package data."""
    import subprocess
    import sys
    import zipfile

    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                    str(ROOT)], check=True, capture_output=True, text=True)
    (wheel,) = dist.glob("lightning_hetermoe-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "lightning_hetermoe/conf/model/d1.yaml" in names and "lightning_hetermoe/kernels/measured.json" in names
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site),
                    str(wheel)], check=True, capture_output=True, text=True)
    # A path line in a .pth adds the directory only: the .pth files inside it (this
    # checkout's editable finder among them) are not processed.
    deps = [p for p in sys.path if p.endswith("site-packages")]
    (site / "borrowed_deps.pth").write_text("\n".join(deps) + "\n")
    probe = ("import lightning_hetermoe, sys; from lightning_hetermoe.configs import workload_model; "
             "m = workload_model('d1'); print(lightning_hetermoe.__file__); print(m.d_model, m.n_layers, m.moe.num_experts)")
    out = subprocess.run([str(python), "-c", probe], cwd=tmp_path, check=True, capture_output=True, text=True)
    where, shape = out.stdout.split()[0], out.stdout.split()[1:]
    assert where.startswith(str(site)), f"imported {where}, not the wheel in {site}"
    assert shape == ["1024", "8", "24"], shape  # D1 of the HeterMoE paper: 8 layers, d=1024, 24 experts


def test_every_model_yaml_names_exactly_the_config_fields():
    """Typed configs map one-to-one onto the YAML: no key the code ignores; the main job's
    model (tiny) names every field, the paper's workload models their shapes."""
    from dataclasses import fields
    from pathlib import Path

    from omegaconf import OmegaConf

    from lightning_hetermoe import ModelConfig, MoEConfig

    want = {f.name for f in fields(ModelConfig)}
    want_moe = {f.name for f in fields(MoEConfig)}
    for path in sorted((Path(__file__).resolve().parents[1] / "conf" / "model").glob("*.yaml")):
        cfg = OmegaConf.to_container(OmegaConf.load(path))
        assert set(cfg) <= want and set(cfg["moe"]) <= want_moe, (path.name, set(cfg) - want, set(cfg["moe"]) - want_moe)
        if path.stem == "tiny":
            assert set(cfg) == want and set(cfg["moe"]) == want_moe, (set(cfg) ^ want, set(cfg["moe"]) ^ want_moe)


def test_the_strategy_yaml_names_exactly_the_strategys_arguments():
    """conf/strategy/hetermoe.yaml, the fields the recipe passes on, and the strategy's own
    arguments are one set (the cluster comes from its own config group)."""
    from dataclasses import fields
    from pathlib import Path

    from omegaconf import OmegaConf

    from lightning_hetermoe.strategy.arguments import StrategyArguments
    from lightning_hetermoe.run_config import STRATEGY_FIELDS

    yaml = set(OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "strategy" / "hetermoe.yaml"))
    arguments = {f.name for f in fields(StrategyArguments)} - {"cluster"}
    assert yaml == set(STRATEGY_FIELDS) == arguments, (yaml ^ arguments, set(STRATEGY_FIELDS) ^ arguments)


@pytest.mark.slow
def test_the_checkouts_kernels_folder_does_not_shadow_another_kernels_package(tmp_path):
    """Run from the checkout's root (``python -m pytest``, ``python -c``), its ``kernels/``
    folder is importable as a bare ``kernels``: the name of Hugging Face's kernel hub package,
    which transformers 5.25 depends on and imports with any model module (this folder shadowed
    it: ``cannot import name 'CUDAProperties' from 'kernels'``, and every Hugging Face test
    failed). Another ``kernels`` on the path is the one imported, whole (its submodules its
    own), and ``lightning_hetermoe.kernels`` is still this folder."""
    import os
    import subprocess
    import sys

    other = tmp_path / "kernels"
    other.mkdir()
    (other / "__init__.py").write_text("__version__ = '9.9'\nfrom .device import CUDAProperties\n")
    (other / "device.py").write_text("CUDAProperties = 'the-hub-package'\n")
    probe = ("import sys, kernels, lightning_hetermoe.kernels as ours\n"
             "print(kernels.CUDAProperties, kernels.__file__, ours.__file__, ours.why_not is not None,\n"
             "      ','.join(sorted(n for n in sys.modules if n.startswith('kernels.'))))\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))  # after the root, which `python -c` puts first
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["the-hub-package", str(other / "__init__.py"), str(ROOT / "kernels" / "__init__.py"),
                                  "True", "kernels.device"], out.stdout
