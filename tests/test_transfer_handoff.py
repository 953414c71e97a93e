"""The hand-off of pools an engine cannot register (``dtkv.transfer.handoff``), on CPU: the engine's refusal is
emulated with ``LocalEngine(accepts=...)`` (the pools stand for device memory under Mooncake's non-cuda wheel), so
the host-staged path runs in CI; ``tests/test_transfer_handoff_cuda.py`` runs it on CUDA pools.

What must hold, for every pair of sides (staged or in place) and CP sizes 1 -> 1, 2 -> 3 and 3 -> 2, with requests
of 1, 7 and 10 pages in rounds of 1, 3 and 64 pages:

- every decode page equals its prefill page bitwise, every other decode byte is untouched, the prefill pools are
  never written, the metadata row arrives with the last round;
- the engine never registers a pool it refuses; the window is bounded (``2 * round_pages`` pages per layer and
  buffer), registered once and reused by every round and request;
- faults leave the decode pools untouched: a stalled engine call (timeout), a prefill side that never sends
  (timeout, bounded), a malformed post (rounds of another size) and a bad argument (raising before anything is
  posted); after a failed round the window's quarantine is waited out, and the next request arrives intact.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dtkv import PageOwnership
from dtkv.transfer import (
    Bootstrap,
    HandoffReceiver,
    HandoffSender,
    LocalEngine,
    MooncakeEngine,
    TransferError,
    default_round_pages,
    needs_host_staging,
)
from dtkv.transfer import memory as memory_mod
from dtkv.transfer.handoff import round_request_id
from tests._transfer import LAYOUTS, pages, same_pages, shards

META_BYTES = 24


def _refusing(pools):
    """A LocalEngine that refuses the ``pools``' buffers (as a non-cuda engine refuses device memory)."""
    ptrs = {t.data_ptr() for s in pools for t in s.buffers.values()}
    return LocalEngine(call_timeout_s=2.0, accepts=lambda t: t.data_ptr() not in ptrs)


def _sides(
    cp_p, cp_d, *, stage_p, stage_d, round_pages, timeout_s=10.0, seed=1, p_pages=40, d_pages=45, page_major=(0, 0)
):
    boot = Bootstrap(dist.HashStore(), namespace=f"handoff-{time.monotonic_ns()}")
    meta = {"meta_num_rows": 1, "meta_row_bytes": META_BYTES}
    pre = shards(PageOwnership(cp_p, p_pages), seed=seed, page_major=bool(page_major[0]), **meta)
    dec = shards(PageOwnership(cp_d, d_pages, "block"), seed=seed + 100, page_major=bool(page_major[1]), **meta)
    eng_p = _refusing(pre) if stage_p else LocalEngine(call_timeout_s=2.0)
    eng_d = _refusing(dec) if stage_d else LocalEngine(call_timeout_s=2.0)
    sender = HandoffSender(pre, boot, engine=eng_p, timeout_s=timeout_s, round_pages=round_pages)
    receiver = HandoffReceiver(dec, boot, engine=eng_d, timeout_s=timeout_s, round_pages=round_pages)
    sender.connect(), receiver.connect()
    assert (sender.staged, receiver.staged) == (stage_p, stage_d)
    return pre, dec, sender, receiver


def _snapshot(shard_list):
    return [{n: b.clone() for n, b in s.buffers.items()} for s in shard_list]


def _unchanged(shard_list, snap, *, except_pages=()):
    """Whether every byte of ``shard_list`` equals ``snap``, outside the logical pages ``except_pages``."""
    own = shard_list[0].ownership
    skip = {(int(own.owner(p)), int(own.local_index(p))) for p in except_pages}
    for s, before in zip(shard_list, snap):
        keep = [j for j in range(own.num_local_pages(s.rank)) if (s.rank, j) not in skip]
        for n, b in s.buffers.items():
            if not torch.equal(b[:, keep], before[n][:, keep]):
                return False
    return True


def _handoff(sender, receiver, rid, src, dst, *, meta=b"", limit_s=30.0, timeout_s=None):
    """Receive on a thread, send here; ``(send report or error, receive report or error)``."""
    box: dict = {}

    def recv():
        try:
            for s in receiver.shards.values():
                if s.meta is not None:
                    s.meta.zero_()
            box["recv"] = receiver.receive_request(rid, dst, dst_meta_slot=0 if meta else None, timeout_s=timeout_s)
        except Exception as e:  # noqa: BLE001 - handed to the test
            box["recv"] = e

    th = threading.Thread(target=recv, daemon=True)
    th.start()
    try:
        box["send"] = sender.send_request(rid, src, meta=meta or None, timeout_s=timeout_s)
    except Exception as e:  # noqa: BLE001
        box["send"] = e
    th.join(limit_s)
    assert not th.is_alive(), "the receive outlived its bound"
    return box["send"], box["recv"]


