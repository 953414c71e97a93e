"""Faults a PD deployment meets, each injected: a corrupted page is never reported OK, no wait outlives its bound,
nothing leaks.

- staging shared by two decode ranks (one receiver per rank) is not reused before both unpacked;
- engine calls abandoned after a timeout keep their decode pages quarantined until they end, and ``close()``
  waits for them before unregistering (Mooncake TCP and NIXL loopback, a delay injected before the real write);
- a retry under the same request id never accepts the earlier attempt's "done";
- a stalled store (``SIGSTOP``) turns every wait into a ``TransferError`` within timeout + 1 s;
- a bind (decode rank > 0 taking part) that lands after its caller's deadline keeps the pages quarantined until it
  resolved, was aborted and the claimed sender drained (a slow store link of that rank alone);
- a construction that fails unwinds its registrations and the engine it created;
- the store's key count returns to its baseline after successes and failures alike;
- every party lists an attempt among its open ones before it writes any key of it (a party killed in between
  would leave keys that no restart finishes), and ``close()`` finishes an attempt whose calls end during it.
"""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dtkv import PageOwnership
from dtkv.transfer import (
    Bootstrap,
    DecodeReceiver,
    DstRequest,
    LocalEngine,
    PlanOptions,
    PrefillSender,
    StoreTimeout,
    TransferError,
)
from dtkv.transfer.messages import Aborted, Ready, SlotOpen
from dtkv.transfer.protocol import deadline_after
from tests import _engines
from tests._transfer import SlowLink, StoreHost, fill, pages, run_bounded, same_pages, shards


def _post_all(receivers, rid, dst, **kw):
    for r in receivers:
        r.post_request(rid, dst, **kw)


class _Recording:
    """A party's link to the store that records ``(party, call, key)`` of every write, in one shared list."""

    def __init__(self, inner, party: str, log: list) -> None:
        self._inner, self._party, self._log = inner, party, log

    def __getattr__(self, name: str):
        attr = getattr(self._inner, name)
        if name not in ("set", "compare_set", "add"):
            return attr

        def call(key, *args, **kwargs):
            self._log.append((self._party, name, key))
            return attr(key, *args, **kwargs)

        return call


def test_every_party_lists_an_attempt_open_before_it_writes_any_of_its_keys():
    """Decode rank 0 opening the attempt, decode rank 1 binding its slot and each prefill rank claiming its own
    write the attempt into their ``{role}/{rank}/open`` key before their first write under ``req/{id}/{epoch}``:
    a party that dies after the write and before the listing left keys behind that its restart could not know of
    (found by the soak: a decode process killed between its bind and its listing, 3 of 4 finishes)."""
    store, log = dist.HashStore(), []

    def boot(party: str) -> Bootstrap:
        b = Bootstrap(store, namespace="order")
        b.store = _Recording(b.store, party, log)
        return b

    pre = shards(PageOwnership(2, 40), seed=1)
    dec = shards(PageOwnership(2, 30))
    senders = [PrefillSender(p, boot(f"prefill/{p.rank}"), engine=LocalEngine(), timeout_s=5) for p in pre]
    receivers = [DecodeReceiver(d, boot(f"decode/{d.rank}"), engine=LocalEngine(), timeout_s=5) for d in dec]
    try:
        for side in (*senders, *receivers):
            side.connect()
        src, dst = np.arange(0, 12), np.arange(0, 12)  # both prefill and both decode ranks take part
        _post_all(receivers, "A", dst)
        for sender in senders:
            sender.send_request("A", src)
        for r in receivers:
            r.wait_request("A")
        assert same_pages(pre, src, dec, dst)
    finally:
        for side in (*senders, *receivers):
            side.close()
    for party in ("prefill/0", "prefill/1", "decode/0", "decode/1"):
        mine = [(i, call, key) for i, (p, call, key) in enumerate(log) if p == party]
        listed = next(i for i, call, key in mine if key == f"{party}/open" and call == "set")
        first = next(i for i, call, key in mine if key.startswith("req/A/"))
        assert listed < first, (party, [m for m in mine if m[0] <= first])


