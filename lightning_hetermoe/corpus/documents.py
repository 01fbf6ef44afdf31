"""Text that ships with Python, as documents: the corpus the main job needs no download for."""

from __future__ import annotations


def pydoc_documents() -> list[tuple[str, str]]:
    """The CPython documentation topics (``pydoc_data``): ``(topic, text)`` in sorted order."""
    from pydoc_data.topics import topics

    return [(k, topics[k]) for k in sorted(topics)]
