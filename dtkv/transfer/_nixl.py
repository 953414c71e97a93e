"""``NixlEngine``: dtkv's transfer-engine surface over a NIXL agent with its UCX backend (vLLM's KV transport).

The surface and its rules are :class:`dtkv.transfer.MooncakeEngine`'s (``session``, ``register``, ``write(peer, src,
dst, length)``, ``close``; one call in flight per peer; every call tracked until it ends; a deadline on every wait).
What is NIXL's own:

- **No NIXL listener.** The agent runs its progress thread (woken by UCX events, with a :data:`PROGRESS_POLL_US`
  poll timeout instead of the wrapper's busy 0) and no listener thread (no metadata port, no etcd):
  the only sockets are the ones UCX opens for its data path, one TCP listener of the agent's UCX worker per
  network device (``docs/security.md``). Agent metadata travels through
  dtkv's store: each side publishes its engine's :meth:`NixlEngine.agent_record` (an
  :class:`dtkv.transfer.messages.AgentRecord`, signed with ``DTKV_TRANSFER_SECRET``) under ``{role}/{rank}/agent``
  next to each rank's endpoint, and the prefill side hands the decode ranks' records to :meth:`NixlEngine.add_peer`
  when it connects (:class:`dtkv.transfer.TransferSide`). Nothing is pickled; the session a rank publishes is
  ``nixl:{agent name}``.
- **Writes.** A call's entries are checked against this engine's registered regions (sources) and the peer's
  recorded regions (destinations), like Mooncake's TCP server and :class:`dtkv.transfer.LocalEngine` do: any
  entry outside them returns ``-1`` and nothing is posted. The entries then become NIXL ``WRITE`` transfer requests
  of at most :data:`BATCH_ENTRIES` descriptors each (descriptor lists ``(addr, len, device)`` built from the
  entries, one list per memory-kind pair), at most :data:`INFLIGHT_PER_PEER` posted at once, polled until all
  are done (both chosen by measurement: ``benchmarks/bench_transfer.py --nixl-sweep``, ``docs/engines.md``).
  Within a host UCX moves host memory by CMA, one ``process_vm_writev`` per descriptor made by the posting thread
  inside NIXL's ``transfer``: a request is done when it is posted, so the cost of a call is its descriptors' (about
  4 us each on CPU loopback, on top of the bytes) and requests in flight overlap nothing there. The UCX backend
  runs without NIXL's thread pool (``num_threads``): it shared the descriptors between threads (1.4-1.8x the GB/s on
  2 cores), but with NIXL 1.5.1 a pooled request to a dead peer left the agent aborting the process when
  destroyed (``std::terminate``, 2 runs of 3).
- **Bounded.** A call that has not finished ``timeout_s`` (>= 5 s) + 1 ns per byte after it started, or whose
  request fails (a dead peer fails at once: ``NIXL_ERR_REMOTE_DISCONNECT``), releases its requests and drops the
  connection to the peer (``remove_remote_agent``), so no request of it stays queued in UCX; it returns ``-2``
  (timed out) or ``-1``. The next call to that peer reconnects from the peer's record.
- **Memory.** Host tensors register as ``DRAM_SEG``, CUDA tensors as ``VRAM_SEG`` with their device index (UCX's
  ``cuda_copy`` / ``cuda_ipc`` / RDMA transports move them; the NIXL wheel's UCX is built with CUDA support); a
  peer's worker thread makes the source device current before it posts (UCX works in the calling thread's CUDA
  context). This path is written to NIXL's documented API but has not run: the CI machines have no GPU and the GPU
  image does not carry the wheel (``tests/test_transfer_nixl.py`` has the CUDA test, skipped without a device).
- **Environment.** ``NIXL_LOG_LEVEL`` defaults to ``WARN`` (``os.environ.setdefault`` before NIXL is imported):
  at ``INFO`` NIXL prints a line to *stdout* for every agent it starts. UCX's own variables (``UCX_TLS``,
  ``UCX_NET_DEVICES``, ``UCX_TCP_PORT_RANGE``, ...) are left to the deployment.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import numpy as np
import torch

from dtkv._env import transfer_timeout_s
from dtkv.transfer.engine import _EngineBase
from dtkv.transfer.errors import TransferError
from dtkv.transfer.messages import AGENT_NAME, AgentRecord
from dtkv.transfer.protocol import time_left

__all__ = [
    "BATCH_ENTRIES",
    "INFLIGHT_PER_PEER",
    "NixlEngine",
    "apply_nixl_env",
    "nixl_available",
]

logger = logging.getLogger(__name__)

BATCH_ENTRIES = 1024
"""Descriptors per NIXL transfer request (measured on CPU loopback: 64 loses 0-35%, 256 and 4096 are level)."""
INFLIGHT_PER_PEER = 2
"""Transfer requests of one call posted at once (measured on CPU loopback, CMA and ``UCX_TLS=tcp,self``: 1, 2 and
4 are level within the noise; a CMA request is done when posted)."""
SESSION_PREFIX = "nixl:"
RC_FAILED = -1
"""``write``: refused (an entry outside the registered regions, a peer whose metadata is not loaded) or failed."""
RC_TIMEOUT = -2
"""``write``: the call outlived the engine's own timeout; its requests were released, the connection dropped."""
_POLL_MAX_S = 0.001
PROGRESS_POLL_US = 1000
"""The UCX progress thread's poll timeout (µs). NIXL's Python wrapper starts it at 0, a thread spinning on one core
per agent (measured: 0.83 core for two idle agents, 0.04 at 1 ms); it wakes on UCX events either way."""
_CONSTRUCT = threading.Lock()