class TestStagingAcrossDecodeRanks:
    def test_staging_is_not_reused_before_every_decode_rank_unpacked(self):
        """Decode rank 0 unpacked A and the next request B is posted while decode rank 1 has not unpacked A yet:
        B must not land in rank 1's staging region, and A must arrive intact on rank 1."""
        boot = Bootstrap(dist.HashStore(), namespace="stg")
        pre = shards(PageOwnership(2, 40), seed=1, staging_bytes=1 << 20)
        dec = shards(PageOwnership(2, 30), staging_bytes=1 << 20)
        sender = PrefillSender(pre, boot, engine=LocalEngine(), timeout_s=5, options=PlanOptions(staging="full"))
        receivers = [DecodeReceiver(d, boot, engine=LocalEngine(), timeout_s=5) for d in dec]
        for side in (sender, *receivers):
            side.connect()
        src_a, dst_a = np.arange(0, 12), np.arange(0, 12)  # both requests span both decode ranks
        src_b, dst_b = np.arange(20, 32), np.arange(12, 24)
        _post_all(receivers, "A", dst_a)
        assert sender.send_request("A", src_a).num_entries > 0
        receivers[0].wait_request("A")  # rank 0 unpacked A; rank 1 has not yet
        _post_all(receivers, "B", dst_b)
        sender.send_request("B", src_b)
        receivers[1].wait_request("A")
        receivers[1].wait_request("B")
        receivers[0].wait_request("B")
        assert same_pages(pre, src_a, dec, dst_a), "request A was reported OK with another request's bytes"
        assert same_pages(pre, src_b, dec, dst_b)


class _SlowEngine:
    """An engine of ``kind`` whose next ``delay_calls`` writes sleep ``delay_s`` before the real write (a slow link)."""

    def __new__(cls, kind: str, delay_s: float, delay_calls: int = 1):
        class Slow(_engines.engine_class(kind)):
            def write(self, peer, src, dst, length):
                with self.lock:
                    slow = self.delay_calls > 0
                    self.delay_calls -= 1
                if slow:
                    time.sleep(self.delay_s)
                rc = super().write(peer, src, dst, length)
                if slow:
                    self.late_write_done.set()
                return rc

        eng = Slow(timeout_s=10)
        eng.delay_s, eng.delay_calls, eng.lock = delay_s, delay_calls, threading.Lock()
        eng.late_write_done = threading.Event()
        return eng


class TestAbandonedCalls:
    def test_late_bytes_never_land_in_pages_of_another_request(self, transfer_engine):
        """Prefill rank 0's call for A outlives its timeout and writes 2 s later. A fails; its pages must not be
        handed to B (sent by rank 1 alone) until that call ended, so B stays bitwise intact after it lands."""
        kind = transfer_engine
        boot = Bootstrap(dist.HashStore(), namespace="late")
        pre = shards(PageOwnership(2, 16), seed=3)
        dec = shards(PageOwnership(1, 16))
        slow = _SlowEngine(kind, 2.0)
        fast, engine_d = _engines.make(kind, timeout_s=10), _engines.make(kind, timeout_s=10)
        senders = [
            PrefillSender(pre[0], boot, engine=slow, timeout_s=5),
            PrefillSender(pre[1], boot, engine=fast, timeout_s=5),
        ]
        receiver = DecodeReceiver(dec, boot, engine=engine_d, timeout_s=5)
        try:
            for side in (*senders, receiver):
                side.connect()
            receiver.post_request("A", [4, 5, 6, 7])  # positions 0 and 2 (pages 4, 6) are prefill rank 0's
            with pytest.raises(TransferError, match="timed out waiting for the engine"):
                senders[0].send_request("A", [0, 1, 2, 3], timeout_s=0.5)
            senders[1].send_request("A", [0, 1, 2, 3])
            with pytest.raises(TransferError):
                receiver.wait_request("A")
            try:  # B reuses A's pages 4 and 6, for positions prefill rank 1 owns
                receiver.post_request("B", [4, 6])
            except ValueError as e:
                assert "quarantined after request 'A' failed" in str(e)
                released = receiver.reclaim(timeout_s=10)
                assert [rid for rid, _ in released] == ["A"]
                assert slow.late_write_done.is_set(), "A's pages were released while its abandoned call still ran"
                receiver.post_request("B", [4, 6])
            for sender in senders:
                sender.send_request("B", [1, 3])
            receiver.wait_request("B")
            assert slow.late_write_done.wait(10)
            time.sleep(0.2)
            assert same_pages(pre, [1, 3], dec, [4, 6]), "request B was reported OK, then overwritten by A's late bytes"
        finally:
            for side in (*senders, receiver):
                side.close()
            for e in (slow, fast, engine_d):
                e.close()

    def test_close_waits_for_calls_in_flight(self, transfer_engine):
        """``close()`` must not unregister (or drop the engine) while an abandoned call still reads the pool."""
        with _abandoned_send(transfer_engine, "close", late_s=1.5) as (sender, slow):
            sender.close()
            assert slow.late_write_done.is_set(), "close() unregistered the pool under a running call"
            assert slow.registered == 0
            slow.close()
            assert slow.num_inflight == 0

    def test_close_finishes_an_attempt_whose_calls_end_during_it(self, transfer_engine, monkeypatch):
        """An attempt concluded with an engine call still running is finished once the call ends; when that is
        during ``close()``, close finishes it before returning. The engine's bookkeeping of a call ends before the
        call's later callbacks run (here held back 0.3 s): a close that did not wait for the drained report to be
        queued returned with the attempt unfinished and its keys in the store."""
        real = PrefillSender._when_ended

        def late(calls, then):
            real(calls, lambda: (time.sleep(0.3), then()))

        monkeypatch.setattr(PrefillSender, "_when_ended", staticmethod(late))
        ran = []
        real_drained = PrefillSender._drained
        monkeypatch.setattr(PrefillSender, "_drained", staticmethod(lambda *a: ran.append(1) or real_drained(*a)))
        with _abandoned_send(transfer_engine, "close-drain", late_s=1.0) as (sender, slow):
            assert not ran
            sender.close()  # waits for the late call, then for its drained report
            assert slow.late_write_done.is_set() and ran == [1]


