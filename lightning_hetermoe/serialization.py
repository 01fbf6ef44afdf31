"""JSON round trip for the plain dataclasses that travel between processes and runs."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any, Mapping


class JsonDataclass:
    """Mixin: ``to_dict``/``from_dict`` and ``to_json``/``from_json`` (text or a path).

    ``from_dict`` passes the fields straight to the constructor; a class whose fields nest
    other dataclasses rebuilds them in ``__post_init__``."""

    json_indent = 2

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]):
        return cls(**dict(d))

    def to_json(self, path: str | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=self.json_indent, sort_keys=True)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    @classmethod
    def from_json(cls, text_or_path: str):
        """From JSON text or a file's path; what is neither JSON nor this class's fields is a
        :class:`~lightning_hetermoe.configs.ConfigError` naming the class (a missing file
        stays a ``FileNotFoundError``)."""
        from .configs import ConfigError

        text = text_or_path
        if not text.lstrip().startswith("{"):
            with open(text_or_path) as f:
                text = f.read()
        try:
            return cls.from_dict(json.loads(text))
        except (ValueError, TypeError, KeyError) as err:
            where = "its text" if text is text_or_path else repr(str(text_or_path))
            raise ConfigError(f"{cls.__name__}.from_json: {where} is not a {cls.__name__} "
                              f"({' '.join(str(err).split())[:300]})") from None