def _meta_row(receiver) -> bytes:
    return bytes(next(iter(receiver.shards.values())).meta[0].tolist())


PAGE_MAJOR = [(0, 0), (1, 1), (1, 0), (0, 1)]
PAGE_MAJOR_IDS = ["lm-lm", "pm-pm", "pm-lm", "lm-pm"]


@pytest.mark.parametrize(
    "page_major, round_pages",
    [(pm, rp) for pm in PAGE_MAJOR for rp in ((1, 3, 64) if pm == (0, 0) else (3,))],
    ids=[f"{i}-r{rp}" for pm, i in zip(PAGE_MAJOR, PAGE_MAJOR_IDS) for rp in ((1, 3, 64) if pm == (0, 0) else (3,))],
)
@pytest.mark.parametrize("stage_p, stage_d", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("cp_p, cp_d", [(1, 1), (2, 3), (3, 2)])
def test_every_page_arrives_bitwise_through_the_window(stage_p, stage_d, cp_p, cp_d, round_pages, page_major):
    """Pools of either layout on either side (page-major: ``[num_local_pages, num_layers, ...]``), staged or not."""
    pre, dec, sender, receiver = _sides(
        cp_p, cp_d, stage_p=stage_p, stage_d=stage_d, round_pages=round_pages, page_major=page_major
    )
    assert [s.page_major for s in pre + dec] == [bool(page_major[0])] * cp_p + [bool(page_major[1])] * cp_d
    try:
        pre_snap, dec_snap = _snapshot(pre), _snapshot(dec)
        rng = np.random.default_rng(cp_p * 10 + cp_d)
        sent: list[int] = []
        for i, n in enumerate((1, 7, 10)):
            src = rng.choice(40, n, replace=False)
            dst = rng.choice(np.setdiff1d(np.arange(45), sent), n, replace=False)
            meta = bytes(range(i, i + META_BYTES))
            rep, got = _handoff(sender, receiver, f"req-{i}", src, dst, meta=meta)
            assert not isinstance(rep, Exception) and not isinstance(got, Exception), (rep, got)
            assert got.num_positions == n and rep.num_bytes > 0 and got.staged == (stage_d or got.staged)
            assert same_pages(pre, src, dec, dst), f"request {i}: a decode page differs from its prefill page"
            assert _meta_row(receiver) == meta
            sent += dst.tolist()
            assert _unchanged(dec, dec_snap, except_pages=sent), "a page outside the requests changed"
        assert _unchanged(pre, pre_snap), "the prefill pools were written"
        for side, staged in ((sender, stage_p), (receiver, stage_d)):
            buf = next(iter(side.shards.values())).buffers["kv"]
            if staged:  # the engine holds the bounded window, never the pools
                assert buf.shape[1] == 2 * round_pages
                assert all(b.data_ptr() not in {t.data_ptr() for s in (pre + dec) for t in s.buffers.values()}
                           for s in side.shards.values() for b in s.buffers.values())  # fmt: skip
    finally:
        sender.close(), receiver.close()


def test_the_window_is_registered_once_and_reused_by_every_round():
    pre, dec, sender, receiver = _sides(2, 2, stage_p=True, stage_d=True, round_pages=2)
    try:
        registered = (sender.engine.registered, receiver.engine.registered)
        src, dst = np.arange(3, 14), np.arange(20, 31)  # 11 pages: 6 rounds through 2 slots
        rep, got = _handoff(sender, receiver, "long", src, dst)
        assert not isinstance(got, Exception), got
        assert same_pages(pre, src, dec, dst)
        assert (sender.engine.registered, receiver.engine.registered) == registered
        assert sender._side.window_bytes() == sum(  # two slots of round_pages pages per layer and buffer, per rank
            2 * 2 * 2 * lay.page_bytes * pre[0].num_layers for lay in LAYOUTS.values()
        )
    finally:
        sender.close(), receiver.close()


# ----------------------------------------------------------------------------------------- refusing engines
def test_a_refusing_engine_fails_registration_at_once_naming_the_rule():
    pool = shards(PageOwnership(1, 4))[0]
    engine = _refusing([pool])
    with pytest.raises(TransferError, match=r"LocalEngine cannot register cpu memory \(refused by its accepts"):
        engine.register(list(pool.buffers.values()))
    assert engine.registered == 0
    assert needs_host_staging(pool.buffers.values(), engine) and not needs_host_staging([torch.zeros(3)], engine)
    engine.close()


def test_mooncake_build_decides_device_memory(monkeypatch):
    """The non-cuda wheel moves host memory only; the CUDA builds register device memory."""
    monkeypatch.setattr(memory_mod, "mooncake_build", lambda: "mooncake-transfer-engine-non-cuda")
    assert not memory_mod.mooncake_registers_device_memory()
    monkeypatch.setattr(memory_mod, "mooncake_build", lambda: "mooncake-transfer-engine-cuda13")
    assert memory_mod.mooncake_registers_device_memory()
    fake_cuda = torch.empty(0, device="meta")  # not host memory
    monkeypatch.setattr(memory_mod, "mooncake_registers_device_memory", lambda: False)
    assert needs_host_staging([fake_cuda]) and not needs_host_staging([torch.zeros(1)])


def test_mooncake_refuses_device_memory_on_a_host_only_build():
    pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine (non-cuda wheel + libibverbs1)")
    engine = MooncakeEngine(device_memory=False)
    try:
        fake_cuda = torch.empty(4, device="meta")
        assert not engine.can_register(fake_cuda) and engine.can_register(torch.zeros(4))
        with pytest.raises(TransferError, match="cannot register meta memory .* moves host memory only"):
            engine.register([fake_cuda])
        assert engine.registered == 0
    finally:
        engine.close()


# ----------------------------------------------------------------------------------------- faults
class _StallingEngine(LocalEngine):
    """A refusing LocalEngine whose next write sleeps ``delay_s`` first (a stalled link)."""

    def __init__(self, pools, delay_s):
        ptrs = {t.data_ptr() for s in pools for t in s.buffers.values()}
        super().__init__(call_timeout_s=delay_s + 0.5, accepts=lambda t: t.data_ptr() not in ptrs)
        self.delay_s, self.stalls = delay_s, 1

    def write(self, peer, src, dst, length):
        if self.stalls:
            self.stalls -= 1
            time.sleep(self.delay_s)
        return super().write(peer, src, dst, length)


def test_a_stalled_call_times_out_leaving_the_decode_pool_untouched_and_the_next_request_arrives():
    boot = Bootstrap(dist.HashStore(), namespace="handoff-stall")
    pre = shards(PageOwnership(1, 20), seed=3, meta_num_rows=1, meta_row_bytes=META_BYTES)
    dec = shards(PageOwnership(2, 20), seed=4, meta_num_rows=1, meta_row_bytes=META_BYTES)
    sender = HandoffSender(pre, boot, engine=_StallingEngine(pre, 1.5), timeout_s=0.8, round_pages=4)
    receiver = HandoffReceiver(dec, boot, engine=_refusing(dec), timeout_s=0.8, round_pages=4)
    try:
        sender.connect(), receiver.connect()
        snap = _snapshot(dec)
        t0 = time.monotonic()
        rep, got = _handoff(sender, receiver, "stalled", np.arange(0, 6), np.arange(0, 6), meta=b"x" * META_BYTES)
        assert isinstance(rep, TransferError) and isinstance(got, TransferError), (rep, got)
        assert time.monotonic() - t0 < 0.8 + 2.0, "a wait outlived its bound"
        assert _unchanged(dec, snap), "a failed round wrote the decode pool"
        assert receiver.quarantined == {}  # late bytes can land in the window only: the pool pages are free
        assert receiver.receiver.quarantined, "the window's attempt should be quarantined while its call runs"
        # at once, while the abandoned call still runs: the next request waits out the window's quarantine
        rep, got = _handoff(sender, receiver, "after", np.arange(6, 12), np.arange(0, 6), meta=b"y" * META_BYTES,
                            timeout_s=10.0)  # fmt: skip
        assert not isinstance(got, Exception) and not isinstance(rep, Exception), (rep, got)
        assert same_pages(pre, np.arange(6, 12), dec, np.arange(0, 6)) and _meta_row(receiver) == b"y" * META_BYTES
    finally:
        sender.close(), receiver.close()


def test_a_prefill_side_that_never_sends_fails_the_receive_within_its_bound():
    pre, dec, sender, receiver = _sides(1, 1, stage_p=True, stage_d=True, round_pages=2, timeout_s=0.5)
    try:
        snap = _snapshot(dec)
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="timed out"):
            receiver.receive_request("lonely", [1, 2, 3])
        assert time.monotonic() - t0 < 0.5 + 1.5
        assert _unchanged(dec, snap)
    finally:
        sender.close(), receiver.close()


