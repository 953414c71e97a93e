"""Nothing read from the rendezvous store runs code; values can be authenticated; the store listens where told;
replayed values never make prefill send (every decode party answers prefill's fresh nonce first).

Also pins what cannot be restricted from dtkv (Mooncake 0.3.13 listens on every interface and lets any peer that
reaches it write into registered regions; UCX under NIXL listens on every network device's address unless told
otherwise), so that ``docs/security.md`` stays true.
"""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import subprocess
import sys
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
    PrefillSender,
    SendStart,
    TransferError,
    create_store,
    mooncake_available,
)
from dtkv.transfer.messages import Aborted, Answer, Claim, Ready, SlotOpen
from dtkv.transfer.protocol import STARTED, AttemptKeys
from tests import _engines
from tests._transfer import StorePeer, non_loopback_addresses, reachable, same_pages, shards


class _Plant:
    """Unpickling this writes ``path``: what an attacker who reaches the store could plant."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path

    def __reduce__(self):
        return (pathlib.Path.write_text, (self.path, "code from the store ran"))


def _sides(store, *, secret=None, timeout_s=1.0, namespace="ns"):
    pre = shards(PageOwnership(2, 16), seed=0)
    dec = shards(PageOwnership(1, 16))
    sender = PrefillSender(
        pre, Bootstrap(store, namespace=namespace, secret=secret), engine=LocalEngine(), timeout_s=timeout_s
    )
    receiver = DecodeReceiver(
        dec, Bootstrap(store, namespace=namespace, secret=secret), engine=LocalEngine(), timeout_s=timeout_s
    )
    return sender, receiver, pre, dec


def _posted():
    """A decode side (connected, over a fresh store) that posted request ``"r"`` into pages 3 and 4: ``(store,
    receiver, decode shards, the attempt's keys for 2 prefill and 1 decode ranks)``."""
    store = dist.HashStore()
    _, receiver, _, dec = _sides(store)
    receiver.connect(1.0)
    receiver.post_request("r", [3, 4])
    req = receiver.bootstrap.try_get("req/r", DstRequest, deadline=float("inf"))
    return store, receiver, dec, AttemptKeys("r", req.epoch, 2, 1)


class TestNoCodeFromTheStore:
    def test_planted_pickle_never_runs_and_names_the_key(self, tmp_path):
        """A pickled object planted under every key a sender reads is refused as malformed, never unpickled."""
        probe = tmp_path / "probe"
        pickle.loads(pickle.dumps(_Plant(probe)))  # the payload is live: unpickling it does write a file
        assert probe.exists()
        marker = tmp_path / "marker"
        payload = pickle.dumps(_Plant(marker))
        store = dist.HashStore()
        sender, receiver, _, _ = _sides(store)
        for key in ("decode/0", "decode/size"):
            store.set(f"ns/{key}", payload)
        with pytest.raises(Exception) as info:  # noqa: B017 - the type is checked once the marker is
            sender.connect(timeout_s=1.0)
        assert not marker.exists(), "a value read from the store ran code"
        assert isinstance(info.value, TransferError)
        assert "malformed value under key ns/decode/0: value must start with b'DTKV'" in str(info.value)
        receiver.bootstrap.publish(receiver.endpoint(0), deadline=float("inf"))  # the genuine endpoint again
        for key in ("req/r", "req/r/dst"):
            store.set(f"ns/{key}", payload)
        with pytest.raises(Exception) as info:  # noqa: B017
            sender.send_request("r", [0, 1], timeout_s=1.0)
        assert not marker.exists(), "a value read from the store ran code"
        assert isinstance(info.value, TransferError)
        assert "malformed value under key ns/req/r: value must start with b'DTKV'" in str(info.value)

    def test_planted_start_is_refused_by_decode(self, tmp_path):
        marker = tmp_path / "marker"
        store, receiver, _, keys = _posted()
        store.set(f"ns/{keys.start(0)}", pickle.dumps(_Plant(marker)))
        store.add(f"ns/{keys.progress(0)}", STARTED)
        with pytest.raises(TransferError, match=rf"malformed value under key ns/{keys.start(0)}"):
            receiver.wait_request("r", timeout_s=1.0)
        assert not marker.exists()

    def test_rejects_out_of_range_values_from_a_sender(self):
        """A well-formed start whose copies leave decode's staging buffer is refused before any copy runs."""
        store, receiver, dec, keys = _posted()
        from dtkv.transfer import StageCopy

        bad = SendStart(
            rank=0,
            positions=np.array([0]),
            layer_bounds=np.array([0, 2]),
            unpack={0: (StageCopy(name="kv", offset=0, local_pages=np.array([10**6])),)},
        )
        receiver.bootstrap.set(keys.start(0), bad, deadline=float("inf"))
        store.add(f"ns/{keys.progress(0)}", STARTED)
        before = [b.clone() for b in dec[0].buffers.values()]
        with pytest.raises(TransferError, match=r"copy local pages must be in \[0, 16\)"):
            receiver.wait_request("r", timeout_s=1.0)
        assert all(torch.equal(a, b) for a, b in zip(before, dec[0].buffers.values()))


class TestSharedSecret:
    def test_round_trip_with_a_secret(self):
        sender, receiver, pre, dec = _sides(dist.HashStore(), secret="s3cret")
        receiver.post_request("r", [5, 9, 2])
        sender.send_request("r", [1, 2, 3])
        receiver.wait_request("r")
        assert same_pages(pre, [1, 2, 3], dec, [5, 9, 2])

    @pytest.mark.parametrize(
        "writer_secret,match",
        [
            (None, r"value must be signed \(DTKV_TRANSFER_SECRET is set\), got an unsigned value"),
            (b"other", r"value's HMAC does not verify"),
        ],
        ids=["unsigned", "forged"],
    )
    def test_rejects_unsigned_and_forged_values(self, writer_secret, match):
        store = dist.HashStore()
        sender, _, _, _ = _sides(store, secret=b"k")
        forger = Bootstrap(store, namespace="ns", secret=writer_secret)
        dec = shards(PageOwnership(1, 16))[0]
        forger.publish(dec.endpoint("decode", "attacker:1"), deadline=float("inf"))
        with pytest.raises(TransferError, match=rf"malformed value under key ns/decode/0: {match}"):
            sender.connect(timeout_s=1.0)

    def test_rejects_a_value_moved_to_another_key(self):
        store = dist.HashStore()
        sender, receiver, _, _ = _sides(store, secret=b"k")
        store.set("ns/decode/0", store.get("ns/prefill/1"))  # a genuine value, replayed under another key
        with pytest.raises(TransferError, match=r"ns/decode/0: value's HMAC does not verify"):
            sender.connect(timeout_s=1.0)

    def test_signed_values_need_the_secret_on_both_sides(self):
        store = dist.HashStore()
        sender, _, _, _ = _sides(store, secret=b"k")
        plain = Bootstrap(store, namespace="ns", secret=None)
        with pytest.raises(TransferError, match=r"value is signed but no DTKV_TRANSFER_SECRET is set here"):
            plain.endpoints("prefill", deadline=float("inf"))


class _FailingLink(LocalEngine):
    """A LocalEngine whose writes fail (return -1, copying nothing) while ``failing`` is set."""

    failing = False

    def write(self, peer, src, dst, length):
        return -1 if self.failing else super().write(peer, src, dst, length)


class _LateAnswerPoll:
    """A link to the store whose ``nth`` poll for claim answers waits ``delay_s`` before reaching the store (a poll
    checks for all of its answers at once first)."""

    def __init__(self, inner, nth: int, delay_s: float) -> None:
        self._inner, self._nth, self._delay_s, self._seen = inner, nth, delay_s, 0

    @classmethod
    def install(cls, bootstrap, **kw) -> None:
        bootstrap.store = cls(bootstrap.store, **kw)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def check(self, keys):
        if len(keys) > 1 and all("/answer/" in k for k in keys):
            self._seen += 1
            if self._seen == self._nth:
                time.sleep(self._delay_s)
        return self._inner.check(keys)


def _swallow(fn, *args) -> None:
    try:
        fn(*args)
    except TransferError:
        pass


class TestFreshness:
    """Authenticity is not freshness: a store peer replays the signed values of request 1's failed attempt after
    its pages were reclaimed and reused by request 2. Prefill must not write request 1's KV over request 2's and
    must not report success."""

    @pytest.mark.parametrize(
        "cp_d,claimed,late_poll",
        [
            pytest.param(d, c, late, id=f"{d}-{'claimed-and-answered' if c else 'never-claimed'}{'-late-poll' * late}")
            for d, c, late in [(d, c, False) for c in (False, True) for d in (1, 2, 3)]
            + [(2, False, True), (2, True, True)]
        ],
    )
    def test_replayed_attempt_never_makes_prefill_send(self, cp_d, claimed, late_poll):
        """``late_poll``: the store is slow on the poll that runs into prefill's deadline (as on a loaded
        machine): the error still names the decode ranks that did not answer, not the store."""
        store = dist.HashStore()
        peer = StorePeer(store, "fr")
        pre = shards(PageOwnership(2, 40), seed=21)
        dec = shards(PageOwnership(cp_d, 30))
        engine_p = _FailingLink()
        sender = PrefillSender(pre, Bootstrap(store, namespace="fr", secret=b"k"), engine=engine_p, timeout_s=5)
        receivers = [  # one receiver (and store client) per decode rank
            DecodeReceiver(d, Bootstrap(store, namespace="fr", secret=b"k"), engine=LocalEngine(), timeout_s=5)
            for d in dec
        ]
        for side in (sender, *receivers):
            peer.install(side.bootstrap)
            side.connect()
        dst, src1, src2 = np.arange(2, 9), np.arange(0, 7), np.arange(20, 27)
        for r in receivers:  # request 1, attempt 1: fails
            r.post_request("r1", dst)
        if claimed:  # prefill claims it, every decode rank answers, then the engine fails
            engine_p.failing = True
            with pytest.raises(TransferError, match="engine write returned -1"):
                sender.send_request("r1", src1)
            engine_p.failing = False
        for r in receivers:
            with pytest.raises(TransferError):
                r.wait_request("r1", timeout_s=0.3 if not claimed else 5)
            assert [rid for rid, _ in r.reclaim(timeout_s=5)] == ["r1"]
        recorded = peer.replayable("req/r1")
        assert "req/r1" in recorded and any("/decode/" in k for k in recorded)
        assert claimed == any("/answer/" in k for k in recorded)
        for r in receivers:  # request 2 reuses the pages
            r.post_request("r2", dst)
        sender.send_request("r2", src2)
        for r in receivers:
            r.wait_request("r2")
        assert same_pages(pre, src2, dec, dst)
        peer.replay(recorded, last="req/r1")  # the epoch pointer, OPEN and READY slots (and answers) of attempt 1
        mark = peer.mark()
        if late_poll:
            _LateAnswerPoll.install(sender.bootstrap, nth=2, delay_s=1.3)
        with pytest.raises(TransferError, match=r"decode ranks \[.*\] did not answer"):
            sender.send_request("r1", src1, timeout_s=1.0)
        assert same_pages(pre, src2, dec, dst), "a replayed attempt made prefill write request 1 over request 2"
        written = peer.written_since(mark)
        assert not [k for k in written if "/start/" in k or "/answer/" in k], f"wrote to a replayed attempt: {written}"

    def test_replayed_open_slot_never_ends_a_quarantine_early(self):
        """The peer writes a prefill slot's OPEN back over the claim while that rank's engine call is in flight, so
        decode's abort closes the slot as if nobody had claimed it. Decode answered the claim, so it still holds
        the pages for that sender (until its grace period ends: the sender no longer finds its claim, so it reports
        nothing): the late bytes land before the pages are handed back."""
        landed = threading.Event()
        started = threading.Event()

        class Slow(LocalEngine):
            def write(self, peer, src, dst, length):
                started.set()
                time.sleep(1.5)
                rc = super().write(peer, src, dst, length)
                landed.set()
                return rc

        store = dist.HashStore()
        peer = StorePeer(store, "ro")
        pre = shards(PageOwnership(1, 16), seed=23)
        dec = shards(PageOwnership(1, 16))
        sender = PrefillSender(pre, Bootstrap(store, namespace="ro", secret=b"k"), engine=Slow(), timeout_s=2.5)
        receiver = DecodeReceiver(dec, Bootstrap(store, namespace="ro", secret=b"k"), engine=LocalEngine(), timeout_s=5)
        for side in (sender, receiver):
            peer.install(side.bootstrap)
            side.connect()
        receiver.post_request("A", [3, 4])
        sending = threading.Thread(target=lambda: _swallow(sender.send_request, "A", [1, 2]))
        sending.start()
        assert started.wait(5), "the sender never started its engine call"
        slots = {k: v for k, v in peer.replayable("req/A").items() if "/prefill/" in k}
        peer.replay(slots)  # OPEN again over the claim of the rank whose call is in flight
        with pytest.raises(TransferError):
            receiver.wait_request("A", timeout_s=0.1)
        assert "A" in receiver.quarantined and receiver.reclaim() == []
        assert [rid for rid, _ in receiver.reclaim(timeout_s=10)] == ["A"]
        assert landed.is_set(), "A's pages were handed back while its sender's engine call still ran"
        sending.join(10)

    def test_without_the_secret_a_store_peer_can_redirect_a_transfer(self):
        """Pins the README: without ``DTKV_TRANSFER_SECRET`` nothing is authenticated, so a store peer can answer
        prefill's nonce itself and send request 1's KV into request 2's pages. The secret is what stops it."""

        store = dist.HashStore()
        peer = StorePeer(store, "nf")
        sender, receiver, pre, dec = _sides(store, namespace="nf", timeout_s=5)
        for side in (sender, receiver):
            peer.install(side.bootstrap)
            side.connect()
        dst, src1, src2 = np.arange(2, 6), np.arange(0, 4), np.arange(10, 14)
        receiver.post_request("r1", dst)
        with pytest.raises(TransferError):
            receiver.wait_request("r1", timeout_s=0.2)
        receiver.reclaim(timeout_s=5)
        recorded = peer.replayable("req/r1")
        receiver.post_request("r2", dst)
        sender.send_request("r2", src2)
        receiver.wait_request("r2")
        peer.replay(recorded, last="req/r1")
        req = sender.bootstrap.try_get("req/r1", DstRequest, deadline=float("inf"))
        keys = AttemptKeys("r1", req.epoch, 2, 1)

        def forge_answers() -> None:  # read each claim's nonce (values are not secret) and answer it
            for _ in range(2500):
                slots = [keys.slot("prefill", r) for r in range(2)]
                msgs = [sender.bootstrap.decode(k, store.get(f"nf/{k}"), Claim, SlotOpen, Aborted) for k in slots]
                if all(isinstance(m, Claim) for m in msgs):
                    break
                time.sleep(0.002)
            ready = sender.bootstrap.decode(keys.slot("decode", 0), store.get(f"nf/{keys.slot('decode', 0)}"), Ready)
            for r, m in enumerate(msgs):
                key = keys.answer(r, 0)
                answer = Answer(
                    epoch=req.epoch,
                    prefill_rank=r,
                    decode_rank=0,
                    nonce=m.nonce,
                    incarnation=ready.incarnation,
                    staging=ready.staging,
                )
                store.set(f"nf/{key}", receiver.bootstrap.encode(key, answer))

        forger = threading.Thread(target=forge_answers)
        forger.start()
        sender.send_request("r1", src1)  # the redirected transfer "succeeds"
        forger.join(10)
        assert same_pages(pre, src1, dec, dst), "the forged answers did not redirect the transfer (README is stale)"


class TestListening:
    def test_store_for_loopback_listens_on_loopback_only(self):
        store = create_store("127.0.0.1", port=0, is_master=True, timeout_s=5)
        client = create_store("127.0.0.1", port=store.port, is_master=False, timeout_s=5)
        client.set("k", b"v")
        assert store.get("k") == b"v"
        others = non_loopback_addresses()
        if not others:
            pytest.skip("this machine has no non-loopback address to probe")
        for addr in others:
            assert not reachable(addr, store.port), f"the store for 127.0.0.1 answers on {addr}:{store.port}"

    def test_store_can_be_asked_to_listen_everywhere(self):
        others = non_loopback_addresses()
        if not others:
            pytest.skip("this machine has no non-loopback address to probe")
        store = create_store("0.0.0.0", port=0, is_master=True, timeout_s=5)
        assert reachable(others[0], store.port)

    @pytest.mark.mooncake
    @pytest.mark.skipif(not mooncake_available()[0], reason="Mooncake transfer engine unavailable")
    def test_mooncake_exposure_is_as_documented(self):
        """Pins the README: an engine made for 127.0.0.1 still answers on other addresses, and a peer that
        reaches it can write into its registered regions (dtkv cannot restrict this; deploy behind a firewall)."""
        from dtkv.transfer import MooncakeEngine

        others = non_loopback_addresses()
        if not others:
            pytest.skip("this machine has no non-loopback address to probe")
        victim, peer = MooncakeEngine(), MooncakeEngine()
        try:
            pool = torch.zeros(4096, dtype=torch.uint8)
            victim.register([pool])
            src = torch.full((64,), 7, dtype=torch.uint8)
            peer.register([src])
            port = int(victim.session.rsplit(":", 1)[1])
            assert reachable(others[0], port), "Mooncake's handshake port no longer listens on every interface"
            session = f"{others[0]}:{port}"
            assert peer.write(session, [src.data_ptr()], [pool.data_ptr() + 128], [64]) == 0
            assert int(pool[128:192].sum()) == 7 * 64 and int(pool[:128].sum()) == 0
        finally:
            victim.close()
            peer.close()


_LISTENING = """
import json, os, socket, sys, torch

def listening():
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/net/{name}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                    continue
                hexaddr, hexport = cols[1].split(":")
                raw = bytes.fromhex(hexaddr)
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # /proc's host-order words
                out.append([socket.inet_ntop(family, raw), int(hexport, 16)])
    return sorted(out)
"""

_LISTENERS = (
    _LISTENING
    + """
from dtkv.transfer import NixlEngine
from dtkv.transfer.protocol import deadline_after
before = listening()
victim, peer = NixlEngine(), NixlEngine()
pool, src = torch.zeros(4096, dtype=torch.uint8), torch.full((64,), 7, dtype=torch.uint8)
victim.register([pool])
peer.register([src])
opened = [x for x in listening() if x not in before]
peer.add_peer(victim.agent_record(), deadline=deadline_after(10))  # all a peer needs: the record
rc = peer.write(victim.session, [src.data_ptr()], [pool.data_ptr() + 128], [64])
print(json.dumps({"opened": opened, "rc": rc, "landed": int(pool[128:192].sum()), "outside": int(pool[:128].sum())}))
victim.close(); peer.close()
"""
)

_PD_LISTENERS = (
    _LISTENING
    + """
import numpy as np
from dtkv import PageOwnership
from dtkv.transfer import Bootstrap, DecodeReceiver, PrefillSender, create_store
from tests._transfer import same_pages, shards
before = listening()
store = create_store("127.0.0.1", port=0, is_master=True, timeout_s=30)
pre, dec = shards(PageOwnership(2, 16), seed=1), shards(PageOwnership(1, 16))
sender = PrefillSender(pre, Bootstrap(store, namespace="pd"), engine="nixl", timeout_s=10)
receiver = DecodeReceiver(dec, Bootstrap(store, namespace="pd"), engine="nixl", timeout_s=10)
receiver.connect(30)
sender.connect(30)
src, dst = np.arange(2, 13), np.arange(15, 4, -1)
receiver.post_request("r", dst)
sender.send_request("r", src)
receiver.wait_request("r")
opened = [x for x in listening() if x not in before]
print(json.dumps({"opened": opened, "store": store.port, "ok": bool(same_pages(pre, src, dec, dst))}))
sender.close(); receiver.close()
"""
)


def _nixl_listeners(script: str = _LISTENERS, **env) -> dict:
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **env}, cwd=pathlib.Path(__file__).parents[1])  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.nixl
@pytest.mark.skipif(not _engines.NIXL_OK, reason=f"NIXL transfer engine unavailable: {_engines.NIXL_WHY}")
def test_nixl_exposure_is_as_documented():
    """Pins docs/security.md: two NIXL agents open no NIXL listener (no metadata port) and no wildcard socket, only
    UCX's TCP data-path listeners, one per network device address; ``UCX_NET_DEVICES=lo`` with
    ``UCX_TCP_PORT_RANGE`` leaves loopback listeners in that range only; and any peer holding an agent's record
    writes into its registered regions with no further authentication (deploy behind a firewall)."""
    from nixl._api import DEFAULT_COMM_PORT

    res = _nixl_listeners()
    assert res["rc"] == 0 and res["landed"] == 7 * 64 and res["outside"] == 0
    addrs = {a for a, _ in res["opened"]}
    assert res["opened"] and not addrs & {"0.0.0.0", "::"}, f"a listener binds every interface: {res['opened']}"
    assert addrs <= {"127.0.0.1", "::1", *non_loopback_addresses()}, res["opened"]
    assert DEFAULT_COMM_PORT not in {p for _, p in res["opened"]}, "NIXL's own listener is open"
    narrowed = _nixl_listeners(UCX_NET_DEVICES="lo", UCX_TCP_PORT_RANGE="47300-47399")
    assert narrowed["rc"] == 0 and narrowed["landed"] == 7 * 64
    assert narrowed["opened"] and all(a == "127.0.0.1" and 47300 <= p <= 47399 for a, p in narrowed["opened"]), (
        narrowed["opened"]
    )
    assert len(narrowed["opened"]) == 2, f"one per engine (its UCX worker) on lo: {narrowed['opened']}"


