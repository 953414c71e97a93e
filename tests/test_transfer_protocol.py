"""Sender/receiver protocol on the in-process ``LocalEngine``: bootstrap, reports, metadata, timeouts, faults."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dtkv import IndexerFp8Layout, MLAFp8Layout, PageOwnership
from dtkv.transfer import (
    Bootstrap,
    DecodeReceiver,
    KVShard,
    LocalEngine,
    PlanOptions,
    PrefillSender,
    StoreTimeout,
    TransferError,
    send_entries,
)
from dtkv.transfer.descriptors import PeerEntries
from dtkv.transfer.protocol import WORD_BITS, AttemptKeys, Backoff, peek_counter

LAYERS = 2
LAYOUTS = {
    "kv": MLAFp8Layout(page_size=4, kv_lora_rank=32, rope_dim=8, quant_block=16),
    "index": IndexerFp8Layout(page_size=4, head_dim=16),
}


def _fill(shard, seed):
    g = torch.Generator().manual_seed(seed)
    for buf in shard.buffers.values():
        u8 = buf.view(torch.uint8)
        u8.copy_(torch.randint(0, 256, u8.shape, generator=g, dtype=torch.uint8))


def _pair(cp_p=2, cp_d=1, layout_d="interleave", *, staging=1 << 20, meta=False, timeout_s=5.0, options=None):
    bootstrap = Bootstrap(dist.HashStore(), namespace="t")
    own_p, own_d = PageOwnership(cp_p, 40), PageOwnership(cp_d, 30, layout_d)
    mk = dict(meta_num_rows=4, meta_row_bytes=32) if meta else {}
    pre = [KVShard.allocate(LAYOUTS, own_p, r, num_layers=LAYERS, staging_bytes=staging, **mk) for r in range(cp_p)]
    for s in pre:
        _fill(s, s.rank)
    dec = [KVShard.allocate(LAYOUTS, own_d, r, num_layers=LAYERS, staging_bytes=staging, **mk) for r in range(cp_d)]
    sender = PrefillSender(pre, bootstrap, engine=LocalEngine(), timeout_s=timeout_s, options=options)
    receiver = DecodeReceiver(dec, bootstrap, engine=LocalEngine(), timeout_s=timeout_s)
    sender.connect()
    receiver.connect()
    return sender, receiver


def _pages(shards, name, layer):
    own = shards[0].ownership
    out = torch.empty(own.num_pages, *shards[0].buffers[name].shape[2:], dtype=shards[0].buffers[name].dtype)
    for s in shards:
        out[own.local_pages(s.rank)] = s.buffers[name][layer]
    return out


def _check(sender, receiver, src, dst):
    pre, dec = list(sender.shards.values()), list(receiver.shards.values())
    for name in LAYOUTS:
        for layer in range(LAYERS):
            got = _pages(dec, name, layer)[torch.as_tensor(dst)].view(torch.uint8)
            want = _pages(pre, name, layer)[torch.as_tensor(src)].view(torch.uint8)
            assert torch.equal(got, want), f"{name} layer {layer} differs"


class TestSendReceive:
    """Every prefill rank hosted by one sender, every decode rank by one receiver, one thread."""

    @pytest.mark.parametrize("chunks", [1, 2])
    @pytest.mark.parametrize("cp_p,cp_d,layout_d", [(1, 1, "interleave"), (2, 1, "interleave"), (4, 3, "block")])
    def test_round_trip_vs_reference(self, cp_p, cp_d, layout_d, chunks):
        sender, receiver = _pair(cp_p, cp_d, layout_d, options=PlanOptions(layer_groups=chunks))
        src, dst = np.arange(3, 26), np.random.default_rng(0).permutation(30)[:23]
        receiver.post_request("r0", dst, num_tokens=23 * 4 - 2)
        sent = sender.send_request("r0", src)
        got = receiver.wait_request("r0")
        _check(sender, receiver, src, dst)
        assert sent.num_positions == got.num_positions == 23
        assert got.num_entries == sent.plan_entries and got.min_entries == sent.min_entries
        assert sent.num_calls >= 1

    def test_metadata_row_reaches_every_decode_rank(self):
        sender, receiver = _pair(4, 2, meta=True, options=PlanOptions(meta_sender=2))
        receiver.post_request("m", [5, 6], dst_meta_slot=3)
        sender.send_request("m", [7, 8], meta=b"first-token=42", src_meta_slot=1)
        receiver.wait_request("m")
        for shard in receiver.shards.values():
            assert bytes(shard.meta[3, :14].tolist()) == b"first-token=42"

    def test_empty_request(self):
        sender, receiver = _pair(2, 2)
        receiver.post_request("e", [])
        assert sender.send_request("e", []).num_entries == 0
        assert receiver.wait_request("e").num_positions == 0

    def test_batches_of_at_most_max_entries(self):
        sender, receiver = _pair(2, 1, staging=0)
        sender.max_entries_per_call = 5
        receiver.post_request("b", np.arange(20))
        sent = sender.send_request("b", np.arange(20))
        receiver.wait_request("b")
        per_rank = 10 * LAYERS * len(LAYOUTS)  # strided pages: one entry per page, layer and buffer
        assert sent.num_entries == 2 * per_rank and sent.num_calls == 2 * per_rank // 5

    def test_staging_is_used_by_one_request_at_a_time(self):
        sender, receiver = _pair(2, 1)
        receiver.post_request("a", np.arange(0, 10))
        receiver.post_request("b", np.arange(10, 20))  # staging busy: direct entries
        sa = sender.send_request("a", np.arange(0, 10))
        sb = sender.send_request("b", np.arange(10, 20))
        assert receiver.wait_request("a").staged and not receiver.wait_request("b").staged
        assert sa.num_entries < sb.num_entries
        _check(sender, receiver, np.arange(20), np.arange(20))

    def test_rejects_token_count_mismatch_and_tells_decode(self):
        sender, receiver = _pair(2, 1)
        receiver.post_request("n", [1, 2], num_tokens=9)
        with pytest.raises(ValueError, match=r"src_pages must hold ceil\(num_tokens / page_size\) = 3 pages"):
            sender.send_request("n", [1, 2])
        with pytest.raises(TransferError, match=r"peer prefill rank 0.*ValueError"):
            receiver.wait_request("n")


class TestFaults:
    """Every wait is bounded; a dead peer fails fast with a TransferError naming peer, request and pages."""

    def test_decode_never_posts(self):
        sender, _ = _pair(2, 1, timeout_s=0.3)
        t0 = time.monotonic()
        with pytest.raises(TransferError, match=r"request 'x', peer decode\): timed out waiting for 'req/x'"):
            sender.send_request("x", [1, 2])
        assert time.monotonic() - t0 < 2.0

    def test_dead_decode(self):
        sender, receiver = _pair(2, 2, staging=0)
        before = [b.clone() for s in sender.shards.values() for b in s.buffers.values()]
        receiver.post_request("d", [4, 5, 6])
        receiver.engine.close()
        with pytest.raises(TransferError) as info:
            sender.send_request("d", [10, 11, 12])
        err = info.value
        assert err.request_id == "d" and "decode rank" in err.peer and err.pages.size > 0
        assert "engine write returned -1" in str(err)
        after = [b for s in sender.shards.values() for b in s.buffers.values()]
        assert all(torch.equal(a, b) for a, b in zip(before, after)), "prefill pools must be intact"

    def test_prefill_never_sends(self):
        _, receiver = _pair(2, 1, timeout_s=0.3)
        receiver.post_request("p", [1])
        with pytest.raises(TransferError, match=r"timed out waiting for prefill ranks \[0, 1\]"):
            receiver.wait_request("p")

    def test_stuck_engine_call_times_out(self):
        class Stuck(LocalEngine):
            def write(self, peer, src, dst, length):
                time.sleep(1.0)
                return 0

        peer = PeerEntries(
            decode_rank=0,
            session="s",
            src=np.array([1]),
            dst=np.array([2]),
            length=np.array([3]),
            positions=np.array([0]),
            dst_pages=np.array([9]),
        )
        t0 = time.monotonic()
        with pytest.raises(TransferError, match=r"request 'q', peer decode rank 0 at s, pages \[9\]\): timed out"):
            send_entries(Stuck(), [peer], request_id="q", deadline=time.monotonic() + 0.2)
        assert time.monotonic() - t0 < 0.9

    def test_error_pickles(self):
        import pickle

        e = pickle.loads(pickle.dumps(TransferError("boom", request_id="r", peer="p", pages=[1, 2])))
        assert str(e) == "transfer failed (request 'r', peer p, pages [1, 2]): boom"
        e = pickle.loads(pickle.dumps(StoreTimeout("slow", request_id="r", peer="store")))
        assert type(e) is StoreTimeout and str(e) == "transfer failed (request 'r', peer store): slow"


class TestBackoffPoll:
    """A poll loop reports its own timeout once the store answered it, and the store's before that."""

    @staticmethod
    def _backoff(deadline_s: float = 5.0) -> Backoff:
        mine = lambda: TransferError("what the loop waited for did not come", request_id="r", peer="decode")
        return Backoff(time.monotonic() + deadline_s, mine)

    def test_a_store_timeout_before_any_answer_is_the_store_s(self):
        slow = StoreTimeout("the store did not answer", request_id="r", peer="store")
        with pytest.raises(StoreTimeout, match="the store did not answer"):
            self._backoff().poll(lambda: (_ for _ in ()).throw(slow))

    def test_a_store_timeout_after_an_answer_is_the_loop_s(self):
        b = self._backoff()
        assert b.poll(lambda: 7) == 7
        slow = StoreTimeout("the store did not answer", request_id="r", peer="store")
        with pytest.raises(TransferError, match="did not come") as info:
            b.poll(lambda: (_ for _ in ()).throw(slow))
        assert not isinstance(info.value, StoreTimeout) and info.value.__cause__ is slow

    def test_other_errors_pass_through(self):
        b = self._backoff()
        b.poll(lambda: None)
        bad = TransferError("malformed value", request_id="r", peer="store")
        with pytest.raises(TransferError, match="malformed value"):
            b.poll(lambda: (_ for _ in ()).throw(bad))

    def test_wait_without_on_timeout_is_refused(self):
        with pytest.raises(ValueError, match="on_timeout"):
            Backoff(time.monotonic() - 1).wait()

    def test_prefill_reports_the_missing_decode_rank_when_the_deadline_lands_in_a_poll(self):
        """Decode rank 1 never takes part; prefill's first READY poll after its claim (which read the slots once
        already) is slow past the deadline: the error is the missing rank's, not the store's."""
        store = dist.HashStore()
        pre = [KVShard.allocate(LAYOUTS, PageOwnership(2, 40), r, num_layers=LAYERS) for r in range(2)]
        dec = [KVShard.allocate(LAYOUTS, PageOwnership(2, 30), r, num_layers=LAYERS) for r in range(2)]
        sender = PrefillSender(pre, Bootstrap(store, namespace="wr"), engine=LocalEngine(), timeout_s=5)
        receivers = [DecodeReceiver(d, Bootstrap(store, namespace="wr"), engine=LocalEngine()) for d in dec]
        slot_reads = []

        class Slow:
            def __getattr__(self, name):
                return getattr(link, name)

            def check(self, keys):
                if len(keys) == 1 and keys[0].endswith("/decode/1"):
                    slot_reads.append(keys[0])
                    if len(slot_reads) == 2:  # the claim's read was the first
                        time.sleep(0.8)
                return link.check(keys)

        link, sender.bootstrap.store = sender.bootstrap.store, Slow()
        for side in (sender, *receivers):
            side.connect()
        receivers[0].post_request("w", [1, 2, 3])  # decode rank 1 never takes part
        with pytest.raises(TransferError, match="timed out waiting for every decode rank to take part") as info:
            sender.send_request("w", [4, 5, 6], timeout_s=0.4)
        assert isinstance(info.value.__cause__, StoreTimeout) and len(slot_reads) == 2

    def test_get_reports_the_missing_key_when_the_deadline_lands_in_a_poll(self):
        """``Bootstrap.get``: the key never comes, and the poll that runs into the deadline is slow."""
        store = dist.HashStore()
        boot = Bootstrap(store, namespace="bp")
        calls = []

        class Slow:
            def __getattr__(self, name):
                return getattr(store, name)

            def check(self, keys):
                calls.append(keys)
                if len(calls) == 3:
                    time.sleep(0.6)
                return store.check(keys)

        boot.store = Slow()
        with pytest.raises(TransferError, match="timed out waiting for 'nothing'") as info:
            boot.get("nothing", deadline=time.monotonic() + 0.3)
        assert isinstance(info.value.__cause__, StoreTimeout) and len(calls) == 3