@contextlib.contextmanager
def _abandoned_send(engine_kind: str, namespace: str, *, late_s: float):
    """A prefill sender (one rank) whose call for request ``"A"`` outlives its 0.3 s timeout and writes ``late_s``
    after it started: yields ``(sender, slow engine)`` once ``send_request`` raised; closes every side after."""
    boot = Bootstrap(dist.HashStore(), namespace=namespace)
    pre = shards(PageOwnership(1, 16), seed=4)
    dec = shards(PageOwnership(1, 16))
    slow = _SlowEngine(engine_kind, late_s)
    sender = PrefillSender(pre, boot, engine=slow, timeout_s=5)
    receiver = DecodeReceiver(dec, boot, engine=engine_kind, timeout_s=5)
    try:
        sender.connect()
        receiver.connect()
        receiver.post_request("A", [1, 2])
        with pytest.raises(TransferError):
            sender.send_request("A", [3, 4], timeout_s=0.3)
        yield sender, slow
    finally:
        receiver.close()
        sender.close()
        slow.close()


class TestEngineBookkeeping:
    """Every engine call is tracked until it ends; memory is never released under a running call."""

    def test_close_past_its_bound_defers_the_release_until_the_call_ends(self):
        go, ended = threading.Event(), threading.Event()

        class Slow(LocalEngine):
            def write(self, peer, src, dst, length):
                go.wait(10)  # runs until the test lets it end: no race with the deferred release's own bound
                ended.set()
                return 0

        engine = Slow(call_timeout_s=0.5)  # the deferred release waits up to 10 x 0.5 s
        engine.register([torch.zeros(64, dtype=torch.uint8)])
        fut = engine.submit("peer", engine.write, "peer", [0], [0], [1])
        queued = engine.submit("peer", engine.write, "peer", [0], [0], [1])
        t0 = time.monotonic()
        engine.close(timeout_s=0.1)
        assert time.monotonic() - t0 < 2.0, "close() must stay bounded"
        assert queued.cancelled(), "a call that had not started must not start after close()"
        assert engine.registered == 1, "memory was unregistered under a running call"
        time.sleep(0.2)
        assert engine.registered == 1 and not ended.is_set(), "memory was unregistered under a running call"
        go.set()
        assert fut.result(timeout=5) == 0 and ended.is_set()
        deadline = time.monotonic() + 4
        while engine.registered and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.registered == 0 and engine.num_inflight == 0
        with pytest.raises(TransferError, match="the transfer engine is closed"):
            engine.submit("peer", engine.write, "peer", [0], [0], [1])

    def test_a_call_that_never_ends_leaves_the_memory_registered(self, caplog):
        go = threading.Event()

        class Stuck(LocalEngine):
            def write(self, peer, src, dst, length):
                go.wait(10)
                return 0

        engine = Stuck(call_timeout_s=0.02)  # the deferred release gives up after 10 x 0.02 s
        engine.register([torch.zeros(64, dtype=torch.uint8)])
        fut = engine.submit("peer", engine.write, "peer", [0], [0], [1])
        try:
            with caplog.at_level("ERROR", logger="dtkv.transfer.engine"):
                engine.close(timeout_s=0.01)
                deadline = time.monotonic() + 5
                while "calls never ended" not in caplog.text and time.monotonic() < deadline:
                    time.sleep(0.01)
            assert "calls never ended; its memory stays registered" in caplog.text
            assert engine.registered == 1, "memory was unregistered under a call that never ended"
        finally:
            go.set()
            fut.result(timeout=5)