@pytest.mark.nixl
@pytest.mark.skipif(not _engines.NIXL_OK, reason=f"NIXL transfer engine unavailable: {_engines.NIXL_WHY}")
def test_a_pd_handoff_on_nixl_listens_on_the_store_and_ucx_workers_only():
    """A whole hand-off (two prefill ranks to a decode rank, both sides on ``engine="nixl"`` in one process, the
    records through a loopback store) opens the store's listener and, per engine, the one TCP listener of its UCX
    worker on each device of ``UCX_NET_DEVICES``: nothing else, no NIXL port (the listing in
    ``docs/security.md``)."""
    from nixl._api import DEFAULT_COMM_PORT

    res = _nixl_listeners(_PD_LISTENERS, UCX_NET_DEVICES="lo", UCX_TCP_PORT_RANGE="47400-47499")
    assert res["ok"], "decode's pages differ from prefill's"
    ucx = [x for x in res["opened"] if x != ["127.0.0.1", res["store"]]]
    assert len(ucx) == len(res["opened"]) - 1, f"the store does not listen on 127.0.0.1: {res['opened']}"
    assert len(ucx) == 2 and all(a == "127.0.0.1" and 47400 <= p <= 47499 for a, p in ucx), ucx
    assert DEFAULT_COMM_PORT not in {p for _, p in res["opened"]}, "NIXL's own listener is open"
