"""``NixlEngine`` on its own: NIXL agents with the UCX backend over loopback, host memory.

What the PD suite (parametrized over the engines) does not pin: writes land bitwise through NIXL requests of any
batch size, every entry is checked against the registered regions before NIXL sees it, the agent metadata travels
only as a checked (and signed) store record, a newer record replaces the loaded one, a dead peer fails at once, a
stalled one is bounded by the engine's own timeout and the connection comes back, sessions of another engine are
refused, and NIXL's own log stays off stdout.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dtkv.transfer import Bootstrap, LocalEngine, TransferError, create_store
from dtkv.transfer.messages import AgentRecord
from dtkv.transfer.protocol import agent_key, deadline_after
from dtkv.transfer.wire import Kind, pack
from tests import _engines

pytestmark = [pytest.mark.nixl, pytest.mark.skipif(not _engines.NIXL_OK, reason=_engines.NIXL_WHY)]


def _pair(**kw):
    from dtkv.transfer import NixlEngine

    a, b = NixlEngine(timeout_s=5, **kw), NixlEngine(timeout_s=5)
    return a, b


def _deadline():
    return deadline_after(5.0)


class TestWrites:
    def test_entries_of_awkward_sizes_land_bitwise_in_requests_of_any_batch_size(self):
        """1-byte, prime and partial entries, cut into requests of 3 descriptors, 2 in flight: the peer's bytes
        equal an independent memmove reference, and bytes outside the entries stay untouched."""
        a, b = _pair(batch_entries=3, inflight=2)
        try:
            g = torch.Generator().manual_seed(0)
            src = torch.randint(0, 256, (10007,), generator=g, dtype=torch.uint8)
            dst = torch.zeros(8191, dtype=torch.uint8)
            a.register([src])
            b.register([dst])
            a.add_peer(b.agent_record(), deadline=_deadline())
            rng = np.random.default_rng(1)
            lengths = [1, 2, 3, 5, 7, 13, 31, 64, 127, 509, 1021, 1]
            offs_d = np.cumsum([0, *lengths[:-1]]) * 2 + 3  # disjoint, with gaps
            offs_s = rng.integers(0, src.numel() - 1100, len(lengths))
            rc = a.write(b.session, (src.data_ptr() + offs_s).tolist(), (dst.data_ptr() + offs_d).tolist(), lengths)
            assert rc == 0, a.last_error(b.session)
            want = torch.zeros_like(dst)
            for s, d, n in zip(offs_s.tolist(), offs_d.tolist(), lengths):
                want[d : d + n] = src[s : s + n]
            assert torch.equal(dst, want)
        finally:
            a.close()
            b.close()

    def test_an_entry_outside_the_registered_regions_is_refused_and_nothing_is_written(self):
        a, b = _pair()
        try:
            src, dst = torch.full((256,), 7, dtype=torch.uint8), torch.zeros(256, dtype=torch.uint8)
            a.register([src])
            b.register([dst])
            s, d = src.data_ptr(), dst.data_ptr()
            assert a.write(b.session, [s], [d], [16]) == -1
            assert "not loaded" in a.last_error(b.session)
            a.add_peer(b.agent_record(), deadline=_deadline())
            for srcs, dsts, lens, side in [
                ([s, s], [d, d + 250], [16, 7], "destination"),  # the second entry ends 1 byte past the region
                ([s, s + 250], [d, d + 32], [16, 7], "source"),
                ([s], [d - 1], [4], "destination"),
                ([s], [d], [0], "source"),  # an empty entry
            ]:
                assert a.write(b.session, srcs, dsts, lens) == -1
                assert side in a.last_error(b.session)
                assert int(dst.sum()) == 0, "a refused call wrote bytes"
            assert a.write(b.session, [s], [d + 240], [16]) == 0 and int(dst.sum()) == 7 * 16
            assert a.last_error(b.session) == ""
        finally:
            a.close()
            b.close()

    def test_register_refuses_overlaps_and_tracks_what_is_registered(self):
        a, _ = _pair()
        try:
            buf = torch.zeros(1024, dtype=torch.uint8)
            a.register([buf[:512]])
            gen = a.generation
            with pytest.raises(TransferError, match="overlaps one registered already"):
                a.register([buf[256:768]])
            with pytest.raises(TransferError, match="overlaps"):
                a.register([buf[600:700], buf[650:800]])
            with pytest.raises(ValueError, match="must be contiguous"):
                a.register([torch.zeros(8, 8)[:, 0]])
            assert a.registered == 1 and a.generation == gen, "a refused registration left something behind"
            a.register([buf[512:], torch.zeros(0)])
            assert a.registered == 2 and a.generation == gen + 1
            a.unregister([buf[:512]])
            assert a.registered == 1 and a.generation == gen + 2
            rec = a.agent_record()
            assert rec.region_addr.tolist() == [buf.data_ptr() + 512] and rec.region_device.tolist() == [-1]
        finally:
            a.close()
            _.close()
        assert a.registered == 0 and _engines.released(a)

    def test_descriptor_lists_group_entries_by_device_pair_and_keep_their_order(self, monkeypatch):
        """Entries of mixed (source, destination) devices become one run of requests per pair, each in entry
        order and cut at ``batch_entries``; one pair for all entries (host to host) is one run. Checked against
        the descriptors an independent loop expects, without CUDA (the lists are only built, never posted)."""
        import dtkv.transfer._nixl as nixl_mod

        monkeypatch.setattr(nixl_mod, "_bind_cuda", lambda device: None)
        a, _ = _pair(batch_entries=2)
        try:
            n = 7
            s = np.arange(n, dtype=np.int64) * 100 + 1000
            d = np.arange(n, dtype=np.int64) * 10 + 5000
            ln = np.arange(1, n + 1, dtype=np.int64)
            for src_dev, dst_dev in [
                ([-1] * n, [-1] * n),
                ([-1, 0, -1, 0, 3, -1, 0], [-1, -1, -1, 1, 1, 2, -1]),
                ([5] * n, [1023] * n),
            ]:
                sd, dd = np.array(src_dev, dtype=np.int64), np.array(dst_dev, dtype=np.int64)
                want = []
                for pair in sorted(set(zip(src_dev, dst_dev))):
                    idx = [i for i in range(n) if (src_dev[i], dst_dev[i]) == pair]
                    want += [(pair, idx[k : k + 2]) for k in range(0, len(idx), 2)]
                got = a._batches(s, d, ln, sd, dd)
                assert len(got) == len(want)
                for (local, remote), ((s_dev, d_dev), idx) in zip(got, want):
                    for dl, dev, addr in ((local, s_dev, s), (remote, d_dev, d)):
                        assert dl.descCount() == len(idx)
                        assert dl.getType().name == ("DRAM_SEG" if dev < 0 else "VRAM_SEG")
                        for k, i in enumerate(idx):
                            assert dl.index((int(addr[i]), int(ln[i]), max(dev, 0))) == k
        finally:
            a.close()
            _.close()

    def test_send_entries_hands_nixl_its_entries_as_arrays(self, monkeypatch):
        """NIXL takes int64 arrays as they are (no list round trip per call); Mooncake's binding gets lists."""
        from dtkv.transfer import NixlEngine, PeerEntries, send_entries

        a, b = _pair()
        try:
            src, dst = torch.arange(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
            a.register([src])
            b.register([dst])
            a.add_peer(b.agent_record(), deadline=_deadline())
            seen = []
            real = NixlEngine.write

            def spy(self, peer, s, d, n):
                seen.append(type(s))
                return real(self, peer, s, d, n)

            monkeypatch.setattr(NixlEngine, "write", spy)
            entries = PeerEntries(decode_rank=0, session=b.session, src=np.array([src.data_ptr(), src.data_ptr() + 40]),
                                  dst=np.array([dst.data_ptr() + 1, dst.data_ptr() + 50]), length=np.array([30, 9]),
                                  positions=np.zeros(0, dtype=np.int64), dst_pages=np.zeros(0, dtype=np.int64))  # fmt: skip
            assert send_entries(a, [entries], request_id="r", deadline=_deadline()) == 1
            assert seen == [np.ndarray]
            assert torch.equal(dst[1:31], src[:30]) and torch.equal(dst[50:59], src[40:49])
        finally:
            a.close()
            b.close()


class TestMetadata:
    @pytest.mark.parametrize("secret", [None, "s3cret"], ids=["unsigned", "signed"])
    def test_the_agent_record_travels_through_the_store_and_a_newer_one_replaces_it(self, secret):
        """publish_agent -> agent -> add_peer (the store is the only channel); the peer then moves its memory and
        publishes again: the writer reloads, writes to the new region land, writes to the old one are refused."""
        store = dist.HashStore()
        boot_a, boot_b = (
            Bootstrap(store, namespace="md", secret=secret),
            Bootstrap(store, namespace="md", secret=secret),
        )
        a, b = _pair()
        try:
            src = torch.full((64,), 3, dtype=torch.uint8)
            old, new = torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
            a.register([src])
            b.register([old])
            first = b.agent_record()
            boot_b.publish_agent("decode", 0, first, deadline=_deadline())
            raw = store.get(f"md/{agent_key('decode', 0)}")
            assert raw[:4] == b"DTKV" and b.name.encode() in raw and (raw[6] & 1) == bool(secret)  # flags: signed
            a.add_peer(boot_a.agent("decode", 0, deadline=_deadline()), deadline=_deadline())
            assert a.write(b.session, [src.data_ptr()], [old.data_ptr()], [64]) == 0 and int(old.sum()) == 3 * 64
            a.add_peer(boot_a.agent("decode", 0, deadline=_deadline()), deadline=_deadline())  # same generation
            b.unregister([old])
            b.register([new])
            boot_b.publish_agent("decode", 0, b.agent_record(), deadline=_deadline())
            a.add_peer(boot_a.agent("decode", 0, deadline=_deadline()), deadline=_deadline())
            assert a.write(b.session, [src.data_ptr()], [new.data_ptr()], [64]) == 0 and int(new.sum()) == 3 * 64
            assert a.write(b.session, [src.data_ptr()], [old.data_ptr()], [64]) == -1
            boot_b.unpublish_agent("decode", 0, first).result(5)  # a later generation is published: kept
            assert store.check([f"md/{agent_key('decode', 0)}"])
            boot_b.unpublish_agent("decode", 0, boot_a.agent("decode", 0, deadline=_deadline())).result(5)
            assert not store.check([f"md/{agent_key('decode', 0)}"])
        finally:
            a.close()
            b.close()

    def test_forged_moved_and_malformed_records_are_refused(self):
        from dtkv.transfer import NixlEngine

        store = dist.HashStore()
        a, b = _pair()
        key = agent_key("decode", 0)
        try:
            b.register([torch.zeros(64, dtype=torch.uint8)])
            signed = Bootstrap(store, namespace="f", secret="s3cret")
            peer = Bootstrap(store, namespace="f", secret=None)  # a store peer without the secret
            peer.publish_agent("decode", 0, b.agent_record(), deadline=_deadline())  # unsigned
            with pytest.raises(TransferError, match="must be signed"):
                signed.agent("decode", 0, deadline=_deadline())
            signed.publish_agent("decode", 1, b.agent_record(), deadline=_deadline())  # genuine, moved to rank 0
            store.set(f"f/{key}", store.get(f"f/{agent_key('decode', 1)}"))
            with pytest.raises(TransferError, match="HMAC does not verify"):
                signed.agent("decode", 0, deadline=_deadline())
            rec = b.agent_record()
            garbage = AgentRecord(name=b.name, generation=rec.generation, metadata=b"not NIXL metadata",
                                  region_addr=rec.region_addr, region_bytes=rec.region_bytes,
                                  region_device=rec.region_device)  # fmt: skip
            with pytest.raises(TransferError, match="NIXL refused"):
                a.add_peer(garbage, deadline=_deadline())
            c = NixlEngine(timeout_s=5)
            try:  # a record whose metadata is another agent's
                moved = AgentRecord(name=b.name, generation=rec.generation, metadata=c.agent_record().metadata,
                                    region_addr=rec.region_addr, region_bytes=rec.region_bytes,
                                    region_device=rec.region_device)  # fmt: skip
                with pytest.raises(TransferError, match="carries the metadata of agent"):
                    a.add_peer(moved, deadline=_deadline())
            finally:
                c.close()
            for fields, what in [
                ([b.name, 1, b"x", [8, 4], [8, 8], [-1, -1]], "ascending and disjoint"),
                ([b.name, 1, b"x", [8], [0], [-1]], "region_bytes"),
                ([b.name, 1, b"", [8], [8], [-1]], "metadata"),
                (["bad name!", 1, b"x", [8], [8], [-1]], "agent name"),
            ]:
                store.set(f"f/{key}", pack(Kind.AGENT, fields, key=key, secret=None))
                with pytest.raises(TransferError, match=what):
                    peer.agent("decode", 0, deadline=_deadline())
            assert a.write(b.session, [0], [0], [1]) == -1, "a refused record must leave the peer unknown"
        finally:
            a.close()
            b.close()

    def test_sessions_of_another_engine_are_refused(self):
        a, _ = _pair()
        try:
            for session in ("127.0.0.1:15001", "local:3", "nixl:bad name"):
                with pytest.raises(TransferError, match="both sides must use the same transfer engine"):
                    a.check_sessions([session])
            a.check_sessions([_.session])
            local = LocalEngine()
            for session in ("nixl:dtkv-1-ab", "127.0.0.1:15001"):
                with pytest.raises(TransferError, match="not a LocalEngine peer's"):
                    local.check_sessions([session])
            local.check_sessions(["local:0"])
            with pytest.raises(TypeError, match="LocalEngine takes no agent records"):
                local.add_peer(a.agent_record(), deadline=_deadline())
        finally:
            a.close()
            _.close()

    def test_a_record_of_another_agent_than_the_endpoints_is_refused_at_connect(self):
        """A decode rank's record must name the agent its endpoint's session names (else: a restart in between, or a
        forged record): prefill refuses to load it and writes nothing."""
        from dtkv import PageOwnership
        from dtkv.transfer import DecodeReceiver, NixlEngine, PrefillSender
        from tests._transfer import shards

        boot = Bootstrap(dist.HashStore(), namespace="other")
        sender = PrefillSender(shards(PageOwnership(1, 8)), boot, engine="nixl", timeout_s=5)
        receiver = DecodeReceiver(shards(PageOwnership(1, 8)), boot, engine="nixl", timeout_s=5)
        stranger = NixlEngine(timeout_s=5)
        try:
            stranger.register([torch.zeros(64, dtype=torch.uint8)])
            boot.publish_agent("decode", 0, stranger.agent_record(), deadline=_deadline())
            with pytest.raises(TransferError, match="decode rank 0's agent record names agent"):
                sender.connect()
            boot.publish_agent("decode", 0, receiver.agent, deadline=_deadline())
            sender.connect()  # the genuine record again: it loads
        finally:
            sender.close()
            receiver.close()
            stranger.close()

    def test_sides_on_different_engines_refuse_each_other_at_connect(self):
        from dtkv import PageOwnership
        from dtkv.transfer import DecodeReceiver, PrefillSender
        from tests._transfer import shards

        boot = Bootstrap(dist.HashStore(), namespace="mix")
        sender = PrefillSender(shards(PageOwnership(1, 8)), boot, engine="nixl", timeout_s=5)
        receiver = DecodeReceiver(shards(PageOwnership(1, 8)), boot, engine="local", timeout_s=5)
        try:
            with pytest.raises(TransferError, match="both sides must use the same transfer engine"):
                sender.connect()
        finally:
            sender.close()
            receiver.close()


_PEER = """
import os, sys, torch
from dtkv.transfer import Bootstrap, NixlEngine, create_store
from dtkv.transfer.protocol import deadline_after
engine = NixlEngine(timeout_s=5)
buf = torch.zeros({nbytes}, dtype=torch.uint8)
engine.register([buf])
boot = Bootstrap(create_store(port={port}, is_master=False), namespace="peer")
boot.publish_agent("decode", 0, engine.agent_record(), deadline=deadline_after(30))
print(engine.session, buf.data_ptr(), os.getpid(), flush=True)
for line in sys.stdin:
    print(int(buf.to(torch.int64).sum()), flush=True)
"""


class _Peer:
    """A NixlEngine in a child process, its record published in ``store``; ``checksum()`` sums its buffer."""

    def __init__(self, store, nbytes: int, env: dict | None = None) -> None:
        code = textwrap.dedent(_PEER.format(nbytes=nbytes, port=store.port))
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env={**os.environ, **(env or {})})  # fmt: skip
        self.session, addr, pid = self.proc.stdout.readline().split()
        self.addr, self.pid = int(addr), int(pid)

    def checksum(self) -> int:
        self.proc.stdin.write("sum\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)


class TestPeerFaults:
    def test_a_dead_peer_fails_fast(self):
        from dtkv.transfer import NixlEngine

        store = create_store(port=0, is_master=True, timeout_s=30)
        nbytes = 4 << 20
        peer, engine = _Peer(store, nbytes), NixlEngine(timeout_s=5)
        try:
            src = torch.ones(nbytes, dtype=torch.uint8)
            engine.register([src])
            engine.add_peer(
                Bootstrap(store, namespace="peer").agent("decode", 0, deadline=_deadline()), deadline=_deadline()
            )
            assert engine.write(peer.session, [src.data_ptr()], [peer.addr], [nbytes]) == 0
            assert peer.checksum() == nbytes
            peer.proc.kill()
            peer.proc.wait(10)
            for _ in range(2):  # the failing call, then the reconnecting one
                t0 = time.monotonic()
                assert engine.write(peer.session, [src.data_ptr()], [peer.addr], [nbytes]) == -1
                assert time.monotonic() - t0 < 1.0, f"a write to a dead peer took {time.monotonic() - t0:.2f} s"
                assert engine.last_error(peer.session)
        finally:
            peer.close()
            engine.close()

    @pytest.mark.slow  # the engine's own timeout is at least 5 s
    def test_a_stalled_peer_is_bounded_by_the_engine_timeout_and_the_next_call_reconnects(self, monkeypatch):
        """Over UCX's TCP transport (as between hosts) a stopped peer stops taking bytes: the call ends itself at
        the engine's timeout (-2), drops the connection, and once the peer runs again a new call goes through."""
        from dtkv.transfer import NixlEngine

        monkeypatch.setenv("UCX_TLS", "tcp,self")
        store = create_store(port=0, is_master=True, timeout_s=30)
        nbytes = 64 << 20  # more than the socket buffers hold
        peer, engine = _Peer(store, nbytes, env={"UCX_TLS": "tcp,self"}), NixlEngine(timeout_s=5)
        try:
            src = torch.ones(nbytes, dtype=torch.uint8)
            engine.register([src])
            engine.add_peer(
                Bootstrap(store, namespace="peer").agent("decode", 0, deadline=_deadline()), deadline=_deadline()
            )
            os.kill(peer.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            rc = engine.write(peer.session, [src.data_ptr()], [peer.addr], [nbytes])
            elapsed = time.monotonic() - t0
            assert rc == -2 and "timed out" in engine.last_error(peer.session)
            assert 5.0 <= elapsed < 5.0 + 2.0, f"the call ended after {elapsed:.2f} s"
            os.kill(peer.pid, signal.SIGCONT)
            assert engine.write(peer.session, [src.data_ptr()], [peer.addr], [nbytes]) == 0
            assert peer.checksum() == nbytes
        finally:
            peer.close()
            engine.close()


_QUIET = """
import torch
from dtkv.transfer import NixlEngine
from dtkv.transfer.protocol import deadline_after
a, b = NixlEngine(), NixlEngine()
src, dst = torch.ones(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
a.register([src]); b.register([dst])
a.add_peer(b.agent_record(), deadline=deadline_after(10))
assert a.write(b.session, [src.data_ptr()], [dst.data_ptr()], [64]) == 0 and int(dst.sum()) == 64
a.close(); b.close()
"""


def _run_quiet(level: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "NIXL_LOG_LEVEL"}
    if level is not None:
        env["NIXL_LOG_LEVEL"] = level
    return subprocess.run([sys.executable, "-c", _QUIET], capture_output=True, text=True, timeout=120, env=env)


def test_idle_engines_do_not_spin():
    """NIXL's wrapper starts each agent's UCX progress thread polling with a 0 timeout (a core per agent, which
    doubled the PD suite's time on 2 cores); the engine's agents wait for UCX events instead."""
    import resource

    a, b = _pair()
    try:
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        time.sleep(1.0)
        r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        busy = (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / (t1 - t0)
        assert busy < 0.25, f"two idle engines used {busy:.2f} of a core"
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("level", [None, "WARN"], ids=["default", "WARN"])
def test_a_successful_start_and_transfer_print_nothing(level):
    """NIXL prints an INFO line on stdout for every agent it starts (which would break ``demo --json``): by
    default dtkv asks for warnings only, and a start and a transfer that succeed print nothing at all."""
    out = _run_quiet(level)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == "" and out.stderr == "", (out.stdout, out.stderr)


def test_a_verbose_nixl_log_level_shows_nixls_log_again():
    out = _run_quiet("INFO")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "NIXL INFO" in out.stdout and "Initialized NIXL agent" in out.stdout


@pytest.mark.gpu  # (the NIXL wheel is not on the GPU image)
def test_cuda_tensors_register_as_vram_and_transfer():
    """CUDA pools: registered as VRAM_SEG with their device index; a write between two agents lands bitwise."""
    a, b = _pair()
    try:
        src = torch.arange(4096, dtype=torch.int32, device="cuda").view(torch.uint8)
        dst = torch.zeros(src.numel(), dtype=torch.uint8, device="cuda")
        a.register([src])
        b.register([dst])
        assert b.agent_record().region_device.tolist() == [torch.cuda.current_device()]
        a.add_peer(b.agent_record(), deadline=_deadline())
        assert a.write(b.session, [src.data_ptr()], [dst.data_ptr()], [src.numel()]) == 0, a.last_error(b.session)
        torch.cuda.synchronize()
        assert torch.equal(dst, src)
    finally:
        a.close()
        b.close()
