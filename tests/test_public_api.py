"""What ``lightning_hetermoe`` exports is documented: each name has a docstring of its own
(not one inherited from Lightning's base classes, which would describe DDP or a bare
callback), and README's "Public API" names each."""

from __future__ import annotations

import inspect
from pathlib import Path

import lightning_hetermoe

README = Path(__file__).resolve().parents[1] / "README.md"


def test_every_exported_name_exists_and_has_a_docstring_of_its_own():
    bare = []
    for name in lightning_hetermoe.__all__:
        obj = getattr(lightning_hetermoe, name)  # a name in __all__ that is not there fails here
        own = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
        if not (own or "").strip():
            bare.append(name)
    assert not bare, f"exported without a docstring of their own: {bare}"
    assert len(set(lightning_hetermoe.__all__)) == len(lightning_hetermoe.__all__)


def test_readme_s_public_api_section_names_every_export():
    text = README.read_text()
    section = text[text.index("## Public API"):text.index("## Layout")]
    missing = [n for n in lightning_hetermoe.__all__ if f"`{n}`" not in section]
    assert not missing, f"README's Public API leaves out {missing}"