def test_rounds_of_another_size_fail_both_sides_at_once_naming_the_rule():
    boot = Bootstrap(dist.HashStore(), namespace="handoff-rounds")
    pre = shards(PageOwnership(1, 20), seed=5)
    dec = shards(PageOwnership(1, 20), seed=6)
    sender = HandoffSender(pre, boot, engine=_refusing(pre), timeout_s=5, round_pages=4)
    receiver = HandoffReceiver(dec, boot, engine=_refusing(dec), timeout_s=5, round_pages=3)
    try:
        sender.connect(), receiver.connect()
        snap = _snapshot(dec)
        t0 = time.monotonic()
        rep, got = _handoff(sender, receiver, "mismatch", np.arange(0, 7), np.arange(0, 7))
        assert isinstance(rep, TransferError) and "same round_pages, 4 here" in str(rep)
        assert isinstance(got, TransferError) and time.monotonic() - t0 < 4.0, got
        assert _unchanged(dec, snap)
    finally:
        sender.close(), receiver.close()


def test_bad_arguments_raise_before_anything_is_posted():
    pre, dec, sender, receiver = _sides(1, 2, stage_p=True, stage_d=True, round_pages=2, timeout_s=2)
    try:
        snap = _snapshot(dec)
        with pytest.raises(ValueError, match=r"dst_pages must hold logical pages in \[0, 45\)"):
            receiver.receive_request("bad", [0, 45])
        with pytest.raises(ValueError, match="num_tokens must need len"):
            receiver.receive_request("bad", [0, 1], num_tokens=100)
        with pytest.raises(ValueError, match="request_id must be a non-empty str"):
            receiver.receive_request("a/b", [0, 1])
        with pytest.raises(ValueError, match="src_pages must not repeat a page"):
            sender.send_request("bad", [3, 3])
        with pytest.raises(ValueError, match="meta must fit a metadata row of 24 bytes"):
            sender.send_request("bad", [3], meta=b"z" * 25)
        assert receiver.receiver._pending == {} and _unchanged(dec, snap)
        with pytest.raises(ValueError, match="round_pages must be"):
            HandoffSender(pre, sender.sender.bootstrap, engine=LocalEngine(), round_pages=0)
    finally:
        sender.close(), receiver.close()