class TestRetries:
    def test_retry_under_the_same_id_never_accepts_a_stale_done(self):
        boot = Bootstrap(dist.HashStore(), namespace="retry")
        pre = shards(PageOwnership(2, 40), seed=5)
        dec = shards(PageOwnership(1, 30))
        sender = PrefillSender(pre, boot, engine=LocalEngine(), timeout_s=5)
        receiver = DecodeReceiver(dec, boot, engine=LocalEngine(), timeout_s=5)
        sender.connect()
        receiver.connect()
        src = np.arange(3, 9)
        receiver.post_request("r", np.arange(0, 6))
        with pytest.raises(TransferError, match="timed out waiting for prefill ranks"):
            receiver.wait_request("r", timeout_s=0.2)  # attempt 1: prefill is late
        try:
            sender.send_request("r", src, timeout_s=0.3)  # late for attempt 1, too early for attempt 2
        except TransferError:
            pass
        receiver.reclaim()
        receiver.post_request("r", np.arange(10, 16))  # attempt 2: new pages
        try:
            receiver.wait_request("r", timeout_s=0.3)
        except TransferError:
            pass  # nobody sent attempt 2 yet: the only correct outcome besides pages that are right
        else:
            assert same_pages(pre, src, dec, np.arange(10, 16)), "the retry returned OK with the first attempt's done"
        receiver.reclaim()
        receiver.post_request("r", np.arange(20, 26))  # attempt 3, sent this time
        sender.send_request("r", src)
        receiver.wait_request("r")
        assert same_pages(pre, src, dec, np.arange(20, 26))


