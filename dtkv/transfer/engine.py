"""Transfer engines: Mooncake's ``TransferEngine`` over TCP (P2PHANDSHAKE), and an in-process memcpy twin.

Both expose the same small surface -- ``session``, ``register(tensors)``, ``write(peer, src, dst, length)`` and
``close()`` -- and :func:`send_entries` drives either with the rules Mooncake 0.3.13's TCP transport needs:

- at most ``max_entries_per_call`` (default 1024) entries per call;
- one call in flight per peer session (each peer has one worker thread; peers proceed in parallel);
- a deadline bounds every wait: a call that does not finish in time raises :class:`TransferError` at once
  (the engine's own ``MC_TRANSFER_TIMEOUT`` then ends the abandoned call), and so does a call that fails;
  a dead peer fails fast (-1 within ~50 ms on TCP loopback), so a dead decode never hangs prefill.

Mooncake environment defaults (set with ``os.environ.setdefault`` before the engine starts, so explicit
settings win): ``MC_FORCE_TCP=1``, ``MC_LOG_LEVEL=ERROR``, ``MC_TRANSFER_TIMEOUT`` = the dtkv timeout (>= 5 s),
and both per-peer TCP queue limits at 65535. ``MC_LOG_DIR`` is refused: it aborts 0.3.13 at import.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import math
import os
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np
import torch

from dtkv._env import transfer_timeout_s
from dtkv.transfer.coalesce import split_batches
from dtkv.transfer.descriptors import PeerEntries
from dtkv.transfer.errors import TransferError

__all__ = [
    "LocalEngine",
    "MAX_ENTRIES_PER_CALL",
    "MooncakeEngine",
    "apply_mooncake_env",
    "mooncake_available",
    "send_entries",
]

logger = logging.getLogger(__name__)

MAX_ENTRIES_PER_CALL = 1024
"""Entries per engine call: Mooncake 0.3.13's TCP transport rejects much more than this per peer."""


def apply_mooncake_env(timeout_s: float | None = None) -> dict[str, str]:
    """Set the Mooncake TCP defaults in ``os.environ`` (``setdefault``); returns the effective values.

    Raises:
        RuntimeError: ``MC_LOG_DIR`` is set (0.3.13 aborts at import with "InitGoogleLogging() twice").
    """
    if os.environ.get("MC_LOG_DIR"):
        raise RuntimeError(
            "MC_LOG_DIR must be unset for mooncake 0.3.13 (it aborts at import), "
            f"got MC_LOG_DIR={os.environ['MC_LOG_DIR']!r}"
        )
    timeout = transfer_timeout_s() if timeout_s is None else timeout_s
    defaults = {
        "MC_FORCE_TCP": "1",
        "MC_LOG_LEVEL": "ERROR",
        "MC_TRANSFER_TIMEOUT": str(max(5, math.ceil(timeout))),
        "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
        "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
    }
    for k, v in defaults.items():
        os.environ.setdefault(k, v)
    return {k: os.environ[k] for k in defaults}


def mooncake_available() -> tuple[bool, str]:
    """``(True, "")`` when ``mooncake.engine`` imports, else ``(False, why)``."""
    try:
        apply_mooncake_env()
        import mooncake.engine  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "not available", with the reason
        return False, f"mooncake.engine does not import: {type(e).__name__}: {e}"
    return True, ""


class _EngineBase(ABC):
    """Shared bookkeeping: one single-thread executor per peer (one call in flight per peer)."""

    session: str

    def __init__(self) -> None:
        self._executors: dict[str, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()

    def executor(self, peer: str) -> ThreadPoolExecutor:
        with self._lock:
            ex = self._executors.get(peer)
            if ex is None:
                ex = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"dtkv-transfer-{peer}")
                self._executors[peer] = ex
            return ex

    @abstractmethod
    def write(self, peer: str, src: list[int], dst: list[int], length: list[int]) -> int:
        """Write ``length[i]`` bytes from local ``src[i]`` to ``peer``'s ``dst[i]``; 0 on success, else negative."""

    def _shutdown_executors(self) -> None:
        with self._lock:
            for ex in self._executors.values():
                ex.shutdown(wait=False, cancel_futures=True)
            self._executors.clear()