def test_round_ids_and_default_round_pages():
    assert round_request_id("req-3", 2) == "req-3#2"
    per_page = 2 * sum(lay.page_bytes for lay in LAYOUTS.values())
    assert default_round_pages(LAYOUTS, 2, window_bytes=10 * per_page) == 5
    assert default_round_pages(LAYOUTS, 2, window_bytes=1) == 1
    assert pages(shards(PageOwnership(1, 2)), "kv", [1]).shape[1] == 1


def test_progress_is_logged_per_request_and_per_engine_call(caplog):
    """INFO for each request sent and received (bytes, GB/s), DEBUG for each engine call: a stalled hand-off is
    never silent."""
    pre, dec, sender, receiver = _sides(1, 2, stage_p=True, stage_d=False, round_pages=3)
    try:
        with caplog.at_level(logging.DEBUG, logger="dtkv.transfer"):
            _, got = _handoff(sender, receiver, "logged", np.arange(0, 5), np.arange(10, 15))
        assert not isinstance(got, Exception), got
        text = [r.getMessage() for r in caplog.records]
        assert any(m.startswith("sent 'logged#1' (prefill ranks [0]): ") and "GB/s" in m for m in text), text
        assert any(m.startswith("received 'logged#1' (decode ranks [0, 1]): ") and "GB/s" in m for m in text), text
        assert any(m.startswith("handed 'logged' over") and "2 round(s) through pinned host memory" in m for m in text)
        calls = [
            r for r in caplog.records if r.levelno == logging.DEBUG and ": call 1 to decode rank" in r.getMessage()
        ]
        assert calls and all("bytes in" in r.getMessage() and "rc 0" in r.getMessage() for r in calls)
    finally:
        sender.close(), receiver.close()