@pytest.mark.parametrize("where", ["before", "after"], ids=["write-late", "reply-late"])
@pytest.mark.parametrize("cp_d", [2, 3])
class TestLateBind:
    """A decode rank other than 0 whose READY compare-and-set outlives its caller's deadline (its store link alone
    is slow): the attempt is treated like an abandoned engine call."""

    def test_late_bind_keeps_pages_quarantined_until_resolved(self, cp_d, where):
        store = dist.HashStore()
        pre = shards(PageOwnership(2, 40), seed=11)
        dec = shards(PageOwnership(cp_d, 30))
        sender = PrefillSender(pre, Bootstrap(store, namespace="lb"), engine=LocalEngine(), timeout_s=6)
        boots = [Bootstrap(store, namespace="lb") for _ in dec]
        link = SlowLink.install(boots[-1])  # the last decode rank's link to the store
        receivers = [
            DecodeReceiver(d, b, engine=LocalEngine(), timeout_s=0.4 if d.rank == cp_d - 1 else 6)
            for d, b in zip(dec, boots)
        ]
        late = receivers[-1]
        for side in (sender, *receivers):
            side.connect()
        src_a, dst_a = np.arange(0, 9), np.arange(3, 12)  # every decode rank holds some of A's pages
        mine = dst_a[dec[0].ownership.owner(torch.from_numpy(dst_a)).numpy() == cp_d - 1]
        for r in receivers[:-1]:
            r.post_request("A", dst_a)
        box: list = []
        sending = threading.Thread(target=lambda: box.append(run_bounded(sender.send_request, "A", src_a, limit_s=20)))
        sending.start()
        link.stall("compare_set", delay_s=2.0, where=where)
        with pytest.raises(TransferError, match="did not answer take part in req/A"):
            late.post_request("A", dst_a)
        assert not link.landed.is_set(), "the stalled bind resolved before its caller's deadline: no late bind tested"
        # the bind may still land: A's pages stay out of use, not listed by reclaim()
        assert set(late.quarantined) == {"A"} and np.array_equal(late.quarantined["A"], mine)
        assert late.reclaim() == []
        with pytest.raises(ValueError, match=r"quarantined after request 'A' failed"):
            late.post_request("B", mine)
        assert link.landed.wait(10), "the stalled bind never resolved"
        released = late.reclaim(timeout_s=15)  # bind resolved, attempt aborted, the claimed sender drained
        assert [rid for rid, _ in released] == ["A"] and late.quarantined == {}
        link.unstall()
        sending.join(25)
        _, outcome = box[0]
        assert isinstance(outcome, TransferError), f"prefill sent A to a decode rank that gave it up: {outcome!r}"
        for r in receivers[:-1]:  # decode rank 0 must not report A as received
            with pytest.raises(TransferError):
                r.wait_request("A", timeout_s=5)
        # A's pages on the late rank are reused by B (another request, all of whose pages are on that rank)
        fill(dec[-1], 99)
        before = pages(dec, "kv", mine).clone()
        src_b = np.arange(20, 20 + mine.shape[0])
        for r in receivers:
            r.post_request("B", mine)
        sender.send_request("B", src_b)
        for r in receivers:
            r.wait_request("B", timeout_s=6)
        assert same_pages(pre, src_b, dec, mine)
        for side in (sender, *receivers):
            side.bootstrap.flush(5)
        time.sleep(0.3)
        assert same_pages(pre, src_b, dec, mine), "a late write of A landed in B's pages"
        assert not torch.equal(before, pages(dec, "kv", mine))
        for side in (sender, *receivers):
            side.close()


class TestQueuedBind:
    def test_bind_queued_behind_a_stall_never_lands(self):
        """The late rank's bind waits behind an earlier store call that stalls; its caller gives up first. The
        bind then does nothing: the slot never turns READY, and the pages come back once the abort ran."""
        store = dist.HashStore()
        pre = shards(PageOwnership(2, 40), seed=12)
        dec = shards(PageOwnership(2, 30))
        sender = PrefillSender(pre, Bootstrap(store, namespace="qb"), engine=LocalEngine(), timeout_s=3)
        boots = [Bootstrap(store, namespace="qb") for _ in dec]
        receivers = [
            DecodeReceiver(d, b, engine=LocalEngine(), timeout_s=3 if d.rank == 0 else 0.4) for d, b in zip(dec, boots)
        ]
        for side in (sender, *receivers):
            side.connect()
        receivers[0].post_request("A", np.arange(4))
        stalled = boots[1].post(lambda s: time.sleep(1.5), what="a stalled call")
        with pytest.raises(TransferError, match="did not answer take part in req/A"):
            receivers[1].post_request("A", np.arange(4))
        assert "A" in receivers[1].quarantined and receivers[1].reclaim() == []
        stalled.result(5)
        assert [rid for rid, _ in receivers[1].reclaim(timeout_s=5)] == ["A"]
        req = boots[0].try_get("req/A", DstRequest, deadline=float("inf"))
        slot = f"req/A/{req.epoch}/decode/1"
        assert isinstance(boots[0].decode(slot, store.get(f"qb/{slot}"), SlotOpen, Ready, Aborted), SlotOpen)
        with pytest.raises(TransferError):
            sender.send_request("A", np.arange(4), timeout_s=0.5)
        for side in (sender, *receivers):
            side.close()


