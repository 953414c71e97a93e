"""Shared pieces of the transfer tests: small layouts, seeded shards, reassembly, store faults.

- ``StoreHost`` runs a ``TCPStore`` in a child process (``python -c``), so that a test can ``SIGSTOP`` it (a store
  that stops answering), ``SIGCONT`` it, or kill it.
- ``SlowLink`` is one party's link to the store made slow on demand (the other parties' links stay fast).
- ``StorePeer`` is a store peer without the secret: it records every value the parties write and can write any of
  them back later (a replay).
- ``NEEDS_MOONCAKE``: the marks of a test of the Mooncake engine (``mooncake``, and a skip saying why where the
  engine does not load).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from dtkv import IndexerFp8Layout, MLAFp8Layout, PageOwnership
from dtkv.transfer import KVShard, mooncake_available

_MOONCAKE_OK, _MOONCAKE_WHY = mooncake_available()
NEEDS_MOONCAKE = [
    pytest.mark.mooncake,
    pytest.mark.skipif(not _MOONCAKE_OK, reason=f"Mooncake transfer engine unavailable: {_MOONCAKE_WHY}"),
]
"""Marks of a test (or a module's ``pytestmark``) that runs the Mooncake engine."""

LAYERS = 2
LAYOUTS = {
    "kv": MLAFp8Layout(page_size=4, kv_lora_rank=32, rope_dim=8, quant_block=16),
    "index": IndexerFp8Layout(page_size=4, head_dim=16),
}


def fill(shard: KVShard, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for buf in shard.buffers.values():
        u8 = buf.view(torch.uint8)
        u8.copy_(torch.randint(0, 256, u8.shape, generator=g, dtype=torch.uint8))


def shards(own: PageOwnership, *, num_layers: int = LAYERS, seed: int | None = None, **kw) -> list[KVShard]:
    out = [KVShard.allocate(LAYOUTS, own, r, num_layers=num_layers, **kw) for r in range(own.cp_size)]
    if seed is not None:
        for s in out:
            fill(s, seed + s.rank)
    return out


def pages(shard_list: list[KVShard], name: str, logical: object) -> torch.Tensor:
    """Bytes ``[num_layers, len(logical), page_bytes]`` of logical pages gathered from their owners."""
    own = shard_list[0].ownership
    by_rank = {s.rank: s for s in shard_list}
    idx = torch.as_tensor(np.asarray(logical, dtype=np.int64))
    owner, local = own.owner(idx), own.local_index(idx)
    out = []
    for o, j in zip(owner.tolist(), local.tolist()):
        buf = by_rank[o].buffers[name]
        out.append(buf[:, j].contiguous().view(torch.uint8).reshape(buf.shape[0], -1))
    nl = shard_list[0].num_layers
    return torch.stack(out, 1) if out else torch.zeros(nl, 0, 0, dtype=torch.uint8)


def same_pages(pre: list[KVShard], src: object, dec: list[KVShard], dst: object) -> bool:
    return all(torch.equal(pages(pre, n, src), pages(dec, n, dst)) for n in LAYOUTS)


def non_loopback_addresses() -> list[str]:
    """This machine's addresses other than loopback (IPv4 through a routing lookup, global IPv6 from /proc)."""
    out = []
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only asks the kernel for the route's source
            addr = s.getsockname()[0]
            if not addr.startswith("127."):
                out.append(addr)
    except OSError:
        pass
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                hexaddr, _, _, scope, _, name = line.split()
                if name != "lo" and scope == "00":
                    out.append(":".join(hexaddr[i : i + 4] for i in range(0, 32, 4)))
    except OSError:
        pass
    return out


def reachable(addr: str, port: int, timeout_s: float = 1.0) -> bool:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        return s.connect_ex((addr, port)) == 0


_HOST = """
import sys, time
from dtkv.transfer import create_store
store = create_store(port=0, is_master=True, timeout_s=60)
print(store.port, flush=True)
sys.stdin.read()
"""


class StoreHost:
    """A ``TCPStore`` master in a child process (``create_store``); ``stop()`` / ``cont()`` / ``kill()`` it."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _HOST], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=os.getcwd(), text=True
        )
        self.port = int(self.proc.stdout.readline())

    def client(self, timeout_s: float = 60.0):
        from dtkv.transfer import create_store

        return create_store(port=self.port, is_master=False, timeout_s=timeout_s)

    def stop(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)
        time.sleep(0.05)

    def cont(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        self.kill()


class SlowLink:
    """One party's link to the store (``bootstrap.store``), forwarding every call; while :meth:`stall` is in effect
    the next ``calls`` named calls wait ``delay_s`` before reaching the store (``where="before"``: the write lands
    late) or after it answered (``"after"``: the write has landed, the reply is late). Install with
    :meth:`install`."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self._slow: dict[str, tuple[float, str]] = {}
        self._left = 0
        self._lock = threading.Lock()
        self.stalled_calls = 0
        self.landed = threading.Event()
        """Set once a stalled call has reached the store and returned."""

    @classmethod
    def install(cls, bootstrap) -> SlowLink:
        bootstrap.store = link = cls(bootstrap.store)
        return link

    def stall(self, *names: str, delay_s: float, where: str = "before", calls: int = 1) -> None:
        self.landed.clear()
        self._left = calls
        for name in names:
            self._slow[name] = (delay_s, where)

    def unstall(self) -> None:
        self._slow.clear()

    def __getattr__(self, name: str):
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            delay_s, where = self._slow.get(name, (0.0, ""))
            with self._lock:
                slow = bool(delay_s) and self._left > 0
                self._left -= slow
            if not slow:
                return attr(*args, **kwargs)
            self.stalled_calls += 1
            if where == "before":
                time.sleep(delay_s)
            out = attr(*args, **kwargs)
            if where == "after":
                time.sleep(delay_s)
            self.landed.set()
            return out

        return call


class StorePeer:
    """A store peer without the secret: it sees every value a party writes (install it on every party's
    ``bootstrap``) and can write recorded values back under their keys, bytes unchanged (a replay)."""

    def __init__(self, store, namespace: str) -> None:
        self.store = store
        self.namespace = namespace
        self.history: dict[str, list[bytes]] = {}
        """key (without the namespace) -> every value written under it, in order."""
        self.lock = threading.Lock()

    def install(self, bootstrap) -> None:
        peer, inner = self, bootstrap.store

        class Tap:
            def __getattr__(self, name: str):
                return getattr(inner, name)

            def set(self, key, value):
                peer._seen(key, value)
                return inner.set(key, value)

            def compare_set(self, key, expected, desired):
                out = inner.compare_set(key, expected, desired)
                if out == desired:
                    peer._seen(key, desired)
                return out

        bootstrap.store = Tap()

    def _seen(self, key: str, value) -> None:
        with self.lock:
            self.history.setdefault(key, []).append(bytes(value))

    def replayable(self, prefix: str) -> dict[str, bytes]:
        """What a replay of the attempts under ``prefix`` writes back: each prefill slot's first value (OPEN:
        claimable again) and every other key's last one (the epoch pointer, decode slots READY, answers)."""
        with self.lock:
            return {
                k: v[0] if "/prefill/" in k else v[-1]
                for k, v in self.history.items()
                if k == prefix or k.startswith(prefix + "/")
            }

    def mark(self) -> dict[str, int]:
        """How many values each key has had so far (for :meth:`written_since`)."""
        with self.lock:
            return {k: len(v) for k, v in self.history.items()}

    def written_since(self, mark: dict[str, int]) -> list[str]:
        """The keys the parties wrote since ``mark``."""
        with self.lock:
            return sorted(k for k, v in self.history.items() if len(v) > mark.get(k, 0))

    def replay(self, values: dict[str, bytes], *, last: str | None = None) -> None:
        """Write ``values`` back (``last`` after the others: the epoch pointer, which makes an attempt visible)."""
        for key, raw in sorted(values.items(), key=lambda kv: kv[0] == last):
            self.store.set(f"{self.namespace}/{key}", raw)


def run_bounded(fn, *args, limit_s: float, **kwargs) -> tuple[float, object]:
    """``(elapsed, result or exception)`` of ``fn`` run in a thread; ``(inf, None)`` if it is still running after
    ``limit_s`` (the thread is left behind, daemon)."""
    box: list = []

    def run() -> None:
        try:
            box.append(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box.append(e)

    t0 = time.monotonic()
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(limit_s)
    if th.is_alive():
        return float("inf"), None
    return time.monotonic() - t0, box[0]