class MooncakeEngine(_EngineBase):
    """``mooncake.engine.TransferEngine`` in P2PHANDSHAKE mode over TCP, on ``hostname`` (loopback by default).

    Args:
        hostname: the address peers reach this process at; its session is ``f"{hostname}:{rpc_port}"``.
        timeout_s: sets the ``MC_TRANSFER_TIMEOUT`` default (default ``DTKV_TRANSFER_TIMEOUT_S``).

    Raises:
        ImportError: the non-cuda wheel or ``libibverbs1`` is missing (the message says which to install).
        TransferError: ``initialize`` failed.
    """

    def __init__(self, hostname: str = "127.0.0.1", *, timeout_s: float | None = None) -> None:
        super().__init__()
        apply_mooncake_env(timeout_s)
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise ImportError(
                "MooncakeEngine needs `pip install mooncake-transfer-engine-non-cuda==0.3.13.post1` and Debian's "
                f"`libibverbs1`; importing mooncake.engine failed: {e}"
            ) from e
        self._engine = TransferEngine()
        rc = self._engine.initialize(hostname, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise TransferError(f"TransferEngine.initialize returned {rc}", request_id="-", peer=hostname)
        self.session = f"{hostname}:{self._engine.get_rpc_port()}"
        self._registered: list[int] = []

    def register(self, tensors: Sequence[torch.Tensor]) -> None:
        """Register each tensor's storage (contiguous, host memory) for transfers in both directions."""
        tensors = [t for t in tensors if t.numel()]
        ptrs = [t.data_ptr() for t in tensors]
        lens = [t.numel() * t.element_size() for t in tensors]
        rc = self._engine.batch_register_memory(ptrs, lens)
        if rc != 0:
            raise TransferError(
                f"batch_register_memory returned {rc} (overlapping region?)", request_id="-", peer=self.session
            )
        self._registered += ptrs

    def unregister(self, tensors: Sequence[torch.Tensor]) -> None:
        """Unregister tensors registered with :meth:`register` (unknown ones are ignored)."""
        ptrs = [t.data_ptr() for t in tensors if t.numel() and t.data_ptr() in self._registered]
        if ptrs:
            self._engine.batch_unregister_memory(ptrs)
            self._registered = [p for p in self._registered if p not in ptrs]

    def write(self, peer: str, src: list[int], dst: list[int], length: list[int]) -> int:
        return int(self._engine.batch_transfer_sync_write(peer, src, dst, length))

    def probe(self, peer: str) -> bool:
        """Whether ``peer`` answers (``send_probe``)."""
        return self._engine.send_probe(peer) == 0

    def close(self) -> None:
        """Unregister every region and drop the engine (about 1 s); idempotent."""
        self._shutdown_executors()
        if getattr(self, "_engine", None) is None:
            return
        if self._registered:
            self._engine.batch_unregister_memory(self._registered)
            self._registered = []
        self._engine = None


_LOCAL_ENGINES: weakref.WeakValueDictionary[str, LocalEngine] = weakref.WeakValueDictionary()
_LOCAL_IDS = itertools.count()


class LocalEngine(_EngineBase):
    """In-process twin of :class:`MooncakeEngine`: ``write`` is a bounds-checked ``memmove``.

    Peers are other ``LocalEngine`` objects of the same process, addressed by their ``session``. Like Mooncake's
    TCP server it returns -1 (and copies nothing) when any entry leaves a registered region or the peer is gone
    (closed), which makes it the engine of single-process tests and of the descriptor oracle.
    """

    def __init__(self) -> None:
        super().__init__()
        self.session = f"local:{next(_LOCAL_IDS)}"
        self._regions = np.zeros((0, 2), dtype=np.int64)
        self._keep: list[torch.Tensor] = []
        _LOCAL_ENGINES[self.session] = self

    def register(self, tensors: Sequence[torch.Tensor]) -> None:
        new = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors if t.numel()]
        self._keep += list(tensors)
        regions = np.concatenate([self._regions, np.array(new, dtype=np.int64).reshape(-1, 2)])
        self._regions = regions[np.argsort(regions[:, 0])]

    def unregister(self, tensors: Sequence[torch.Tensor]) -> None:
        ptrs = {t.data_ptr() for t in tensors}
        self._regions = self._regions[~np.isin(self._regions[:, 0], list(ptrs))]
        self._keep = [t for t in self._keep if t.data_ptr() not in ptrs]

    def covers(self, addr: np.ndarray, length: np.ndarray) -> bool:
        """Whether every ``[addr, addr + length)`` lies inside one registered region."""
        if addr.size == 0:
            return True
        if self._regions.shape[0] == 0:
            return False
        i = np.searchsorted(self._regions[:, 0], addr, side="right") - 1
        ok = i >= 0
        i = np.maximum(i, 0)
        return bool(np.all(ok & (addr + length <= self._regions[i, 0] + self._regions[i, 1])))

    def write(self, peer: str, src: list[int], dst: list[int], length: list[int]) -> int:
        target = _LOCAL_ENGINES.get(peer)
        s, d, n = (np.asarray(x, dtype=np.int64) for x in (src, dst, length))
        if target is None or not self.covers(s, n) or not target.covers(d, n):
            return -1
        for a, b, c in zip(src, dst, length):
            ctypes.memmove(b, a, c)
        return 0

    def close(self) -> None:
        """Leave the registry: later writes to this session return -1 (a dead peer)."""
        self._shutdown_executors()
        _LOCAL_ENGINES.pop(self.session, None)
        self._regions = np.zeros((0, 2), dtype=np.int64)
        self._keep = []