class TestStoreStalls:
    def test_a_call_queued_behind_a_slow_one_names_it(self):
        """A call that times out while another call holds the bootstrap's thread names that call and how long it
        has run; one that stalls in the store itself does not: a stalled store and a queue behind one slow call
        read differently in a log."""
        boot = Bootstrap(dist.HashStore(), namespace="behind")
        release, gate = threading.Event(), threading.Event()
        slow = boot.post(lambda s: release.wait(10), what="a slow cleanup")
        pattern = r"did not answer get 'x' within 0\.\d\d s \(stalled or unreachable; it waited behind a slow cleanup, running for \d+\.\d\d s\)"
        with pytest.raises(StoreTimeout, match=pattern):
            boot.call(lambda s: s.check(["x"]), deadline=deadline_after(0.3), what="get 'x'")
        release.set()
        slow.result(5)
        with pytest.raises(StoreTimeout) as err:
            boot.call(lambda s: gate.wait(10), deadline=deadline_after(0.3), what="get 'y'")
        gate.set()
        assert str(err.value).endswith("(stalled or unreachable)") and "waited behind" not in str(err.value)
        assert boot.flush(5)

    def test_stalled_store_fails_every_wait_within_timeout_plus_1s(self):
        host = StoreHost()
        try:
            pre = shards(PageOwnership(2, 40), seed=6)
            dec = shards(PageOwnership(1, 30))
            sender = PrefillSender(pre, Bootstrap(host.client(), namespace="stall"), engine=LocalEngine(), timeout_s=5)
            receiver = DecodeReceiver(
                dec, Bootstrap(host.client(), namespace="stall"), engine=LocalEngine(), timeout_s=5
            )
            sender.connect()
            receiver.connect()
            receiver.post_request("a", [1, 2, 3])
            host.stop()
            for name, fn in [
                ("send_request", lambda: sender.send_request("a", [4, 5, 6], timeout_s=1.0)),
                ("wait_request", lambda: receiver.wait_request("a", timeout_s=1.0)),
            ]:
                elapsed, result = run_bounded(fn, limit_s=8.0)
                if elapsed == float("inf"):
                    host.cont()
                    pytest.fail(f"{name} was still blocked on the stalled store after 8 s")
                assert isinstance(result, TransferError), f"{name} returned {result!r}"
                assert elapsed < 2.0, f"{name} took {elapsed:.2f} s with timeout_s=1"
            host.cont()
            receiver.reclaim(timeout_s=5)
            receiver.post_request("b", [7, 8, 9])  # the store answers again: the next request goes through
            sender.send_request("b", [10, 11, 12])
            receiver.wait_request("b")
            assert same_pages(pre, [10, 11, 12], dec, [7, 8, 9])
            sender.close()
            receiver.close()
        finally:
            host.close()


class TestConstruction:
    def test_failed_construction_unwinds_its_registration(self, transfer_engine):
        host = StoreHost()
        broken = Bootstrap(host.client(), namespace="ctor")
        host.kill()  # a store blip
        engine = _engines.make(transfer_engine, timeout_s=10)
        pre = shards(PageOwnership(1, 16), seed=7)
        try:
            with pytest.raises(TransferError):
                PrefillSender(pre, broken, engine=engine, timeout_s=1.0)
            healthy = Bootstrap(dist.HashStore(), namespace="ctor")
            sender = PrefillSender(pre, healthy, engine=engine, timeout_s=1.0)  # the same memory registers again
            sender.close()
            assert engine.registered == 0
        finally:
            engine.close()

    def test_failed_construction_closes_the_engine_it_created(self, transfer_engine, monkeypatch):
        import dtkv.transfer._side as side

        made = []
        create = side.create_engine

        def recorded(*a, **k):
            made.append(create(*a, **k))
            return made[-1]

        monkeypatch.setattr(side, "create_engine", recorded)
        host = StoreHost()
        broken = Bootstrap(host.client(), namespace="ctor2")
        host.kill()
        with pytest.raises(TransferError):
            DecodeReceiver(shards(PageOwnership(1, 16)), broken, engine=transfer_engine, timeout_s=1.0)
        assert len(made) == 1 and _engines.released(made[0]), "the engine the receiver created is still open"


