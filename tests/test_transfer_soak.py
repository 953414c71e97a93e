"""Soak: 100 requests, 2 prefill ranks -> 2 decode ranks over loopback, with faults at random, once per engine
(Mooncake TCP, NIXL/UCX).

The pytest process hosts the two prefill ranks (one ``PrefillSender`` and one engine each); a child process hosts
the rendezvous store (so that it can be stalled with ``SIGSTOP``); another hosts the two decode ranks (one
``DecodeReceiver`` and one engine each, one thread each). Faults, drawn from a seeded generator:

- ``slow``: one prefill rank's next engine call sleeps past its timeout, then writes (an abandoned call);
- ``decode-timeout``: decode gives up almost at once;
- ``stall``: the store host is stopped for 1.2 s mid-request;
- ``kill``: the decode process is killed mid-request and restarted (its successor finishes what it left open);
- a failed request is retried under the same id half of the time.

Every request either arrives bitwise equal to the baseline (decode compares every page with the seeded
reference when the request reports OK, again before reusing its pages, and once more at the end) or raises
``TransferError``; nothing hangs; threads, sockets, registrations and store keys return to their baselines.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import threading
import time

import numpy as np
import pytest
import torch

from dtkv import PageOwnership
from tests import _engines

pytestmark = [pytest.mark.slow]

NUM_REQUESTS = 500 if os.environ.get("DTKV_TEST_LONG", "0") == "1" else 60
"""Requests of the soak: 60 in CI (one kill, two store stalls and about six random faults of each other kind:
20-35 s on 2 cores), 500 with ``DTKV_TEST_LONG=1``."""
SEED = 20261130
PREFILL_PAGES = 64
DECODE_PAGES = 96
NAMESPACE = "soak"
TIMEOUT_S = 2.0
KILLS = (37, 131)
STALLS = (12, 55, 155)


def _reference():
    from tests._transfer import LAYERS, LAYOUTS

    g = torch.Generator().manual_seed(SEED)
    return {
        n: torch.randint(0, 256, (LAYERS, PREFILL_PAGES, lay.page_bytes), generator=g, dtype=torch.uint8)
        for n, lay in LAYOUTS.items()
    }


def resources() -> dict[str, int]:
    """Threads (Python and OS), socket descriptors of this process."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return {
        "threads": threading.active_count(),
        "tasks": len(os.listdir("/proc/self/task")),
        "sockets": sum(f.startswith("socket:") for f in fds),
    }


