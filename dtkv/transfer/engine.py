"""Transfer engines: Mooncake's ``TransferEngine`` over TCP (P2PHANDSHAKE), NIXL's agent over UCX
(:mod:`dtkv.transfer._nixl`), and an in-process memcpy twin; :func:`create_engine` makes one by name.

All expose the same small surface -- ``session``, ``can_register(tensor)``, ``register(tensors)``,
``write(peer, src, dst, length)`` and ``close()``, plus ``agent_record`` / ``add_peer`` (the agent metadata NIXL
needs, which the sides pass through dtkv's store; nothing for the others) -- and :func:`send_entries` drives any of
them with the rules Mooncake
0.3.13's TCP transport needs:

- at most ``max_entries_per_call`` (default 1024) entries per call;
- one call in flight per peer session (each peer has one worker thread; peers proceed in parallel);
- a deadline bounds every wait: a call that does not finish in time raises :class:`TransferError` at once
  (the engine's own ``MC_TRANSFER_TIMEOUT`` then ends the abandoned call), and so does a call that fails;
  a dead peer fails fast (-1 within ~50 ms on TCP loopback), so a dead decode never hangs prefill;
- every call is tracked until it ends: ``close()`` and ``unregister()`` wait for the calls in flight (bounded by
  the engine's own call timeout) before releasing memory, and a sender learns when its abandoned calls ended.

Mooncake environment defaults (set with ``os.environ.setdefault`` before the engine starts, so explicit
settings win): ``MC_FORCE_TCP=1``, ``MC_LOG_LEVEL=ERROR``, ``MC_TRANSFER_TIMEOUT`` = the dtkv timeout (>= 5 s),
and both per-peer TCP queue limits at 65535. ``MC_LOG_DIR`` is refused: it aborts 0.3.13 at import. Mooncake's
benign start-up error line is kept quiet unless ``MC_LOG_LEVEL`` asks for more (:mod:`dtkv.transfer._mooncake_log`).
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
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np
import torch

from dtkv._env import transfer_timeout_s
from dtkv.transfer._mooncake_log import START_LOG_HINT, quiet_start
from dtkv.transfer.coalesce import split_batches
from dtkv.transfer.descriptors import PeerEntries
from dtkv.transfer.errors import TransferError
from dtkv.transfer.memory import mooncake_build, mooncake_registers_device_memory
from dtkv.transfer.messages import AgentRecord
from dtkv.transfer.protocol import time_left

__all__ = [
    "ENGINES",
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

ENGINES = ("mooncake", "nixl", "local")
"""The engines :func:`create_engine` makes (``engine=`` of :class:`dtkv.transfer.PrefillSender` and
:class:`dtkv.transfer.DecodeReceiver`)."""


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
    """Shared bookkeeping: one single-thread executor per peer (one call in flight per peer), the calls in flight.

    Every call goes through :meth:`submit`, which tracks it until it ends, so that :meth:`close` and
    :meth:`unregister` never release memory a running call still reads or writes, and a sender knows when the
    calls it abandoned after a timeout have ended (:data:`dtkv.transfer.protocol.DRAINED`).
    """

    session: str
    takes_arrays: bool = False
    """Whether :meth:`write` takes int64 numpy arrays as they are; :func:`send_entries` hands other engines
    lists (Mooncake's binding takes nothing else)."""

    def __init__(self) -> None:
        self._executors: dict[str, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._inflight: set[Future] = set()
        self._closed = False

    def submit(self, peer: str, fn: Callable[..., object], *args: object) -> Future:
        """Run ``fn(*args)`` on ``peer``'s worker (after the calls already queued for it); tracked until it ends."""
        with self._lock:
            if self._closed:
                raise TransferError("the transfer engine is closed", request_id="-", peer=self.session)
            ex = self._executors.get(peer)
            if ex is None:
                ex = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"dtkv-transfer-{peer}")
                self._executors[peer] = ex
            fut = ex.submit(fn, *args)
            self._inflight.add(fut)
        fut.add_done_callback(self._call_ended)
        return fut

    def _call_ended(self, fut: Future) -> None:
        with self._lock:
            self._inflight.discard(fut)
            if not self._inflight:
                self._idle.notify_all()

    @property
    def num_inflight(self) -> int:
        """Calls submitted and not ended (running or queued)."""
        with self._lock:
            return len(self._inflight)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until no call is in flight; whether none is."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._inflight, timeout=max(0.0, timeout_s))

    @abstractmethod
    def call_timeout_s(self) -> float:
        """The longest one engine call can run before the engine itself ends it."""

    def can_register(self, tensor: torch.Tensor) -> bool:
        """Whether :meth:`register` accepts ``tensor``'s memory (host memory here; see :mod:`dtkv.transfer.memory`)."""
        return tensor.device.type == "cpu"

    def _refusal(self, tensor: torch.Tensor) -> str:
        return "this engine registers host memory only"

    def _check_registrable(self, tensors: Sequence[torch.Tensor]) -> None:
        """Raise :class:`TransferError` for the first tensor :meth:`can_register` refuses (nothing is registered)."""
        for t in tensors:
            if not self.can_register(t):
                raise TransferError(
                    f"{type(self).__name__} cannot register {t.device} memory ({self._refusal(t)}): hand the pool "
                    "over through pinned host memory (dtkv.transfer.HandoffSender / HandoffReceiver do where needed) "
                    "or use an engine build that registers device memory",
                    request_id="-",
                    peer=self.session,
                )

    def _accepts(self, session: str) -> bool:
        """Whether ``session`` names a peer of this kind of engine."""
        return not session.startswith(("nixl:", "local:"))

    def agent_record(self) -> AgentRecord | None:
        """What a peer needs, beyond the session, to write to this engine (NIXL: its agent metadata); ``None``."""
        return None

    def add_peer(self, record: AgentRecord, *, deadline: float) -> None:
        """Load a peer's :meth:`agent_record` (only engines that publish one take one)."""
        raise TypeError(f"{type(self).__name__} takes no agent records, got one of agent {record.name!r}")

    def check_sessions(self, sessions: Iterable[str]) -> None:
        """Raise :class:`TransferError` if a session belongs to another kind of engine (both sides must use one)."""
        for session in sessions:
            if not self._accepts(session):
                raise TransferError(
                    f"session {session[:80]!r} is not a {type(self).__name__} peer's: both sides must use the same "
                    "transfer engine",
                    request_id="-",
                    peer=session,
                )

    def last_error(self, peer: str) -> str:
        """Why the last failed call to ``peer`` failed, where the engine says ("" otherwise)."""
        return ""

    @abstractmethod
    def write(self, peer: str, src: list[int], dst: list[int], length: list[int]) -> int:
        """Write ``length[i]`` bytes from local ``src[i]`` to ``peer``'s ``dst[i]``; 0 on success, else negative."""

    @abstractmethod
    def _unregister_now(self, tensors: Sequence[torch.Tensor]) -> None: ...

    @abstractmethod
    def _release(self) -> None:
        """Drop the engine's own resources (every call has ended)."""

    def unregister(self, tensors: Sequence[torch.Tensor], *, timeout_s: float | None = None) -> None:
        """Unregister ``tensors`` once no call is in flight (waiting up to ``timeout_s``, default
        :meth:`call_timeout_s`); a call still running then defers it to when the calls end (tensors kept alive)."""
        tensors = list(tensors)
        if self.wait_idle(self.call_timeout_s() if timeout_s is None else timeout_s):
            self._unregister_now(tensors)
        else:
            self._defer("unregister", lambda: self._unregister_now(tensors))

    def close(self, *, timeout_s: float | None = None) -> None:
        """Refuse new calls, cancel queued ones, wait (bounded) for running ones, then unregister everything and
        release the engine; idempotent. A call still running after ``timeout_s`` (default :meth:`call_timeout_s`)
        defers the release to when it ends, so memory is never unregistered under a running call."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            executors = list(self._executors.values())
            self._executors.clear()
        for ex in executors:
            ex.shutdown(wait=False, cancel_futures=True)
        if self.wait_idle(self.call_timeout_s() if timeout_s is None else timeout_s):
            self._release()
        else:
            self._defer("close", self._release)

    def _defer(self, what: str, action: Callable[[], None]) -> None:
        """Run ``action`` on a daemon thread once the calls in flight end (bounded: after 10 call timeouts it gives
        up and leaves the memory registered -- a leak, never a use after free)."""
        logger.warning(
            "%s of transfer engine %s deferred: %d call(s) still running past the engine's own timeout",
            what,
            self.session,
            self.num_inflight,
        )

        def later() -> None:
            if self.wait_idle(10 * self.call_timeout_s()):
                action()
            else:
                logger.error("transfer engine %s: calls never ended; its memory stays registered", self.session)

        threading.Thread(target=later, name=f"dtkv-deferred-{what}", daemon=True).start()


class MooncakeEngine(_EngineBase):
    """``mooncake.engine.TransferEngine`` in P2PHANDSHAKE mode over TCP, on ``hostname`` (loopback by default).

    Mooncake 0.3.13 listens on every interface whatever ``hostname`` is (its handshake port binds ``0.0.0.0``,
    its data port ``[::]``), on ports in ``[MC_MIN_RPC_PORT, MC_MAX_RPC_PORT]``: see the README's Security
    section before running it on a machine reachable from an untrusted network.

    Args:
        hostname: the address peers reach this process at; its session is ``f"{hostname}:{rpc_port}"``.
        timeout_s: sets the ``MC_TRANSFER_TIMEOUT`` default (default ``DTKV_TRANSFER_TIMEOUT_S``).
        device_memory: whether :meth:`register` accepts CUDA memory (default: whether the installed build does,
            :func:`dtkv.transfer.memory.mooncake_registers_device_memory`; the non-cuda wheel does not).

    Raises:
        ImportError: the non-cuda wheel or ``libibverbs1`` is missing (the message says which to install).
        TransferError: ``initialize`` failed.
    """

    def __init__(
        self, hostname: str = "127.0.0.1", *, timeout_s: float | None = None, device_memory: bool | None = None
    ) -> None:
        super().__init__()
        self.session = hostname
        self.device_memory = mooncake_registers_device_memory() if device_memory is None else bool(device_memory)
        """Whether :meth:`register` accepts CUDA memory."""
        env = apply_mooncake_env(timeout_s)
        self._transfer_timeout_s = float(env["MC_TRANSFER_TIMEOUT"])
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise ImportError(
                "MooncakeEngine needs `pip install mooncake-transfer-engine-non-cuda==0.3.13.post1` and Debian's "
                f"`libibverbs1`; importing mooncake.engine failed: {e}"
            ) from e
        engine = TransferEngine()
        with quiet_start() as quiet:
            rc = engine.initialize(hostname, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            hint = START_LOG_HINT if quiet else ""
            raise TransferError(f"TransferEngine.initialize returned {rc}{hint}", request_id="-", peer=hostname)
        self._engine = engine
        self.session = f"{hostname}:{engine.get_rpc_port()}"
        self._regions: dict[int, torch.Tensor] = {}
        """Registered base address -> tensor (kept alive while registered)."""

    @property
    def registered(self) -> int:
        """Number of registered regions (bookkeeping: returns to 0 once every side closed)."""
        return len(self._regions)

    def call_timeout_s(self) -> float:
        """``MC_TRANSFER_TIMEOUT`` + 1 ns per registered byte + 1 s: no call outlives it."""
        nbytes = sum(t.numel() * t.element_size() for t in self._regions.values())
        return self._transfer_timeout_s + nbytes * 1e-9 + 1.0

    def can_register(self, tensor: torch.Tensor) -> bool:
        """Host memory; CUDA memory too where :attr:`device_memory` (a CUDA build)."""
        return tensor.device.type == "cpu" or (self.device_memory and tensor.device.type == "cuda")

    def _refusal(self, tensor: torch.Tensor) -> str:
        build = mooncake_build() or "a build from source"
        return f"the installed Mooncake, {build}, moves host memory only"

    def register(self, tensors: Sequence[torch.Tensor]) -> None:
        """Register each tensor's storage (contiguous; host memory, or CUDA memory on a CUDA build) for transfers
        in both directions.

        Raises:
            TransferError: a tensor lies in memory this build cannot move (:meth:`can_register`; the non-cuda
                build would accept the registration and fail the first write with "Bad address"), or the engine
                refused the registration (e.g. a region overlapping a registered one).
        """
        tensors = [t for t in tensors if t.numel()]
        self._check_registrable(tensors)
        ptrs = [t.data_ptr() for t in tensors]
        lens = [t.numel() * t.element_size() for t in tensors]
        rc = self._engine.batch_register_memory(ptrs, lens)
        if rc != 0:
            raise TransferError(
                f"batch_register_memory returned {rc} (-7: a region overlaps one registered already)",
                request_id="-",
                peer=self.session,
            )
        self._regions.update(zip(ptrs, tensors))

    def _unregister_now(self, tensors: Sequence[torch.Tensor]) -> None:
        ptrs = [t.data_ptr() for t in tensors if t.numel() and t.data_ptr() in self._regions]
        if ptrs and self._engine is not None:
            self._engine.batch_unregister_memory(ptrs)
        for p in ptrs:
            self._regions.pop(p, None)

    def write(self, peer: str, src: list[int], dst: list[int], length: list[int]) -> int:
        return int(self._engine.batch_transfer_sync_write(peer, src, dst, length))

    def probe(self, peer: str) -> bool:
        """Whether ``peer`` answers (``send_probe``)."""
        return self._engine.send_probe(peer) == 0

    def _release(self) -> None:
        if getattr(self, "_engine", None) is None:
            return
        if self._regions:
            self._engine.batch_unregister_memory(list(self._regions))
            self._regions.clear()
        self._engine = None


_LOCAL_ENGINES: weakref.WeakValueDictionary[str, LocalEngine] = weakref.WeakValueDictionary()
_LOCAL_IDS = itertools.count()


class LocalEngine(_EngineBase):
    """In-process twin of :class:`MooncakeEngine`: ``write`` is a bounds-checked ``memmove``.

    Peers are other ``LocalEngine`` objects of the same process, addressed by their ``session``. Like Mooncake's
    TCP server it returns -1 (and copies nothing) when any entry leaves a registered region or the peer is gone
    (closed), which makes it the engine of single-process tests and of the descriptor oracle.

    Args:
        call_timeout_s: what :meth:`call_timeout_s` reports (a subclass whose ``write`` is slow raises it).
        accepts: which tensors :meth:`register` accepts (default: host memory, what ``memmove`` can copy); a test
            passes a stricter predicate to emulate an engine that cannot register some memory (a pool in device
            memory under a non-cuda build), so that the host-staged hand-off runs on CPU.
    """

    def __init__(self, *, call_timeout_s: float = 1.0, accepts: Callable[[torch.Tensor], bool] | None = None) -> None:
        super().__init__()
        self.session = f"local:{next(_LOCAL_IDS)}"
        self._call_timeout_s = float(call_timeout_s)
        self._accepts_memory = accepts
        self._regions = np.zeros((0, 2), dtype=np.int64)
        self._keep: list[torch.Tensor] = []
        _LOCAL_ENGINES[self.session] = self

    @property
    def registered(self) -> int:
        """Number of registered regions."""
        return int(self._regions.shape[0])

    def _accepts(self, session: str) -> bool:
        return session.startswith("local:")

    def call_timeout_s(self) -> float:
        return self._call_timeout_s

    def can_register(self, tensor: torch.Tensor) -> bool:
        """Host memory that ``accepts`` (when given) lets through."""
        return tensor.device.type == "cpu" and (self._accepts_memory is None or bool(self._accepts_memory(tensor)))

    def _refusal(self, tensor: torch.Tensor) -> str:
        if tensor.device.type != "cpu":
            return "LocalEngine copies with memmove: host memory only"
        return "refused by its accepts predicate"

    def register(self, tensors: Sequence[torch.Tensor]) -> None:
        """Register host tensors (see ``accepts``).

        Raises:
            TransferError: a tensor :meth:`can_register` refuses (nothing is registered then).
        """
        self._check_registrable([t for t in tensors if t.numel()])
        new = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors if t.numel()]
        self._keep += list(tensors)
        regions = np.concatenate([self._regions, np.array(new, dtype=np.int64).reshape(-1, 2)])
        self._regions = regions[np.argsort(regions[:, 0])]

    def _unregister_now(self, tensors: Sequence[torch.Tensor]) -> None:
        ptrs = {t.data_ptr() for t in tensors}
        self._regions = self._regions[~np.isin(self._regions[:, 0], list(ptrs))]
        self._keep = [t for t in self._keep if t.data_ptr() not in ptrs]

    def covers(self, addr: np.ndarray, length: np.ndarray) -> bool:
        """Whether every ``[addr, addr + length)`` lies inside one registered region."""
        if addr.size == 0:
            return True
        regions = self._regions
        if regions.shape[0] == 0:
            return False
        i = np.searchsorted(regions[:, 0], addr, side="right") - 1
        ok = i >= 0
        i = np.maximum(i, 0)
        return bool(np.all(ok & (addr + length <= regions[i, 0] + regions[i, 1])))

    def write(self, peer: str, src: list[int], dst: list[int], length: list[int]) -> int:
        target = _LOCAL_ENGINES.get(peer)
        s, d, n = (np.asarray(x, dtype=np.int64) for x in (src, dst, length))
        if target is None or not self.covers(s, n) or not target.covers(d, n):
            return -1
        for a, b, c in zip(src, dst, length):
            ctypes.memmove(b, a, c)
        return 0

    def close(self, *, timeout_s: float | None = None) -> None:
        """Leave the registry at once (later writes to this session return -1, a dead peer), then close."""
        _LOCAL_ENGINES.pop(self.session, None)
        super().close(timeout_s=timeout_s)

    def _release(self) -> None:
        self._regions = np.zeros((0, 2), dtype=np.int64)
        self._keep = []


def _peer_name(session: str, peers: Sequence[PeerEntries]) -> str:
    ranks = sorted({p.decode_rank for p in peers})
    which = f"decode rank {ranks[0]}" if len(ranks) == 1 else f"decode ranks {ranks}"
    return f"{which} at {session}"


def _send_session(engine, session, peers, group, max_entries, request_id, cancel, deadline) -> int:
    """Send one layer group of ``peers`` (all at ``session``) in calls of at most ``max_entries``; no call is
    issued once ``cancel`` is set or ``deadline`` has passed (the sender's send window)."""
    sl = [p.group(group) for p in peers]
    src = np.concatenate([p.src[s] for p, s in zip(peers, sl)])
    dst = np.concatenate([p.dst[s] for p, s in zip(peers, sl)])
    length = np.concatenate([p.length[s] for p, s in zip(peers, sl)])
    owner = np.concatenate([np.full(s.stop - s.start, i) for i, s in enumerate(sl)])
    calls = 0
    for sl in split_batches(int(length.shape[0]), max_entries):
        if cancel.is_set() or time.monotonic() >= deadline:
            return calls
        t0 = time.perf_counter()
        if engine.takes_arrays:
            rc = engine.write(session, src[sl], dst[sl], length[sl])
        else:
            rc = engine.write(session, src[sl].tolist(), dst[sl].tolist(), length[sl].tolist())
        calls += 1
        if logger.isEnabledFor(logging.DEBUG):
            nbytes, dt = int(length[sl].sum()), time.perf_counter() - t0
            logger.debug(
                "%s: call %d to %s: %d entries, %d bytes in %.2f ms (%.2f GB/s), rc %d",
                request_id,
                calls,
                _peer_name(session, peers),
                sl.stop - sl.start,
                nbytes,
                dt * 1e3,
                nbytes / max(dt, 1e-9) / 1e9,
                rc,
            )
        if rc != 0:
            unconfirmed = np.unique(owner[sl.start :])
            pages = np.concatenate([peers[i].dst_pages for i in unconfirmed])
            why = engine.last_error(session)
            raise TransferError(
                f"engine write returned {rc} on call {calls} ({sl.stop - sl.start} entries, "
                f"{int(length[sl].sum())} bytes){': ' + why if why else ''}",
                request_id=request_id,
                peer=_peer_name(session, peers),
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
    group: int | None = None,
    overlap: Callable[[], object] | None = None,
    track: list[Future] | None = None,
) -> int:
    """Send every peer's entries (blocking), one call in flight per peer session; returns the number of calls.

    Args:
        engine: a :class:`MooncakeEngine`, :class:`dtkv.transfer.NixlEngine` or :class:`LocalEngine`.
        peers: the entries of one sender (:attr:`dtkv.transfer.SenderPlan.peers`).
        request_id: named in errors.
        deadline: ``time.monotonic()`` value by which everything must be done; no engine call starts after it.
        max_entries_per_call: entries per engine call (1..1024 on Mooncake 0.3.13 TCP).
        group: send only layer group ``group`` of each peer (:meth:`PeerEntries.group`); ``None``: everything.
        overlap: called in this thread once the calls are submitted, while they run (e.g. the next pack).
        track: receives the submitted calls (futures), so that the caller learns when abandoned ones end.

    Raises:
        TransferError: an engine call failed, or the deadline passed (naming the peer and its pages). Calls that
            did not start are cancelled; a running one is abandoned and ends by the engine's own timeout.
    """
    if not 1 <= max_entries_per_call <= 65535:
        raise ValueError(f"max_entries_per_call must be in [1, 65535], got max_entries_per_call={max_entries_per_call}")
    by_session: dict[str, list[PeerEntries]] = {}
    for p in peers:
        sl = p.group(group)
        if sl.stop > sl.start:
            by_session.setdefault(p.session, []).append(p)
    cancel = threading.Event()
    futures: dict[str, Future] = {}
    calls = 0
    try:
        for s, g in by_session.items():
            args = (engine, s, g, group, max_entries_per_call, request_id, cancel, deadline)
            futures[s] = engine.submit(s, _send_session, *args)
            if track is not None:
                track.append(futures[s])
        if overlap is not None:
            overlap()
        for s, fut in futures.items():
            try:
                calls += fut.result(timeout=time_left(deadline))
            except FutureTimeout:
                group_peers = by_session[s]
                raise TransferError(
                    "timed out waiting for the engine (the call is abandoned; it ends by the engine's own timeout "
                    "and decode keeps the pages quarantined until it has)",
                    request_id=request_id,
                    peer=_peer_name(s, group_peers),
                    pages=np.concatenate([p.dst_pages for p in group_peers]),
                ) from None
    except BaseException:
        cancel.set()
        for fut in futures.values():
            fut.cancel()
        raise
    return calls
