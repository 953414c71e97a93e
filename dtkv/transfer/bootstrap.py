"""Rendezvous of prefill ranks and decode through a ``torch.distributed`` store (no process group needed).

Decode is not a member of the prefill process group, so the two sides meet in a key-value store: a
``TCPStore`` on loopback (one process hosts it with :func:`create_store` ``(is_master=True)``; the others
connect with the printed port) or a ``FileStore`` on a shared path. Keys, under a namespace:

==========================  ===========  ===========================================================
key                         written by   value
==========================  ===========  ===========================================================
``{role}/size``             rank 0       number of ranks of that side
``{role}/{rank}``           each rank    its :class:`dtkv.transfer.RankEndpoint`
``req/{rid}/dst``           decode       decode pages, slot and staging flag of request ``rid``
``req/{rid}/start/{rank}``  each prefill its :class:`SendStart` (positions it sends, decode's staging copies)
``req/{rid}/done/{rank}``   each prefill its :class:`SendOutcome` (counts, or the error)
``req/{rid}/progress/{r}``  each prefill a counter (``store.add``): 1 once started, +1 per layer group landed,
                                         +:data:`DONE` once ``done`` is posted -- decode polls it, one RPC per rank
==========================  ===========  ===========================================================

Every wait polls with ``check`` under a deadline (no wait is unbounded), and a store that cannot be reached
becomes a :class:`dtkv.transfer.TransferError`.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch.distributed as dist

from dtkv.transfer.descriptors import RankEndpoint, StageCopy
from dtkv.transfer.errors import TransferError

__all__ = ["DONE", "MAX_POLL_S", "Bootstrap", "DstRequest", "SendOutcome", "SendStart", "create_store"]

DONE = 1 << 20
"""Progress-counter increment that says a sender posted its :class:`SendOutcome`."""

MAX_POLL_S = 0.005
"""Longest sleep between two polls of the store (the latency a waiter may add after a key appears)."""


def create_store(host: str = "127.0.0.1", port: int = 0, *, is_master: bool, timeout_s: float = 30.0) -> dist.TCPStore:
    """A ``TCPStore`` on ``host``; the master with ``port=0`` picks a free port (read it from ``store.port``)."""
    return dist.TCPStore(host, port, is_master=is_master, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class DstRequest:
    """What decode posts for a request: where each position goes."""

    dst_pages: np.ndarray
    """int64 ``[num_positions]``: decode logical page of each position."""
    num_tokens: int | None = None
    """Tokens of the request (checked against the page count when given)."""
    dst_meta_slot: int | None = None
    """Decode metadata row receiving the replicated row (``None``: no metadata)."""
    staging: bool = True
    """Whether the senders may use decode's staging buffers for this request."""


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class SendStart:
    """What a prefill rank announces before sending: its positions and what decode must unpack."""

    rank: int
    positions: np.ndarray
    """Positions this rank sends (its owned pages: the explicit logical positions)."""
    unpack: dict[int, tuple[StageCopy, ...]] = field(default_factory=dict)
    """decode rank -> staging copies decode applies, one layer group at a time, as the groups land."""
    layer_bounds: np.ndarray = field(default_factory=lambda: np.zeros(2, dtype=np.int64))
    """int64 ``[num_chunks + 1]``: the layer groups (:attr:`dtkv.transfer.RequestPlan.layer_bounds`)."""


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class SendOutcome:
    """What a prefill rank reports after sending its share of a request (or failing to)."""

    rank: int
    ok: bool
    error: str = ""
    num_entries: int = 0
    num_calls: int = 0
    num_bytes: int = 0
    plan_entries: int = 0
    """Entries of the whole request (every sender)."""
    min_entries: int = 0
    """The minimum any plan of the request needs."""


class Bootstrap:
    """Namespaced, deadline-bounded access to a ``torch.distributed`` store (see the module table).

    Args:
        store: a ``TCPStore`` (see :func:`create_store`) or ``FileStore`` every participant reaches.
        namespace: key prefix, so several PD pairs can share one store.
    """

    def __init__(self, store: dist.Store, *, namespace: str = "dtkv") -> None:
        self.store = dist.PrefixStore(f"{namespace}/", store)
        self.namespace = namespace

    def set(self, key: str, value: object) -> None:
        try:
            self.store.set(key, pickle.dumps(value))
        except Exception as e:  # noqa: BLE001 - the store transport raises several kinds
            raise TransferError(f"store set {key!r} failed: {e}", request_id="-", peer="store") from e

    def get(self, key: str, *, deadline: float, request_id: str = "-", peer: str = "store") -> object:
        """Wait until ``key`` exists (polling, bounded by ``deadline``) and return its value."""
        delay = 0.001
        while True:
            try:
                if self.store.check([key]):
                    return pickle.loads(self.store.get(key))
            except Exception as e:  # noqa: BLE001
                raise TransferError(
                    f"store unreachable while waiting for {key!r}: {e}", request_id=request_id, peer=peer
                ) from e
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferError(f"timed out waiting for {key!r}", request_id=request_id, peer=peer)
            time.sleep(min(delay, left))
            delay = min(delay * 2, MAX_POLL_S)

    def add(self, key: str, amount: int, *, request_id: str = "-", peer: str = "store") -> int:
        """Atomically add ``amount`` to the counter ``key`` (created at 0); returns the new value (one RPC)."""
        try:
            return int(self.store.add(key, amount))
        except Exception as e:  # noqa: BLE001
            raise TransferError(f"store add {key!r} failed: {e}", request_id=request_id, peer=peer) from e

    def delete(self, key: str) -> None:
        try:
            self.store.delete_key(key)
        except Exception:  # noqa: BLE001 - cleanup is best effort
            pass

    # ------------------------------------------------------------------------------------------ endpoints
    def publish(self, endpoint: RankEndpoint) -> None:
        self.set(f"{endpoint.role}/{endpoint.rank}", endpoint)
        if endpoint.rank == 0:
            self.set(f"{endpoint.role}/size", endpoint.ownership.cp_size)

    def endpoints(self, role: str, *, deadline: float) -> list[RankEndpoint]:
        """Every endpoint of ``role`` (``"prefill"`` or ``"decode"``), rank order, waiting for all of them."""
        size = self.get(f"{role}/size", deadline=deadline, peer=f"{role} rank 0")
        return [self.get(f"{role}/{r}", deadline=deadline, peer=f"{role} rank {r}") for r in range(size)]
