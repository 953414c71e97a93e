"""Startup agreement check: every rank of a CP group must build the same pool.

Each rank hashes a canonical description of its configuration and the digests are compared in one fixed-size
collective (:func:`dtkv._agree.agree`), so a mismatch can never hang; on a mismatch the descriptions are
exchanged (bounded, as JSON) and every rank raises the same :class:`ConfigMismatchError`, naming the first
differing field and each rank's value. Collective constructors use :func:`dtkv._agree.agreement` directly, so
that a rank's local validation error travels inside the same collective.
"""

from __future__ import annotations

import torch.distributed as dist

from dtkv._agree import ConfigMismatchError, agree

__all__ = ["ConfigMismatchError", "check_agreement"]


def check_agreement(config: dict[str, object], group: dist.ProcessGroup | None, *, what: str = "pool") -> None:
    """Raise :class:`ConfigMismatchError` on every rank unless all ranks of ``group`` pass equal ``config``.

    Collective over ``group``: every rank must call it. ``group=None`` (single process) is a no-op.
    """
    agree(None, group, what=what, value=config)
