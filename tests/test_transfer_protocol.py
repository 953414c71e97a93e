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
    TransferError,
    send_entries,
)
from dtkv.transfer.descriptors import PeerEntries

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