def _peer_name(session: str, group: Sequence[PeerEntries]) -> str:
    ranks = sorted({p.decode_rank for p in group})
    which = f"decode rank {ranks[0]}" if len(ranks) == 1 else f"decode ranks {ranks}"
    return f"{which} at {session}"


def _send_session(engine, session, group, chunk, max_entries, request_id, cancel: threading.Event) -> int:
    sl = [p.chunk(chunk) for p in group]
    src = np.concatenate([p.src[s] for p, s in zip(group, sl)])
    dst = np.concatenate([p.dst[s] for p, s in zip(group, sl)])
    length = np.concatenate([p.length[s] for p, s in zip(group, sl)])
    owner = np.concatenate([np.full(s.stop - s.start, i) for i, s in enumerate(sl)])
    calls = 0
    for sl in split_batches(int(length.shape[0]), max_entries):
        if cancel.is_set():
            return calls
        rc = engine.write(session, src[sl].tolist(), dst[sl].tolist(), length[sl].tolist())
        calls += 1
        if rc != 0:
            unconfirmed = np.unique(owner[sl.start :])
            pages = np.concatenate([group[i].dst_pages for i in unconfirmed])
            raise TransferError(
                f"engine write returned {rc} on call {calls} ({sl.stop - sl.start} entries, "
                f"{int(length[sl].sum())} bytes)",
                request_id=request_id,
                peer=_peer_name(session, group),
                pages=pages,
            )
    return calls


def send_entries(
    engine: _EngineBase,
    peers: Sequence[PeerEntries],
    *,
    request_id: str,
    deadline: float,
    max_entries_per_call: int = MAX_ENTRIES_PER_CALL,
    chunk: int | None = None,
    overlap: Callable[[], object] | None = None,
) -> int:
    """Send every peer's entries (blocking), one call in flight per peer session; returns the number of calls.

    Args:
        engine: a :class:`MooncakeEngine` or :class:`LocalEngine`.
        peers: the entries of one sender (:attr:`dtkv.transfer.SenderPlan.peers`).
        request_id: named in errors.
        deadline: ``time.monotonic()`` value by which everything must be done.
        max_entries_per_call: entries per engine call (1..1024 on Mooncake 0.3.13 TCP).
        chunk: send only layer group ``chunk`` of each peer (:meth:`PeerEntries.chunk`); ``None``: everything.
        overlap: called in this thread once the calls are submitted, while they run (e.g. the next pack).

    Raises:
        TransferError: an engine call failed, or the deadline passed (naming the peer and its pages).
    """
    if not 1 <= max_entries_per_call <= 65535:
        raise ValueError(f"max_entries_per_call must be in [1, 65535], got max_entries_per_call={max_entries_per_call}")
    by_session: dict[str, list[PeerEntries]] = {}
    for p in peers:
        sl = p.chunk(chunk)
        if sl.stop > sl.start:
            by_session.setdefault(p.session, []).append(p)
    cancel = threading.Event()
    futures = {
        s: engine.executor(s).submit(_send_session, engine, s, g, chunk, max_entries_per_call, request_id, cancel)
        for s, g in by_session.items()
    }
    calls = 0
    try:
        if overlap is not None:
            overlap()
        for s, fut in futures.items():
            try:
                calls += fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                group = by_session[s]
                raise TransferError(
                    "timed out waiting for the engine (the call is abandoned; later calls to this peer queue "
                    "behind it)",
                    request_id=request_id,
                    peer=_peer_name(s, group),
                    pages=np.concatenate([p.dst_pages for p in group]),
                ) from None
    except BaseException:
        cancel.set()
        raise
    return calls
