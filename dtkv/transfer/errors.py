"""The one exception of the transfer path: :class:`TransferError` (and its :class:`StoreTimeout` case)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["StoreTimeout", "TransferError", "format_pages"]


def format_pages(pages: Sequence[int] | np.ndarray, limit: int = 8) -> str:
    """``[3, 5, 7, ... (+120 more)]``: a short, readable page list for error messages."""
    arr = np.asarray(pages, dtype=np.int64).ravel()
    head = ", ".join(str(int(p)) for p in arr[:limit])
    more = f", ... (+{arr.size - limit} more)" if arr.size > limit else ""
    return f"[{head}{more}]"


class TransferError(RuntimeError):
    """A PD transfer failed or timed out; names the peer, the request and the pages involved.

    Attributes:
        request_id: the request being transferred.
        peer: the other side (a Mooncake session ``"ip:port"``, or ``"prefill rank r"`` / ``"decode"``).
        pages: decode logical pages whose bytes were not confirmed (may be empty when none were involved).
        reason: what went wrong (engine return code, timeout, the remote error).
    """

    def __init__(self, reason: str, *, request_id: str, peer: str, pages: Sequence[int] | np.ndarray = ()):
        self.request_id = request_id
        self.peer = peer
        self.pages = np.asarray(pages, dtype=np.int64).ravel()
        self.reason = reason
        where = f"request {request_id!r}, peer {peer}"
        what = f", pages {format_pages(self.pages)}" if self.pages.size else ""
        super().__init__(f"transfer failed ({where}{what}): {reason}")

    def __reduce__(self):
        return (_rebuild, (self.reason, self.request_id, self.peer, self.pages))


def _rebuild(reason: str, request_id: str, peer: str, pages: np.ndarray) -> TransferError:
    return TransferError(reason, request_id=request_id, peer=peer, pages=pages)


class StoreTimeout(TransferError):
    """One bounded store call ran into its caller's deadline (not started before it, or not answered by it).

    A polling loop whose store answered earlier polls reports its own timeout instead (what it waited for did not
    come in time), chained to this one: see :meth:`dtkv.transfer.protocol.Backoff.poll`.
    """

    def __reduce__(self):
        return (_rebuild_timeout, (self.reason, self.request_id, self.peer, self.pages))


def _rebuild_timeout(reason: str, request_id: str, peer: str, pages: np.ndarray) -> StoreTimeout:
    return StoreTimeout(reason, request_id=request_id, peer=peer, pages=pages)