def apply_nixl_env() -> dict[str, str]:
    """Set dtkv's NIXL defaults in ``os.environ`` (``setdefault``: explicit settings win); the effective values."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    return {"NIXL_LOG_LEVEL": os.environ["NIXL_LOG_LEVEL"]}


@functools.cache
def nixl_available() -> tuple[bool, str]:
    """``(True, "")`` when NIXL imports and has its UCX plugin, else ``(False, why)`` (checked once per process)."""
    try:
        apply_nixl_env()
        from nixl._api import nixl_agent, nixl_agent_config

        probe = nixl_agent(f"dtkv-probe-{os.getpid()}", nixl_agent_config(backends=[]))
        plugins = probe.get_plugin_list()
        del probe
    except Exception as e:  # noqa: BLE001 - any failure means "not available", with the reason
        return False, f"nixl does not load: {type(e).__name__}: {e}"
    if "UCX" not in plugins:
        return False, f"nixl has no UCX plugin (plugins found: {sorted(plugins)})"
    return True, ""


def _polled_agent(nixl_agent, name: str, config):
    """``nixl_agent(name, config)`` whose progress thread polls with a :data:`PROGRESS_POLL_US` timeout.

    The wrapper sets its C++ config's ``pthrDelay`` to 0 itself; for the duration of the call (under a lock) its
    config class is one that keeps the delay at :data:`PROGRESS_POLL_US` at least. Where the wrapper no longer
    builds its config that way, the agent is made as it is (the delay is then NIXL's own)."""
    import sys

    bind = getattr(sys.modules.get(nixl_agent.__module__), "nixlBind", None)
    real = getattr(bind, "nixlAgentConfig", None)
    if bind is None or real is None:
        return nixl_agent(name, config)

    class Polled(real):  # type: ignore[misc, valid-type]
        def __setattr__(self, key: str, value) -> None:
            if key == "pthrDelay":
                value = max(int(value), PROGRESS_POLL_US)
            super().__setattr__(key, value)

    with _CONSTRUCT:
        bind.nixlAgentConfig = Polled
        try:
            return nixl_agent(name, config)
        finally:
            bind.nixlAgentConfig = real


_THREAD = threading.local()


def _bind_cuda(device: int) -> None:
    """Make ``device``'s context current on this thread (a peer's worker) before UCX reads its memory: UCX's CUDA
    transports work in the calling thread's current context."""
    if getattr(_THREAD, "cuda_device", None) != device:
        torch.cuda.set_device(device)
        _THREAD.cuda_device = device


def _descs(agent, addr: np.ndarray, length: np.ndarray, device: int):
    """A NIXL transfer descriptor list ``[(addr, len, device)]`` (``DRAM`` for device -1, else ``VRAM``)."""
    rows = np.empty((addr.shape[0], 3), dtype=np.uint64)
    rows[:, 0] = addr
    rows[:, 1] = length
    rows[:, 2] = max(device, 0)
    return agent.get_xfer_descs(rows, "DRAM" if device < 0 else "VRAM")


@dataclass(frozen=True, slots=True)
class _Regions:
    """Registered regions, ascending and disjoint: base address, length, device (-1: host memory)."""

    addr: np.ndarray
    nbytes: np.ndarray
    device: np.ndarray

    @classmethod
    def empty(cls) -> _Regions:
        z = np.zeros(0, dtype=np.int64)
        return cls(z, z, z)

    @classmethod
    def of(cls, rows: Iterable[tuple[int, int, int]]) -> _Regions:
        a = np.array(sorted(rows), dtype=np.int64).reshape(-1, 3)
        return cls(a[:, 0].copy(), a[:, 1].copy(), a[:, 2].copy())

    def overlaps(self, addr: int, nbytes: int) -> bool:
        i = int(np.searchsorted(self.addr, addr, side="right")) - 1
        before = i >= 0 and int(self.addr[i] + self.nbytes[i]) > addr
        after = i + 1 < self.addr.shape[0] and int(self.addr[i + 1]) < addr + nbytes
        return before or after

    def devices(self, addr: np.ndarray, length: np.ndarray) -> np.ndarray | None:
        """Device of the region holding each ``[addr, addr + length)``; ``None`` if one lies outside every region."""
        if self.addr.shape[0] == 0 or np.any(length <= 0):
            return None
        i = np.searchsorted(self.addr, addr, side="right") - 1
        ok = i >= 0
        i = np.maximum(i, 0)
        if not bool(np.all(ok & (addr + length <= self.addr[i] + self.nbytes[i]))):
            return None
        return self.device[i]


@dataclass(slots=True)
class _Peer:
    record: AgentRecord
    regions: _Regions
    loaded: bool
    """Whether the agent holds the record's metadata now (False after a failed call dropped the connection)."""


class _CallFailed(Exception):
    rc = RC_FAILED


class _CallTimedOut(_CallFailed):
    rc = RC_TIMEOUT


class NixlEngine(_EngineBase):
    """A NIXL agent (UCX backend) behind dtkv's engine surface; its session is ``nixl:{name}`` (module docstring).

    It writes to a peer once it has loaded the peer's :class:`~dtkv.transfer.messages.AgentRecord`
    (:meth:`add_peer`; :meth:`dtkv.transfer.TransferSide.connect` does it for the ranks a side sends to, with the
    records their sides published next to their endpoints).

    Args:
        timeout_s: the engine's own bound on one call (default ``DTKV_TRANSFER_TIMEOUT_S``; at least 5 s, like
            Mooncake's ``MC_TRANSFER_TIMEOUT``).
        name: the agent's name (default: ``dtkv-{pid}-{random}``; letters, digits, ``._-``, at most 128).
        batch_entries: descriptors per NIXL transfer request (default :data:`BATCH_ENTRIES`).
        inflight: transfer requests of one call posted at once (default :data:`INFLIGHT_PER_PEER`).

    Raises:
        ImportError: ``nixl`` is not installed (the message says what to install).
        ValueError: ``name``, ``batch_entries`` or ``inflight`` is out of range.
        TransferError: the agent or its UCX backend did not start.
    """

    takes_arrays = True

    def __init__(
        self,
        *,
        timeout_s: float | None = None,
        name: str | None = None,
        batch_entries: int = BATCH_ENTRIES,
        inflight: int = INFLIGHT_PER_PEER,
    ) -> None:
        super().__init__()
        name = f"dtkv-{os.getpid()}-{secrets.token_hex(6)}" if name is None else name
        if not AGENT_NAME.fullmatch(name):
            raise ValueError(f"name must match {AGENT_NAME.pattern}, got name={name!r}")
        if not 1 <= batch_entries <= 1 << 20:
            raise ValueError(f"batch_entries must be in [1, {1 << 20}], got batch_entries={batch_entries}")
        if not 1 <= inflight <= 64:
            raise ValueError(f"inflight must be in [1, 64], got inflight={inflight}")
        self.name = name
        self.session = SESSION_PREFIX + name
        self.batch_entries = int(batch_entries)
        self.inflight = int(inflight)
        timeout = transfer_timeout_s() if timeout_s is None else float(timeout_s)
        self._transfer_timeout_s = max(5.0, timeout)
        apply_nixl_env()
        try:
            from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
        except ImportError as e:
            raise ImportError(
                f"NixlEngine needs `pip install 'dtkv[nixl]'` (nixl 1.5); importing nixl failed: {e}"
            ) from e
        config = nixl_agent_config(
            enable_prog_thread=True,
            enable_listen_thread=False,
            backends=["UCX"],
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,  # peers' worker threads call the agent at once
        )
        try:
            agent = _polled_agent(nixl_agent, name, config)
        except Exception as e:  # noqa: BLE001 - NIXL raises its own error types
            raise TransferError(f"starting NIXL agent {name!r} failed: {type(e).__name__}: {e}", request_id="-",
                                peer=self.session) from e  # fmt: skip
        if "UCX" not in agent.backends:
            raise TransferError(
                f"NIXL agent {name!r} started without its UCX backend (plugins: {agent.get_plugin_list()})",
                request_id="-",
                peer=self.session,
            )
        self._agent = agent
        self._reg_lock = threading.Lock()
        self._tensors: dict[int, tuple[torch.Tensor, object]] = {}
        """Registered base address -> (tensor kept alive, NIXL registration list)."""
        self._table = _Regions.empty()
        self._generation = 0
        self._peers: dict[str, _Peer] = {}
        self._peer_lock = threading.Lock()
        self._errors: dict[str, str] = {}

    # ------------------------------------------------------------------------------------------ memory
    @property
    def registered(self) -> int:
        """Number of registered regions (bookkeeping: returns to 0 once every side closed)."""
        return len(self._tensors)

    @property
    def generation(self) -> int:
        """Registrations and unregistrations so far (the record's ``generation``)."""
        return self._generation

    def call_timeout_s(self) -> float:
        """``timeout_s`` + 1 ns per registered byte + 1 s: no call outlives it (it ends itself before)."""
        return self._transfer_timeout_s + int(self._table.nbytes.sum()) * 1e-9 + 1.0

    def register(self, tensors: Sequence[torch.Tensor]) -> None:
        """Register each tensor's storage (contiguous; host or CUDA memory) for transfers in both directions.

        Raises:
            ValueError: a tensor is not contiguous or lives on a device other than the CPU or CUDA.
            TransferError: a region overlaps one registered already, or NIXL refused it (nothing of this call
                stays registered).
        """
        rows: list[tuple[torch.Tensor, int, int, int]] = []
        for t in tensors:
            if not t.numel():
                continue
            if not t.is_contiguous():
                raise ValueError(f"tensors must be contiguous to register, got one of stride {t.stride()}")
            if t.device.type not in ("cpu", "cuda"):
                raise ValueError(f"tensors must be host or CUDA memory, got device {t.device}")
            rows.append((t, t.data_ptr(), t.numel() * t.element_size(), t.get_device() if t.is_cuda else -1))
        with self._reg_lock:
            table = self._table
            spans = sorted((addr, nbytes) for _, addr, nbytes, _ in rows)
            for k, (addr, nbytes) in enumerate(spans):
                if table.overlaps(addr, nbytes) or (k and spans[k - 1][0] + spans[k - 1][1] > addr):
                    raise TransferError(
                        f"region [{addr:#x}, +{nbytes}) overlaps one registered already", request_id="-",
                        peer=self.session,
                    )  # fmt: skip
            done: list[int] = []
            try:
                for t, addr, nbytes, dev in rows:
                    seg = "DRAM" if dev < 0 else "VRAM"
                    reg = self._agent.register_memory([(addr, nbytes, max(dev, 0), "")], seg)
                    self._tensors[addr] = (t, reg)
                    done.append(addr)
            except Exception as e:  # noqa: BLE001 - NIXL raises its own error types
                for addr in done:
                    self._deregister(addr)
                raise TransferError(f"NIXL register_memory failed: {type(e).__name__}: {e}", request_id="-",
                                    peer=self.session) from e  # fmt: skip
            self._rebuild_table()

    def _deregister(self, addr: int) -> None:
        _, reg = self._tensors.pop(addr)
        try:
            self._agent.deregister_memory(reg)
        except Exception as e:  # noqa: BLE001 - keep going: the other regions must be released too
            logger.warning("NIXL deregister_memory of %#x failed: %s", addr, e)

    def _rebuild_table(self) -> None:
        rows = [(a, t.numel() * t.element_size(), t.get_device() if t.is_cuda else -1)
                for a, (t, _) in self._tensors.items()]  # fmt: skip
        self._table = _Regions.of(rows)
        self._generation += 1

    def _unregister_now(self, tensors: Sequence[torch.Tensor]) -> None:
        with self._reg_lock:
            ptrs = [t.data_ptr() for t in tensors if t.numel() and t.data_ptr() in self._tensors]
            for p in ptrs:
                self._deregister(p)
            if ptrs:
                self._rebuild_table()

    # ------------------------------------------------------------------------------------------ metadata
    def agent_record(self) -> AgentRecord:
        """This engine's agent metadata and the regions registered now (what a peer needs to write to it)."""
        with self._reg_lock:
            table, generation = self._table, self._generation
            metadata = self._agent.get_agent_metadata()
        return AgentRecord(
            name=self.name,
            generation=generation,
            metadata=bytes(metadata),
            region_addr=table.addr,
            region_bytes=table.nbytes,
            region_device=table.device,
        )

    def check_sessions(self, sessions: Iterable[str]) -> None:
        for session in sessions:
            if self._agent_name(session) is None:
                raise TransferError(
                    f"session {session[:80]!r} is not a NIXL agent's ({SESSION_PREFIX}NAME): both sides must use "
                    "the same transfer engine",
                    request_id="-",
                    peer=session,
                )

    def add_peer(self, record: AgentRecord, *, deadline: float) -> None:
        """Load ``record`` (another engine's :meth:`agent_record`), on the peer's worker: after the calls queued for
        it, never during one. A record of an older or the same generation as the one loaded is ignored."""
        session = SESSION_PREFIX + record.name
        with self._peer_lock:
            known = self._peers.get(record.name)
        if known is not None and known.loaded and known.record.generation >= record.generation:
            return
        fut = self.submit(session, self._load, record)
        try:
            fut.result(timeout=max(0.0, time_left(deadline)))
        except FutureTimeout:
            raise TransferError(
                "timed out loading the peer's NIXL metadata (a call to it is still running)",
                request_id="-",
                peer=session,
            ) from None

    def _load(self, record: AgentRecord) -> None:
        """(On the peer's worker.) Replace the peer's metadata with ``record``'s."""
        regions = _Regions(record.region_addr, record.region_bytes, record.region_device)
        if record.name == self.name:  # loopback: NIXL writes within the agent itself, no metadata to load
            with self._peer_lock:
                self._peers[record.name] = _Peer(record, regions, True)
            return
        with self._peer_lock:
            known = self._peers.get(record.name)
        if known is not None and known.loaded and known.record.generation >= record.generation:
            return
        self._disconnect(record.name)
        try:
            got = self._agent.add_remote_agent(record.metadata)
        except Exception as e:  # noqa: BLE001 - NIXL raises its own error types
            raise TransferError(f"NIXL refused agent {record.name!r}'s metadata: {type(e).__name__}: {e}",
                                request_id="-", peer=SESSION_PREFIX + record.name) from e  # fmt: skip
        got = got.decode() if isinstance(got, bytes) else str(got)
        if got != record.name:
            self._agent.remove_remote_agent(got)
            raise TransferError(
                f"agent record {record.name!r} carries the metadata of agent {got!r}",
                request_id="-",
                peer=SESSION_PREFIX + record.name,
            )
        with self._peer_lock:
            self._peers[record.name] = _Peer(record, regions, True)

    def _disconnect(self, name: str) -> None:
        """Drop the agent's copy of ``name``'s metadata and its connection (no-op if not loaded)."""
        with self._peer_lock:
            peer = self._peers.get(name)
            if peer is None or not peer.loaded or name == self.name:
                return
            peer.loaded = False
        try:
            self._agent.remove_remote_agent(name)
        except Exception as e:  # noqa: BLE001 - it is gone either way
            logger.debug("NIXL remove_remote_agent(%r): %s", name, e)

    @staticmethod
    def _agent_name(session: str) -> str | None:
        if not session.startswith(SESSION_PREFIX):
            return None
        name = session[len(SESSION_PREFIX) :]
        return name if AGENT_NAME.fullmatch(name) else None

    # ------------------------------------------------------------------------------------------ writes
    def last_error(self, peer: str) -> str:
        """Why the last failed call to ``peer`` failed ("" if none did)."""
        return self._errors.get(peer, "")

    def _fail(self, peer: str, why: str, rc: int = RC_FAILED) -> int:
        self._errors[peer] = why
        return rc

    def write(self, peer: str, src: Sequence[int] | np.ndarray, dst: Sequence[int] | np.ndarray,
              length: Sequence[int] | np.ndarray) -> int:  # fmt: skip
        """Write ``length[i]`` bytes from local ``src[i]`` to ``peer``'s ``dst[i]`` (lists or int64 arrays
        ``[num_entries]``); 0, or :data:`RC_FAILED` / :data:`RC_TIMEOUT` (:meth:`last_error` says why)."""
        name = self._agent_name(peer)
        with self._peer_lock:
            state = self._peers.get(name) if name is not None else None
        if name is None or state is None:
            return self._fail(peer, "the peer's agent record is not loaded (add_peer: the side's connect())")
        s, d, n = (np.asarray(x, dtype=np.int64).reshape(-1) for x in (src, dst, length))
        if not s.shape == d.shape == n.shape:
            return self._fail(
                peer, f"src, dst and length must have one value per entry, got {s.size}, {d.size}, {n.size}"
            )
        if n.size == 0:
            return 0
        local = self._table
        remote = local if name == self.name else state.regions  # loopback: this engine's live registrations
        src_dev, dst_dev = local.devices(s, n), remote.devices(d, n)
        if src_dev is None or dst_dev is None:
            side = "source" if src_dev is None else "destination"
            return self._fail(peer, f"an entry's {side} lies outside the registered regions (nothing was posted)")
        deadline = time.monotonic() + self._transfer_timeout_s + int(n.sum()) * 1e-9
        try:
            if not state.loaded:  # an earlier failure dropped the connection: reconnect from the record
                self._load(state.record)
            self._run(name, self._batches(s, d, n, src_dev, dst_dev), deadline)
        except _CallFailed as e:
            self._disconnect(name)
            return self._fail(peer, str(e), e.rc)
        except Exception as e:  # noqa: BLE001 - NIXL raises its own error types; the caller gets a return code
            self._disconnect(name)
            return self._fail(peer, f"{type(e).__name__}: {e}")
        self._errors.pop(peer, None)
        return 0

    def _batches(self, s, d, n, src_dev, dst_dev) -> list[tuple[object, object]]:
        """NIXL descriptor-list pairs: one group per (source device, destination device), cut into batches.

        The grouping is one comparison when every entry has one pair of devices (host to host, or one GPU to
        one GPU: the usual case); ``np.unique`` over the rows of device pairs cost 0.4 ms per call of 1024 entries
        (a tenth of UCX's own per-descriptor cost on CPU loopback)."""
        key = (src_dev + 1) * 2048 + (dst_dev + 1)  # devices are -1..1023 (AgentRecord's range)
        first = int(key[0])
        groups: list[tuple[int, int, np.ndarray | None]]
        if bool(np.all(key == first)):
            groups = [(int(src_dev[0]), int(dst_dev[0]), None)]
        else:
            groups = [(k // 2048 - 1, k % 2048 - 1, np.flatnonzero(key == k)) for k in np.unique(key).tolist()]
        out = []
        for sd, dd, idx in groups:
            if sd >= 0:
                _bind_cuda(sd)
            total = n.shape[0] if idx is None else idx.shape[0]
            for lo in range(0, total, self.batch_entries):
                sel = slice(lo, lo + self.batch_entries) if idx is None else idx[lo : lo + self.batch_entries]
                out.append((_descs(self._agent, s[sel], n[sel], sd), _descs(self._agent, d[sel], n[sel], dd)))
        return out

    def _run(self, name: str, batches: list[tuple[object, object]], deadline: float) -> None:
        """Post the batches, at most :attr:`inflight` at once, and wait until all are done (or raise)."""
        agent = self._agent
        pending: list = []
        i, pause = 0, 0.0
        try:
            while i < len(batches) or pending:
                while i < len(batches) and len(pending) < self.inflight:
                    handle = agent.initialize_xfer("WRITE", *batches[i], name)
                    pending.append(handle)
                    i += 1
                    if agent.transfer(handle) == "ERR":
                        raise _CallFailed(f"NIXL posted request {i} of {len(batches)} with an error")
                still = []
                for handle in pending:
                    state = agent.check_xfer_state(handle)
                    if state == "PROC":
                        still.append(handle)
                    elif state == "DONE":
                        handle.release()
                    else:
                        raise _CallFailed(f"a NIXL transfer request of the call failed ({state})")
                pending = still
                if pending:
                    if time.monotonic() >= deadline:
                        raise _CallTimedOut(f"the call timed out after {self._transfer_timeout_s:.0f} s (NIXL timeout)")
                    time.sleep(pause)
                    pause = min(_POLL_MAX_S, pause * 2 or 2e-5)
        finally:
            for handle in pending:
                try:
                    handle.release()
                except Exception as e:  # noqa: BLE001 - the connection is dropped next
                    logger.debug("releasing a NIXL transfer request failed: %s", e)

    def _release(self) -> None:
        if getattr(self, "_agent", None) is None:
            return
        with self._peer_lock:
            names = [n for n, p in self._peers.items() if p.loaded]
        for n in names:
            self._disconnect(n)
        with self._reg_lock:
            for addr in list(self._tensors):
                self._deregister(addr)
            self._table = _Regions.empty()
        self._agent = None  # the agent stops its progress thread and closes its UCX worker
