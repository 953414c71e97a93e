"""Rendezvous of prefill ranks and decode through a ``torch.distributed`` store: bounded, authenticated access.

Decode is not a member of the prefill process group, so the two sides meet in a key-value store: a ``TCPStore``
(one process hosts it with :func:`create_store` ``(is_master=True)``, which listens on the given host only; the
others connect with its port) or a ``FileStore`` on a shared path. :class:`Bootstrap` is the only code that
touches the store; the keys and the protocol are :mod:`dtkv.transfer.protocol`.

- **No code from the store.** Values are fixed-schema records (:mod:`dtkv.transfer.wire`); anything malformed is
  a :class:`dtkv.transfer.TransferError` naming the key. With a shared secret (``DTKV_TRANSFER_SECRET``, or
  ``secret=``) every value carries an HMAC-SHA256 tag over its key and bytes; unsigned or forged values are
  refused.
- **Every call is bounded.** ``torch.distributed`` store calls block until the store answers, whatever their
  timeout, when the store host stops answering (a ``SIGSTOP``, a network partition). Each call therefore runs on
  the bootstrap's worker thread while the caller waits at most the time left to its deadline, then raises a
  ``TransferError``. Calls run in submission order on that one thread, so a call that outlived its caller still
  lands, in order, once the store answers again (the protocol relies on this for cleanup); a read that had not
  started is dropped. A timeout that found another call on the thread names it and how long it has run (a queue
  behind one slow call is not a stalled store). The worker thread exits after :data:`WORKER_LINGER_S` without
  work.
- **A clean exit.** At interpreter exit the calls already queued run (for up to :data:`EXIT_FLUSH_S`), then no
  new call starts (:func:`exiting`): a store call still running when the interpreter finalizes would abort the
  process ("terminate called without an active exception") as it returns. A receiver left open, whose thread
  keeps answering claims, would otherwise start one at any moment.
"""

from __future__ import annotations

import atexit
import collections
import ipaddress
import logging
import socket
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from dtkv._env import transfer_secret
from dtkv.transfer.descriptors import RankEndpoint
from dtkv.transfer.errors import StoreTimeout, TransferError
from dtkv.transfer.messages import AgentRecord, endpoint_fields, endpoint_from_fields
from dtkv.transfer.protocol import Backoff, agent_key, endpoint_key, time_left
from dtkv.transfer.wire import Kind, WireError, pack, unpack

__all__ = ["WORKER_LINGER_S", "Bootstrap", "create_store", "exiting"]

logger = logging.getLogger(__name__)

WORKER_LINGER_S = 0.25
"""Seconds the store worker thread waits for more work before it exits."""

EXIT_FLUSH_S = 5.0
"""At interpreter exit, how long queued store calls (cleanup, reports) may still take to run."""

T = TypeVar("T")

_EXITING = threading.Event()


def exiting() -> bool:
    """Whether the interpreter is exiting: store calls queued from then on fail at once (module docstring)."""
    return _EXITING.is_set()


_ANY_HOST = ("", "0.0.0.0", "::", "*")