def _settled(baseline: dict[str, int], timeout_s: float = 10.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        gc.collect()
        now = resources()
        if now == baseline or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


def _warm_process(kind: str) -> None:
    """Start the threads a process keeps for its lifetime before a baseline is taken: the engine's (Mooncake: 5
    with the first engine, 1 with the first transfer; NIXL: 1 with the first agent, measured) and torch's OpenMP
    pool (with the first parallel op)."""
    from dtkv.transfer.protocol import deadline_after

    torch.ones(1 << 20).sum()
    a, b = _engines.make(kind, timeout_s=5), _engines.make(kind, timeout_s=5)
    dst, src = torch.zeros(64, dtype=torch.uint8), torch.ones(64, dtype=torch.uint8)
    a.register([dst])
    b.register([src])
    if kind == "nixl":
        b.add_peer(a.agent_record(), deadline=deadline_after(10))
    assert b.submit(a.session, b.write, a.session, [src.data_ptr()], [dst.data_ptr()], [64]).result() == 0
    a.close()
    b.close()
    gc.collect()


# ---------------------------------------------------------------------------------------------------- decode side
def _decode_main(conn, kind: str, port: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    from dtkv.transfer import Bootstrap, DecodeReceiver, KVShard, create_store
    from tests._transfer import LAYERS, LAYOUTS

    _warm_process(kind)
    ref = _reference()
    baseline = resources()
    client = create_store(port=port, is_master=False, timeout_s=60)
    own = PageOwnership(2, DECODE_PAGES)
    shards = [KVShard.allocate(LAYOUTS, own, d, num_layers=LAYERS, staging_bytes=1 << 16) for d in range(2)]
    receivers = [
        DecodeReceiver(s, Bootstrap(client, namespace=NAMESPACE), engine=kind, timeout_s=TIMEOUT_S) for s in shards
    ]
    _connect_all(receivers)
    rng = np.random.default_rng(os.getpid())
    owner = own.owner(torch.arange(DECODE_PAGES)).tolist()
    free = {d: set(own.local_pages(d).tolist()) for d in range(2)}  # logical pages per owner
    held: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # OK requests whose pages are still allocated
    limbo: dict[tuple[int, str], set[int]] = {}  # (owner, request) -> pages quarantined after a failure
    bad: list[str] = []

    def intact(dst, src) -> bool:
        for n in LAYOUTS:
            got = torch.stack(
                [
                    shards[int(own.owner(torch.tensor(p)))]
                    .buffers[n][:, int(own.local_index(torch.tensor(p)))]
                    .contiguous()
                    .view(torch.uint8)
                    .reshape(LAYERS, -1)
                    for p in dst
                ],
                1,
            )
            if not torch.equal(got, ref[n][:, torch.from_numpy(src)]):
                return False
        return True

    def reclaim() -> None:
        for d, r in enumerate(receivers):
            for _, pages in r.reclaim():
                free[d].update(p for p in pages.tolist() if int(own.owner(torch.tensor(p))) == d)

    def allocate(n: int) -> np.ndarray:
        while sum(len(f) for f in free.values()) < n and held:
            rid, (dst, src) = next(iter(held.items()))  # free the oldest OK request, after checking it again
            if not intact(dst, src):
                bad.append(f"{rid} changed after it was reported OK")
            del held[rid]
            for p in dst.tolist():
                free[owner[p]].add(p)
        pool = sorted(free[0] | free[1])
        dst = rng.choice(pool, size=n, replace=False)
        for p in dst.tolist():
            free[owner[p]].discard(p)
        return dst

    conn.send(("ready", baseline))
    while True:
        cmd, *args = conn.recv()
        if cmd == "req":
            rid, src, wait_s = args
            reclaim()
            dst = allocate(len(src))
            conn.send(("dst", dst))
            results = _receive_both(receivers, rid, dst, wait_s)
            verified = None
            if results == ["ok", "ok"]:
                verified = intact(dst, src)
                held[rid] = (dst, src)
            else:  # a failed request's pages come back once reclaim() lists it (or at once if never quarantined)
                for p in dst.tolist():
                    d = owner[p]
                    if p in receivers[d].quarantined.get(rid, ()):
                        limbo.setdefault((d, rid), set()).add(p)
                    else:
                        free[d].add(p)
            conn.send(("res", results, verified))
        elif cmd == "close":
            bad.extend(f"{rid} changed after it was reported OK" for rid, (d, s) in held.items() if not intact(d, s))
            registered = _close_all(receivers)
            receivers.clear()
            del client
            conn.send(("closed", bad, registered, _settled(baseline), baseline))
            return


def _receive_both(receivers, rid: str, dst: np.ndarray, wait_s: float) -> list[str]:
    """Each decode rank's verdict, its receiver waiting in a thread of its own (SPMD)."""
    from dtkv.transfer import TransferError

    results = ["HANG", "HANG"]

    def run(d: int) -> None:
        try:
            receivers[d].receive_request(rid, dst, timeout_s=wait_s)
            results[d] = "ok"
        except TransferError as e:
            results[d] = f"TransferError: {e.reason}"
        except BaseException as e:  # noqa: BLE001 - reported, the test fails on it
            results[d] = f"UNEXPECTED {type(e).__name__}: {e}"

    threads = [threading.Thread(target=run, args=(d,)) for d in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(wait_s + 10)
    return results


def _connect_all(sides) -> None:
    for side in sides:
        side.connect(60)


def _send_all(senders, rid: str, src: np.ndarray) -> None:
    """Every prefill rank sends its share; a ``TransferError`` is fine (decode's verdict is checked), anything
    else fails the test."""
    from dtkv.transfer import TransferError

    for sender in senders:
        try:
            sender.send_request(rid, src)
        except TransferError:
            pass


def _close_all(sides) -> int:
    """Close every side; the regions their engines still have registered afterwards."""
    for side in sides:
        side.close()
    return sum(side.engine.registered for side in sides)


class _Decode:
    def __init__(self, kind: str, port: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_decode_main, args=(child, kind, port), daemon=True)
        self.proc.start()
        msg = self.recv(120)
        assert msg[0] == "ready", msg

    def recv(self, timeout_s: float):
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"decode did not answer within {timeout_s} s (alive: {self.proc.is_alive()})")
        return self.conn.recv()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)


# ---------------------------------------------------------------------------------------------------- the soak
def test_soak_faults_at_random(tmp_path, transfer_engine):
    from dtkv.transfer import Bootstrap, KVShard, PrefillSender
    from tests._transfer import LAYERS, LAYOUTS, StoreHost

    engine_kind = transfer_engine
    host = StoreHost()
    decode = None
    try:
        _warm_process(engine_kind)
        keys_client = host.client()
        empty_keys = keys_client.num_keys()
        baseline = resources()
        ref = _reference()
        own_p = PageOwnership(2, PREFILL_PAGES)
        pre = [KVShard.allocate(LAYOUTS, own_p, r, num_layers=LAYERS, staging_bytes=1 << 16) for r in range(2)]
        for s in pre:
            local = own_p.local_pages(s.rank)
            for n, buf in s.buffers.items():
                buf.view(torch.uint8).view(LAYERS, local.numel(), -1).copy_(ref[n][:, local])

        class Slowable(_engines.engine_class(engine_kind)):
            delay_s = 0.0

            def write(self, peer, src, dst, length):
                delay, self.delay_s = self.delay_s, 0.0
                if delay:
                    time.sleep(delay)
                return super().write(peer, src, dst, length)

        engines = [Slowable(timeout_s=5) for _ in range(2)]
        senders = [
            PrefillSender(pre[r], Bootstrap(host.client(), namespace=NAMESPACE), engine=engines[r], timeout_s=TIMEOUT_S)
            for r in range(2)
        ]
        decode = _Decode(engine_kind, host.port)
        _connect_all(senders)
        rng = np.random.default_rng(SEED)
        counts = {"ok": 0, "failed": 0, "retries": 0}
        faults = {"slow": 0, "decode-timeout": 0, "stall": 0, "kill": 0}
        t_start = time.monotonic()
        for i in range(NUM_REQUESTS):
            rid = f"q{i}"
            src = rng.choice(PREFILL_PAGES, size=int(rng.integers(1, 13)), replace=False)
            for attempt in range(2):
                fault = "none"
                if attempt == 0 and i in STALLS:
                    fault = "stall"
                elif attempt == 0 and i in KILLS:
                    fault = "kill"
                elif rng.random() < 0.06:
                    fault = "slow"
                elif rng.random() < 0.04:
                    fault = "decode-timeout"
                faults[fault] = faults.get(fault, 0) + (fault != "none")
                decode.conn.send(("req", rid, src, 0.05 if fault == "decode-timeout" else TIMEOUT_S))
                kind, _dst = decode.recv(60)
                assert kind == "dst"
                timer = None
                if fault == "slow":
                    engines[int(rng.integers(0, 2))].delay_s = TIMEOUT_S + 0.8
                elif fault == "stall":
                    host.stop()
                    timer = threading.Timer(1.2, host.cont)
                    timer.start()
                elif fault == "kill":
                    timer = threading.Timer(0.02, decode.kill)
                    timer.start()
                _send_all(senders, rid, src)
                if timer is not None:
                    timer.join()
                if fault == "kill":
                    decode = _Decode(
                        engine_kind, host.port
                    )  # the successor finishes the attempts its predecessor left open
                    _connect_all(senders)
                    results, verified = ["killed", "killed"], None
                else:
                    kind, results, verified = decode.recv(TIMEOUT_S + 30)
                for r in results:
                    assert r in ("ok", "killed") or r.startswith("TransferError"), f"{rid}: decode {r}"
                if results == ["ok", "ok"]:
                    assert verified, f"{rid} was reported OK with pages that differ from the baseline"
                    counts["ok"] += 1
                    break
                counts["failed"] += 1
                if rng.random() < 0.5:
                    break
                counts["retries"] += 1
        elapsed = time.monotonic() - t_start
        print(f"soak: {counts} faults {faults} in {elapsed:.1f} s")
        decode.conn.send(("close",))
        _, bad, registered, decode_now, decode_base = decode.recv(120)
        assert not bad, bad
        assert registered == 0
        assert decode_now == decode_base, f"decode resources {decode_now} != baseline {decode_base}"
        decode.proc.join(30)
        decode = None
        assert _close_all(senders) == 0, "registrations left after close"
        for e in engines:
            e.close()
        del senders, engines
        left = keys_client.num_keys() - empty_keys
        assert left == 0, ("store keys left behind", getattr(keys_client, "list_keys", lambda: "?")())
        assert counts["ok"] >= NUM_REQUESTS // 2, counts
        now = _settled(baseline)
        assert now == baseline, (
            f"threads or sockets left behind: {now} (baseline {baseline}, threads {threading.enumerate()})"
        )
    finally:
        if decode is not None:
            decode.kill()
        host.close()
