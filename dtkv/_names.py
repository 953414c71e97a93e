"""Model names as people type them: ``glm-5``, ``GLM5``, ``deepseek-v3.2`` name the same model as ``glm5`` /
``deepseek-v32`` (the demo's ``--model`` and ``dtkv capacity --model``). Stdlib only: the command lines' usage
checks import it before anything heavy.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["canonical_name"]


def _squash(text: str) -> str:
    return "".join(c for c in text.lower() if c.isalnum())


def canonical_name(text: str, names: Iterable[str]) -> str | None:
    """The name in ``names`` that ``text`` spells, ignoring case, ``-``, ``_``, ``.`` and spaces; ``None`` if none.

    ``canonical_name("GLM-5", ["glm5", "deepseek-v32"])`` is ``"glm5"``; ``"deepseek-v3.2"`` gives
    ``"deepseek-v32"``.
    """
    want = _squash(text)
    return next((n for n in names if _squash(n) == want), None)