class TestKeyCleanup:
    def test_key_count_returns_to_baseline_with_one_receiver_per_decode_rank(self):
        store = dist.HashStore()
        empty = store.num_keys()
        boot = Bootstrap(store, namespace="keys")
        pre = shards(PageOwnership(2, 40), seed=8, staging_bytes=1 << 20)
        dec = shards(PageOwnership(2, 30), staging_bytes=1 << 20)
        sender = PrefillSender(pre, boot, engine=LocalEngine(), timeout_s=5)
        receivers = [DecodeReceiver(d, boot, engine=LocalEngine(), timeout_s=5) for d in dec]
        for side in (sender, *receivers):
            side.connect()
        boot.flush(5)
        baseline = store.num_keys()
        for i in range(6):
            dst = np.arange(4 * (i % 3), 4 * (i % 3) + 4)
            _post_all(receivers, f"ok{i}", dst)
            sender.send_request(f"ok{i}", np.arange(i, i + 4))
            for r in receivers:
                r.wait_request(f"ok{i}")
        _post_all(receivers, "bad", [20, 21], num_tokens=99)  # prefill refuses: both decode ranks fail
        with pytest.raises(ValueError):
            sender.send_request("bad", [1, 2])
        for r in receivers:
            with pytest.raises(TransferError):
                r.wait_request("bad")
        _post_all(receivers, "late", [22, 23])  # prefill never sends: decode times out
        for r in receivers:
            with pytest.raises(TransferError):
                r.wait_request("late", timeout_s=0.2)
        for r in receivers:
            r.reclaim(timeout_s=5)
        boot.flush(5)
        assert store.num_keys() == baseline, "a finished or failed request left keys behind"
        for side in (sender, *receivers):
            side.close()
        boot.flush(5)
        assert store.num_keys() == empty


_DIES_MID_DELETION = """
import sys, time
import numpy as np
from dtkv import PageOwnership
from dtkv.transfer import Bootstrap, DecodeReceiver, LocalEngine, TransferError, create_store
from tests._transfer import shards

boot = Bootstrap(create_store(port=int(sys.argv[1]), is_master=False, timeout_s=30), namespace="die")
rx = DecodeReceiver(shards(PageOwnership(1, 8), staging_bytes=1 << 16)[0], boot, engine=LocalEngine(), timeout_s=5)
rx.connect(30)


class DiesMidDeletion:  # the store calls of this process, which stops for good after one delete of an attempt key
    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        fn = getattr(self.inner, name)
        if name != "delete_key":
            return fn

        def delete_key(key):
            out = fn(key)
            if key.count("/") >= 3:  # req/{id}/{epoch}/...: the attempt's keys, not req/{id}
                print("DELETING", key, flush=True)
                time.sleep(600)  # killed here
            return out

        return delete_key


boot.store = DiesMidDeletion(boot.store)
try:
    rx.receive_request("late", np.array([0, 1]), timeout_s=0.2)  # prefill never sends: decode gives it up
except TransferError:
    pass
rx.reclaim(timeout_s=5)  # the release finishes the attempt: the count completes, the deletion begins
time.sleep(600)
"""


_DIES_AT_FINISH = """
import sys, time
import numpy as np
from dtkv import PageOwnership
from dtkv.transfer import Bootstrap, DecodeReceiver, LocalEngine, TransferError, create_store
from tests._transfer import shards

where, nth = sys.argv[2], int(sys.argv[3])
boot = Bootstrap(create_store(port=int(sys.argv[1]), is_master=False, timeout_s=30), namespace="die")
rx = DecodeReceiver(shards(PageOwnership(1, 8), staging_bytes=1 << 16)[0], boot, engine=LocalEngine(), timeout_s=5)
rx.connect(30)


class DiesAtFinish:  # the store calls of this process, which stops for good before or after its nth finish add
    def __init__(self, inner):
        self.inner = inner
        self.seen = 0

    def __getattr__(self, name):
        fn = getattr(self.inner, name)
        if name != "add":
            return fn

        def add(key, amount):
            if "/finished" not in key or amount == 0:
                return fn(key, amount)
            self.seen += 1
            if self.seen == nth and where == "before":
                print("DYING", key, flush=True)
                time.sleep(600)  # killed here
            out = fn(key, amount)
            if self.seen == nth:
                print("DYING", key, flush=True)
                time.sleep(600)
            return out

        return add


boot.store = DiesAtFinish(boot.store)
try:
    rx.receive_request("late", np.array([0, 1]), timeout_s=0.2)  # prefill never sends: decode gives it up
except TransferError:
    pass
rx.reclaim(timeout_s=5)  # the abort set the closed prefill slots' bits (1st add), the release decode's own (2nd)
time.sleep(600)
"""