class _Writes:
    """Forwards every store call and counts the writes (``set``, ``add`` of a non-zero amount, ``compare_set``,
    ``delete_key``)."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.writes = 0

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name not in ("set", "add", "compare_set", "delete_key"):
            return attr

        def call(*args):
            if name != "add" or args[1]:
                self.writes += 1
            return attr(*args)

        return call


def _receivers(cp_d: int, *, meta_rows: int = 4):
    """A 2-rank prefill sender and one receiver per decode rank (pool of 30 pages, ``meta_rows`` rows each)."""
    bootstrap = Bootstrap(dist.HashStore(), namespace="post")
    own_p, own_d = PageOwnership(2, 40), PageOwnership(cp_d, 30)
    mk = dict(meta_num_rows=meta_rows, meta_row_bytes=32) if meta_rows else {}
    pre = [KVShard.allocate(LAYOUTS, own_p, r, num_layers=LAYERS, staging_bytes=1 << 20, **mk) for r in range(2)]
    for s in pre:
        _fill(s, 10 + s.rank)
    dec = [KVShard.allocate(LAYOUTS, own_d, d, num_layers=LAYERS, staging_bytes=1 << 20, **mk) for d in range(cp_d)]
    sender = PrefillSender(pre, bootstrap, engine=LocalEngine(), timeout_s=5)
    receivers = [DecodeReceiver(d, bootstrap, engine=LocalEngine(), timeout_s=5) for d in dec]
    for side in (sender, *receivers):
        side.connect()
    bootstrap.flush(5)
    bootstrap.store = counter = _Writes(bootstrap.store)
    return sender, receivers, counter


class TestPostValidation:
    """``post_request`` checks pages and the metadata slot against the pool and against every request posted here
    and not waited for yet; a rejected post changes nothing (no store write, no staging grant)."""

    @pytest.mark.parametrize(
        "kwargs,error,match",
        [
            (dict(dst_pages=[29, 30]), ValueError, r"dst_pages must hold logical pages in \[0, 30\), got .*30"),
            (dict(dst_pages=[4, -1]), ValueError, r"dst_pages must hold logical pages in \[0, 30\), got .*-1"),
            (dict(dst_pages=[3, 7, 3]), ValueError, r"dst_pages must not repeat a page, got page 3 more than once"),
            (
                dict(dst_pages=[1], dst_meta_slot=4),
                ValueError,
                r"dst_meta_slot must be in \[0, 4\) \(the metadata rows of decode rank 0\), got dst_meta_slot=4",
            ),
            (dict(dst_pages=[1], dst_meta_slot=-1), ValueError, r"dst_meta_slot must be in \[0, 4\) .*=-1"),
            (dict(dst_pages=[1], dst_meta_slot=True), TypeError, r"dst_meta_slot must be an int or None, got True"),
            (dict(dst_pages=[1], dst_meta_slot=1.0), TypeError, r"dst_meta_slot must be an int or None, got 1.0"),
            (dict(dst_pages=[1], num_tokens=-3), ValueError, r"num_tokens must be None or an int >= 0, got -3"),
        ],
        ids=[
            "past-pool",
            "negative",
            "repeated",
            "slot-past-rows",
            "slot-negative",
            "slot-bool",
            "slot-float",
            "tokens",
        ],
    )
    @pytest.mark.parametrize("cp_d", [1, 2])
    def test_rejects_bad_arguments_and_changes_nothing(self, cp_d, kwargs, error, match):
        sender, receivers, counter = _receivers(cp_d)
        for r in receivers:
            with pytest.raises(error, match=match):
                r.post_request("x", **kwargs)
        assert counter.writes == 0, "a rejected post wrote to the store"
        self._round_trip_is_staged(sender, receivers, "x")

    def test_rejects_a_metadata_slot_without_metadata_rows(self):
        _, receivers, counter = _receivers(1, meta_rows=0)
        with pytest.raises(ValueError, match=r"dst_meta_slot needs metadata rows on decode rank 0, which registered"):
            receivers[0].post_request("x", [1], dst_meta_slot=0)
        assert counter.writes == 0

    @pytest.mark.parametrize("cp_d", [1, 2, 3])
    def test_rejects_pages_and_slot_of_a_pending_request(self, cp_d):
        """A on [0, 1] is posted and not waited for: B on [1, 2] would put B's KV in A's page 1; a shared
        ``dst_meta_slot`` likewise. Every receiver refuses, whichever rank hosts the page."""
        sender, receivers, counter = _receivers(cp_d)
        for r in receivers:
            r.post_request("A", [0, 1], dst_meta_slot=2, staging=False)
        writes = counter.writes
        for r in receivers:
            with pytest.raises(
                ValueError,
                match=r"dst_pages must not hold pages of request 'A', posted here and not waited for yet \(both would be "
                r"written there\), got pages \[1\]",
            ):
                r.post_request("B", [1, 2])
            with pytest.raises(
                ValueError, match=r"dst_meta_slot must not be the slot of request 'A', posted here and not waited"
            ):
                r.post_request("C", [5, 6], dst_meta_slot=2)
        assert counter.writes == writes, "a rejected post wrote to the store"
        sender.send_request("A", [3, 4], meta=b"a", src_meta_slot=0)
        for r in receivers:
            r.wait_request("A")
        for r in receivers:  # A was waited for: its pages and slot are the caller's again
            r.post_request("B", [1, 2], dst_meta_slot=2)
        sender.send_request("B", [5, 6], meta=b"b", src_meta_slot=0)
        for r in receivers:
            r.wait_request("B")
        _check(sender, receivers[0], [5, 6], [1, 2]) if cp_d == 1 else None
        for d, r in enumerate(receivers):
            assert bytes(r.shards[d].meta[2, :1].tolist()) == b"b"

    def test_rejects_the_request_id_of_a_pending_request(self):
        _, receivers, counter = _receivers(1)
        receivers[0].post_request("A", [0])
        writes = counter.writes
        with pytest.raises(ValueError, match=r"request_id must not be pending on this receiver already"):
            receivers[0].post_request("A", [9])
        assert counter.writes == writes

    @staticmethod
    def _round_trip_is_staged(sender, receivers, rid):
        """The staging grants are still free: a request with strided pages is staged on every decode rank."""
        dst = np.arange(0, 20, 2)
        for r in receivers:
            r.post_request(rid, dst)
        sender.send_request(rid, np.arange(10))
        assert all(r.wait_request(rid).staged for r in receivers)


class TestFinishBits:
    """``AttemptKeys.finish``: each party's bit once, several counter words past 62 parties, and the restart's
    reads (``unfinished``, ``deleting``) never creating a key, checked against a plain set of finished parties."""

    @staticmethod
    def _attempt(store, num_prefill, num_decode):
        keys = AttemptKeys("r", "0123456789abcdef", num_prefill, num_decode)
        keys.create(store)
        for k in keys.all()[: -keys.num_words]:
            store.set(k, b"x")
        return keys

    @pytest.mark.parametrize(("num_prefill", "num_decode"), [(1, 1), (2, 3), (61, 1), (62, 1), (40, 47), (64, 64)])
    def test_deletes_once_every_party_finished_in_any_order(self, num_prefill, num_decode):
        store = dist.HashStore()
        keys = self._attempt(store, num_prefill, num_decode)
        assert keys.num_words == -(-(num_prefill + num_decode) // WORD_BITS)
        parties = list(range(num_prefill + num_decode))
        order = np.random.default_rng(num_prefill * 100 + num_decode).permutation(parties).tolist()
        done: set[int] = set()
        while order:  # batches of 1-3 parties, as a side hosting several ranks finishes them
            batch, order = order[:3], order[3:]
            assert sorted(keys.unfinished(store, parties)) == sorted(set(parties) - done)
            assert not keys.deleting(store)
            deleted = keys.finish(store, batch)
            done |= set(batch)
            assert deleted == (done == set(parties))
        assert store.num_keys() == 0

    def test_a_missing_word_means_nothing_to_finish(self):
        store = dist.HashStore()
        keys = AttemptKeys("r", "0123456789abcdef", 2, 1)
        assert keys.unfinished(store, [0, 1, 2]) == []  # deleted (or never created): an add would create it
        assert not keys.deleting(store)
        assert store.num_keys() == 0

    def test_deleting_while_words_go(self):
        store = dist.HashStore()
        keys = self._attempt(store, 70, 60)  # three words
        for w in range(keys.num_words):
            store.add(keys.finished(w), keys.full_word(w))
        assert keys.deleting(store)
        store.delete_key(keys.finished(2))  # the deletion deletes the words last to first
        assert keys.deleting(store)
        store.delete_key(keys.finished(1))
        assert keys.deleting(store)
        store.delete_key(keys.finished(0))
        assert not keys.deleting(store) and keys.unfinished(store, range(130)) == []

    def test_a_word_short_of_one_party_is_not_deleting(self):
        store = dist.HashStore()
        keys = self._attempt(store, 70, 60)
        keys.finish(store, [p for p in range(130) if p != 100])
        assert not keys.deleting(store)
        assert keys.unfinished(store, range(130)) == [100]

    def test_party_numbers(self):
        keys = AttemptKeys("r", "0123456789abcdef", 3, 2)
        assert [keys.party("prefill", r) for r in range(3)] + [keys.party("decode", d) for d in range(2)] == [
            0,
            1,
            2,
            3,
            4,
        ]
        for role, rank in [("prefill", 3), ("decode", 2), ("decode", -1), ("other", 0)]:
            with pytest.raises(ValueError, match=r"role and rank must name one of the attempt's 3 prefill and 2"):
                keys.party(role, rank)

    def test_peek_never_creates(self):
        store = dist.HashStore()
        assert peek_counter(store, "k") is None and store.num_keys() == 0
        store.add("k", 7)
        assert peek_counter(store, "k") == 7
        store.set("v", b"not a counter")
        assert peek_counter(store, "v") is None