def create_store(host: str = "127.0.0.1", port: int = 0, *, is_master: bool, timeout_s: float = 30.0) -> dist.TCPStore:
    """A ``TCPStore`` client of ``host:port``, or (``is_master=True``) the store itself, listening on ``host`` only.

    ``torch.distributed.TCPStore`` binds every interface whatever host it is given; the master here binds its
    listening socket to ``host`` itself and hands it over (``master_listen_fd``), so a store created for
    ``"127.0.0.1"`` is reachable from this machine only. Pass ``host="0.0.0.0"`` (or ``"::"``) to listen
    everywhere. ``port=0`` picks a free port (read it from ``store.port``).
    """
    timeout = timedelta(seconds=timeout_s)
    if not is_master:
        return dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)
    sock = _listen(host, port)
    try:
        address = sock.getsockname()[0] if host not in _ANY_HOST else "127.0.0.1"
        store = dist.TCPStore(
            address,
            sock.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            timeout=timeout,
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now
    return store


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host`` (an address, a name -- its first IPv4 address if it has one -- or any)."""
    if host in _ANY_HOST:
        family, addr = socket.AF_INET6, ("::", port)
    else:
        try:
            ip = ipaddress.ip_address(host)
            family, addr = (socket.AF_INET6 if ip.version == 6 else socket.AF_INET), (host, port)
        except ValueError:  # a host name
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            info = next((i for i in infos if i[0] == socket.AF_INET), infos[0])
            family, addr = info[0], info[4][:2]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if host in _ANY_HOST:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(addr)
        sock.listen(512)
    except BaseException:
        sock.close()
        raise
    return sock


class _StoreWorker:
    """One thread running store calls in submission order; it exits when idle and restarts on demand."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: collections.deque[tuple[Future, Callable[[], object], str]] = collections.deque()
        self._cv = threading.Condition()
        self._alive = False
        self._busy = False
        self._running: tuple[Future, str, float] | None = None
        """The call on the thread now: its future, what it is, when it started (``time.monotonic``)."""
        _WORKERS.add(self)

    def submit(self, fn: Callable[[], T], what: str = "a store call") -> Future:
        fut: Future = Future()
        with self._cv:
            if _EXITING.is_set():  # checked under the lock that flush() waits on: nothing starts after it
                fut.set_exception(
                    TransferError("the interpreter is exiting: no new store call starts", request_id="-", peer="store")
                )
                return fut
            self._queue.append((fut, fn, what))
            if self._alive:
                self._cv.notify()
            else:
                self._alive = True
                threading.Thread(target=self._run, name=self._name, daemon=True).start()
        return fut

    def _run(self) -> None:
        while True:
            with self._cv:
                self._busy = False
                self._running = None
                self._cv.notify_all()
                if not self._queue:
                    self._cv.wait(WORKER_LINGER_S)
                if not self._queue:
                    self._alive = False
                    return
                fut, fn, what = self._queue.popleft()
                self._busy = True
                self._running = (fut, what, time.monotonic())
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                fut.set_exception(e)

    def blocker(self, fut: Future) -> str:
        """Why ``fut`` has not run yet, when another call holds the thread: ``"; it waited behind <what>, running
        for <s> s"`` (``""`` when ``fut`` itself runs or the thread is free): a stalled store and a queue behind
        one slow call read differently."""
        with self._cv:
            running = self._running
        if running is None or running[0] is fut:
            return ""
        return f"; it waited behind {running[1]}, running for {time.monotonic() - running[2]:.2f} s"

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until every submitted call has run; whether they all have."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._busy, timeout=max(0.0, timeout_s))


_WORKERS: weakref.WeakSet[_StoreWorker] = weakref.WeakSet()


@atexit.register
def _flush_at_exit() -> None:
    """Let the store calls queued so far (a request's cleanup, a late report) run before the interpreter goes away,
    and start none after them: a daemon thread still inside a store call at finalization would abort the process.
    Bounded by :data:`EXIT_FLUSH_S`."""
    _EXITING.set()
    deadline = time.monotonic() + EXIT_FLUSH_S
    for worker in list(_WORKERS):
        worker.flush(deadline - time.monotonic())


class Bootstrap:
    """Namespaced, deadline-bounded, authenticated access to a ``torch.distributed`` store (module docstring).

    Args:
        store: a ``TCPStore`` (see :func:`create_store`) or ``FileStore`` every participant reaches.
        namespace: key prefix, so several PD pairs can share one store.
        secret: shared secret authenticating every value (str or bytes); default ``DTKV_TRANSFER_SECRET``,
            ``None`` or empty: values are not signed (and signed ones are refused).
    """

    def __init__(self, store: dist.Store, *, namespace: str = "dtkv", secret: bytes | str | None = ...) -> None:
        self.store = dist.PrefixStore(namespace, store)  # keys are "{namespace}/{key}"
        self.namespace = namespace
        if secret is ...:
            secret = transfer_secret()
        self.secret: bytes | None = (secret.encode() if isinstance(secret, str) else secret) or None
        self._worker = _StoreWorker(f"dtkv-store-{namespace[:16]}")

    # ------------------------------------------------------------------------------------------ calls
    def call(
        self,
        fn: Callable[[dist.Store], T],
        *,
        deadline: float,
        what: str,
        request_id: str = "-",
        peer: str = "store",
        write: bool = False,
    ) -> T:
        """Run ``fn(store)`` on the worker, waiting at most until ``deadline``.

        ``write=False`` drops the call if it has not started by then; a write still runs, in order, later.

        Raises:
            StoreTimeout: the store did not answer in time.
            TransferError: the call failed.
        """
        left = time_left(deadline)
        if left <= 0:
            raise StoreTimeout(f"timed out before the store call {what}", request_id=request_id, peer=peer)
        fut = self._worker.submit(lambda: fn(self.store), what)
        try:
            return fut.result(timeout=left)
        except FutureTimeout:
            ahead = self._worker.blocker(fut)
            if not write:
                fut.cancel()
            raise StoreTimeout(
                f"the store did not answer {what} within {left:.2f} s (stalled or unreachable{ahead})",
                request_id=request_id,
                peer=peer,
            ) from None
        except TransferError:
            raise
        except Exception as e:  # noqa: BLE001 - the store transport raises several kinds
            raise TransferError(f"store call {what} failed: {e}", request_id=request_id, peer=peer) from e

    def post(self, fn: Callable[[dist.Store], object], *, what: str) -> Future:
        """Queue ``fn(store)`` without waiting (cleanup, late markers); a failure is logged."""

        def run() -> object:
            try:
                return fn(self.store)
            except Exception as e:  # noqa: BLE001 - nobody waits for it: log
                logger.warning("store call %s (namespace %r) failed: %s", what, self.namespace, e)
                raise

        return self._worker.submit(run, what)

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every queued call (e.g. before closing); whether they all ran."""
        return self._worker.flush(timeout_s)

    # ------------------------------------------------------------------------------------------ values
    def encode(self, key: str, msg) -> bytes:
        """The bytes of record ``msg`` stored under ``key`` (signed when a secret is set)."""
        return pack(msg.KIND, msg.to_fields(), key=key, secret=self.secret)

    def decode(self, key: str, raw: bytes, *types, request_id: str = "-", peer: str = "store"):
        """Record of one of ``types`` from the bytes of ``key``; a malformed value is a ``TransferError``."""
        by_kind = {t.KIND: t for t in types}
        try:
            kind, fields = unpack(raw, key=key, kinds=tuple(by_kind), secret=self.secret)
            return by_kind[kind].from_fields(fields)
        except WireError as e:
            raise TransferError(
                f"malformed value under key {self.namespace}/{key}: {e}", request_id=request_id, peer=peer
            ) from None

    def set(self, key: str, msg, *, deadline: float, request_id: str = "-", peer: str = "store") -> None:
        raw = self.encode(key, msg)
        self.call(
            lambda s: s.set(key, raw),
            deadline=deadline,
            what=f"set {key!r}",
            request_id=request_id,
            peer=peer,
            write=True,
        )

    def try_get(self, key: str, *types, deadline: float, request_id: str = "-", peer: str = "store"):
        """The record under ``key``, or ``None`` when there is none (one bounded call)."""
        raw = self.call(
            lambda s: s.get(key) if s.check([key]) else None,
            deadline=deadline,
            what=f"get {key!r}",
            request_id=request_id,
            peer=peer,
        )
        return None if raw is None else self.decode(key, raw, *types, request_id=request_id, peer=peer)

    def get(self, key: str, *types, deadline: float, request_id: str = "-", peer: str = "store"):
        """Wait (polling, bounded by ``deadline``) until ``key`` exists; its record."""
        timeout = lambda: TransferError(f"timed out waiting for {key!r}", request_id=request_id, peer=peer)
        backoff = Backoff(deadline, timeout)
        while True:
            if time_left(deadline) <= 0:
                raise timeout()
            msg = backoff.poll(lambda: self.try_get(key, *types, deadline=deadline, request_id=request_id, peer=peer))
            if msg is not None:
                return msg
            backoff.wait()

    def add(self, key: str, amount: int, *, deadline: float, request_id: str = "-", peer: str = "store") -> int:
        """Atomically add ``amount`` to the counter ``key`` (created at 0); the new value."""
        return int(
            self.call(
                lambda s: s.add(key, amount),
                deadline=deadline,
                what=f"add {key!r}",
                request_id=request_id,
                peer=peer,
                write=bool(amount),
            )
        )

    # ------------------------------------------------------------------------------------------ endpoints
    def publish(self, endpoint: RankEndpoint, *, deadline: float) -> None:
        """Post ``endpoint`` under ``{role}/{rank}`` (replacing an earlier incarnation's)."""
        key = endpoint_key(endpoint.role, endpoint.rank)
        raw = pack(Kind.ENDPOINT, endpoint_fields(endpoint), key=key, secret=self.secret)
        self.call(lambda s: s.set(key, raw), deadline=deadline, what=f"set {key!r}", write=True)

    def unpublish(self, endpoint: RankEndpoint) -> Future:
        """Delete ``endpoint``'s key if it is still this incarnation's (queued, not waited for)."""
        key = endpoint_key(endpoint.role, endpoint.rank)

        def drop(s: dist.Store) -> None:
            if s.check([key]) and self._endpoint(key, s.get(key)).incarnation == endpoint.incarnation:
                s.delete_key(key)

        return self.post(drop, what=f"delete {key!r}")

    def endpoint(self, role: str, rank: int, *, deadline: float) -> RankEndpoint:
        """Wait for ``role`` rank ``rank``'s endpoint."""
        key = endpoint_key(role, rank)
        peer = f"{role} rank {rank}"
        timeout = lambda: TransferError(f"timed out waiting for {key!r}", request_id="-", peer=peer)
        backoff = Backoff(deadline, timeout)
        while True:
            if time_left(deadline) <= 0:
                raise timeout()
            raw = backoff.poll(
                lambda: self.call(
                    lambda s: s.get(key) if s.check([key]) else None, deadline=deadline, what=f"get {key!r}", peer=peer
                )
            )
            if raw is not None:
                ep = self._endpoint(key, raw, peer=peer)
                if ep.role != role or ep.rank != rank:
                    raise TransferError(
                        f"malformed value under key {self.namespace}/{key}: it describes {ep.role} rank {ep.rank}",
                        request_id="-",
                        peer=peer,
                    )
                return ep
            backoff.wait()

    def endpoints(self, role: str, *, deadline: float) -> list[RankEndpoint]:
        """Every endpoint of ``role`` (``"prefill"`` or ``"decode"``), rank order, waiting for all of them."""
        first = self.endpoint(role, 0, deadline=deadline)
        return [first] + [self.endpoint(role, r, deadline=deadline) for r in range(1, first.ownership.cp_size)]

    # ------------------------------------------------------------------------------------------ agents
    def publish_agent(self, role: str, rank: int, record: AgentRecord, *, deadline: float) -> None:
        """Post ``record`` (the rank's NIXL agent) under ``{role}/{rank}/agent``, replacing an earlier one."""
        self.set(agent_key(role, rank), record, deadline=deadline, peer=f"{role} rank {rank}")

    def unpublish_agent(self, role: str, rank: int, record: AgentRecord) -> Future:
        """Delete ``{role}/{rank}/agent`` if it still holds ``record`` (same agent, same generation; queued)."""
        key = agent_key(role, rank)

        def drop(s: dist.Store) -> None:
            if s.check([key]):
                got = self.decode(key, s.get(key), AgentRecord, peer=f"{role} rank {rank}")
                if (got.name, got.generation) == (record.name, record.generation):
                    s.delete_key(key)

        return self.post(drop, what=f"delete {key!r}")

    def agent(self, role: str, rank: int, *, deadline: float) -> AgentRecord:
        """Wait for ``role`` rank ``rank``'s agent record."""
        return self.get(agent_key(role, rank), AgentRecord, deadline=deadline, peer=f"{role} rank {rank}")

    def _endpoint(self, key: str, raw: bytes, *, peer: str = "store") -> RankEndpoint:
        try:
            _, fields = unpack(raw, key=key, kinds=Kind.ENDPOINT, secret=self.secret)
            return endpoint_from_fields(fields)
        except WireError as e:
            raise TransferError(
                f"malformed value under key {self.namespace}/{key}: {e}", request_id="-", peer=peer
            ) from None