class TestDeathMidCleanup:
    def test_a_rank_killed_while_it_deletes_an_attempt_leaves_the_deletion_to_its_restart(self):
        """The rank whose finish completes an attempt's count deletes its keys, one call each; killed in the middle
        (here: after the first), the rest stayed in the store for good (the NIXL soak's leftover keys). The attempt
        stays among the rank's open ones while it deletes, and the restart of the rank completes the deletion: the
        store's key count returns to where it was."""
        import os
        import subprocess
        import sys
        from pathlib import Path

        root = Path(__file__).resolve().parent.parent
        host = StoreHost()
        proc = None
        try:
            client = host.client()
            empty = client.num_keys()
            boot = Bootstrap(host.client(), namespace="die")
            sender = PrefillSender(shards(PageOwnership(2, 8), staging_bytes=1 << 16), boot, engine=LocalEngine(),
                                   timeout_s=5)  # fmt: skip
            boot.flush(5)
            env = {**os.environ, "PYTHONPATH": str(root)}
            proc = subprocess.Popen([sys.executable, "-c", _DIES_MID_DELETION, str(host.port)], stdout=subprocess.PIPE,
                                    text=True, env=env, cwd=str(root))  # fmt: skip
            _, line = run_bounded(proc.stdout.readline, limit_s=60)
            assert isinstance(line, str) and line.startswith("DELETING req/late/"), line
            proc.kill()
            proc.wait(10)
            left = [k for k in client.list_keys() if "/req/late/" in k]
            assert left, "the killed rank deleted every key of the attempt after all"
            successor = DecodeReceiver(shards(PageOwnership(1, 8), staging_bytes=1 << 16)[0], Bootstrap(host.client(),
                                       namespace="die"), engine=LocalEngine(), timeout_s=5)  # fmt: skip
            successor.bootstrap.flush(5)
            assert [k for k in client.list_keys() if "/req/late/" in k] == [], "the restart left the deletion undone"
            successor.close()
            sender.close()
            boot.flush(5)
            assert client.num_keys() == empty, client.list_keys()
        finally:
            if proc is not None and proc.poll() is None:
                proc.kill()
            host.close()

    @pytest.mark.parametrize(("where", "nth"), [("before", 1), ("after", 1), ("before", 2)])
    def test_a_rank_killed_around_its_finish_leaves_the_attempt_to_its_restart(self, where, nth):
        """Decode gives a request up that prefill never claimed: its abort closes both prefill slots and sets their
        bits (the 1st add), its release sets its own (the 2nd, which completes the attempt and deletes it). Killed
        just before or after one of those adds, the rank leaves the attempt listed open, and its restart sets
        exactly the bits that are missing: the store's key count returns to where it was. Before, a rank un-listed
        the attempt before its add (killed in between: the attempt's keys stayed for good, the soak's leftover
        keys), and a restart re-counted nothing for the slots its dead incarnation had closed."""
        import os
        import subprocess
        import sys
        from pathlib import Path

        root = Path(__file__).resolve().parent.parent
        host = StoreHost()
        proc = None
        try:
            client = host.client()
            empty = client.num_keys()
            boot = Bootstrap(host.client(), namespace="die")
            sender = PrefillSender(shards(PageOwnership(2, 8), staging_bytes=1 << 16), boot, engine=LocalEngine(),
                                   timeout_s=5)  # fmt: skip
            boot.flush(5)
            baseline = client.num_keys()
            env = {**os.environ, "PYTHONPATH": str(root)}
            proc = subprocess.Popen([sys.executable, "-c", _DIES_AT_FINISH, str(host.port), where, str(nth)],
                                    stdout=subprocess.PIPE, text=True, env=env, cwd=str(root))  # fmt: skip
            _, line = run_bounded(proc.stdout.readline, limit_s=60)
            assert isinstance(line, str) and line.startswith("DYING req/late/"), line
            proc.kill()
            proc.wait(10)
            left = [k for k in client.list_keys() if "/req/late/" in k]
            assert left, "the killed rank finished the attempt after all"
            successor = DecodeReceiver(shards(PageOwnership(1, 8), staging_bytes=1 << 16)[0], Bootstrap(host.client(),
                                       namespace="die"), engine=LocalEngine(), timeout_s=5)  # fmt: skip
            successor.bootstrap.flush(5)
            assert [k for k in client.list_keys() if "/req/late/" in k] == [], "the restart left the attempt behind"
            successor.close()
            assert client.num_keys() == baseline, client.list_keys()
            sender.close()
            boot.flush(5)
            assert client.num_keys() == empty, client.list_keys()
        finally:
            if proc is not None and proc.poll() is None:
                proc.kill()
            host.close()
