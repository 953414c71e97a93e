"""Real engines over loopback (Mooncake TCP, NIXL/UCX): gloo prefill CP ranks with sharded KV send to a spawned
decode process; each test runs once per engine (``transfer_engine``).

The pytest process hosts the rendezvous ``TCPStore`` on 127.0.0.1; the prefill ranks (``ranks2``/``ranks4``)
and the decode daemon each run an engine of the test's kind. Pools are filled from one seeded global reference
(the replicated baseline), so decode's reconstructed pages must equal it bit for bit.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import uuid

import numpy as np
import pytest
import torch

from dtkv import IndexerFp8Layout, MLAFp8Layout, PageOwnership
from tests import _engines

pytestmark = [pytest.mark.multirank]

LAYERS = 4
PAGE_SIZE = 16
P_PREFILL = 64
P_DECODE = 57
TIMEOUT_S = 10.0
CONNECT_S = 120.0
"""The rendezvous's deadline: every process starting its engine can take longer than a transfer's deadline on a busy
machine (and a torch import on the oldest torch tested); the transfers keep ``TIMEOUT_S``."""


def _layouts():
    return {
        "kv": MLAFp8Layout(page_size=PAGE_SIZE, kv_lora_rank=64, rope_dim=16, quant_block=32),
        "index": IndexerFp8Layout(page_size=PAGE_SIZE, head_dim=32),
    }


def _reference(num_pages, num_layers=LAYERS, seed=1234):
    """The replicated baseline: every buffer's global pool as bytes ``[num_layers, num_pages, page_bytes]``."""
    g = torch.Generator().manual_seed(seed)
    return {
        n: torch.randint(0, 256, (num_layers, num_pages, lay.page_bytes), generator=g, dtype=torch.uint8)
        for n, lay in _layouts().items()
    }


def _request(num_pages):
    rng = np.random.default_rng(7)
    src = np.sort(rng.permutation(P_PREFILL)[:num_pages])
    dst = rng.permutation(P_DECODE)[:num_pages]
    dst[: num_pages // 2] = np.sort(dst[: num_pages // 2])
    return src, dst


_ENGINES: dict = {}


def _engine(kind):
    """One engine of each kind per rank process, reused across tests (destroying a Mooncake one is ~1 s)."""
    if kind not in _ENGINES:
        _ENGINES[kind] = _engines.make(kind, timeout_s=TIMEOUT_S)
    return _ENGINES[kind]


def _prefill_rank(rank, world, kind, port, namespace, num_pages, staging_bytes, num_layers=LAYERS):
    import torch.distributed as dist

    from dtkv import ShardedKVPool
    from dtkv.transfer import Bootstrap, KVShard, PrefillSender, create_store

    pool = ShardedKVPool(_layouts(), PageOwnership(world, P_PREFILL), num_layers=num_layers, group=dist.group.WORLD)
    ref = _reference(P_PREFILL, num_layers)
    local = pool.ownership.local_pages(rank)
    for n in pool.layouts:
        pool.buffer(n).view(torch.uint8).view(num_layers, local.numel(), -1).copy_(ref[n][:, local])
    before = {n: pool.buffer(n).clone() for n in pool.layouts}
    boot = Bootstrap(create_store(port=port, is_master=False), namespace=namespace)
    shard = KVShard.from_pool(pool, staging_bytes=staging_bytes, meta_num_rows=1, meta_row_bytes=16)
    sender = PrefillSender(shard, boot, engine=_engine(kind), timeout_s=TIMEOUT_S)
    src, _ = _request(num_pages)
    t0 = None
    try:
        sender.connect(CONNECT_S)
        t0 = time.monotonic()  # the transfer's deadline counts from here
        report = sender.send_request("req-0", src, meta=b"hello" if rank == 0 else None)
        error = None
    except Exception as e:  # noqa: BLE001 - the fault test inspects it
        report, error = None, e
    elapsed = 0.0 if t0 is None else time.monotonic() - t0
    intact = all(torch.equal(before[n], pool.buffer(n)) for n in pool.layouts)
    sender.close()
    return {"report": report, "error": error, "elapsed": elapsed, "intact": intact}


def _decode_main(conn, kind, port, namespace, cp_d, layout_d, num_pages, staging_bytes, die_mid_transfer, num_layers):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    from dtkv import ShardedKVPool
    from dtkv.transfer import Bootstrap, DecodeReceiver, KVShard, create_store

    own = PageOwnership(cp_d, P_DECODE, layout_d)
    kw = dict(staging_bytes=staging_bytes, meta_num_rows=2, meta_row_bytes=16)
    if cp_d == 1:  # a non-CP decode: a plain pool holding the full layout
        shards = [KVShard.from_pool(ShardedKVPool(_layouts(), own, num_layers=num_layers), **kw)]
    else:  # a CP decode simulated as cp_d local ranks in one process
        shards = [KVShard.allocate(_layouts(), own, d, num_layers=num_layers, **kw) for d in range(cp_d)]
    boot = Bootstrap(create_store(port=port, is_master=False), namespace=namespace)
    receiver = DecodeReceiver(shards, boot, engine=kind, timeout_s=TIMEOUT_S)
    conn.send(("started",))  # torch imported, the engine up: the prefill side's deadlines may start now
    receiver.connect(CONNECT_S)
    conn.send(("ready",))
    _, dst = _request(num_pages)
    if die_mid_transfer:
        receiver.post_request("req-0", dst)
        deadline = time.monotonic() + TIMEOUT_S
        while not any(bool(b.any()) for s in shards for b in s.buffers.values()) and time.monotonic() < deadline:
            time.sleep(0.0005)
        os.kill(os.getpid(), signal.SIGKILL)  # the first bytes arrived: die mid-transfer
    report = receiver.receive_request("req-0", dst, num_tokens=num_pages * PAGE_SIZE - 5, dst_meta_slot=1)
    pages = {}
    for n in _layouts():
        full = torch.empty(num_layers, P_DECODE, _layouts()[n].page_bytes, dtype=torch.uint8)
        for s in shards:
            idx = own.local_pages(s.rank)
            full[:, idx] = s.buffers[n].view(torch.uint8).view(num_layers, idx.numel(), -1)
        pages[n] = full[:, torch.from_numpy(dst)].clone()
    meta = [bytes(s.meta[1, :5].tolist()) for s in shards]
    conn.send(("done", pages, meta, report))
    conn.recv()  # the parent kills us when it is done


@pytest.fixture
def store():
    from dtkv.transfer import create_store

    s = create_store(port=0, is_master=True, timeout_s=TIMEOUT_S)
    yield s


def _start_decode(kind, store, namespace, *, cp_d=1, layout_d="interleave", num_pages=45, staging_bytes=1 << 20,
                  die=False, num_layers=LAYERS):  # fmt: skip
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    args = (child, kind, store.port, namespace, cp_d, layout_d, num_pages, staging_bytes, die, num_layers)
    proc = ctx.Process(target=_decode_main, args=args, daemon=True)
    proc.start()
    try:  # a process importing torch can take longer than a transfer deadline on a busy machine: wait it out first
        assert _recv(parent, proc) == ("started",)
    except BaseException:
        proc.kill()
        raise
    return proc, parent


def _recv(conn, proc, timeout_s=60.0):
    if not conn.poll(timeout_s):
        proc.kill()
        raise TimeoutError(f"decode process did not answer within {timeout_s} s (exit code {proc.exitcode})")
    return conn.recv()


CASES = [
    (2, 1, "interleave", 1 << 20),
    (2, 1, "interleave", 0),
    (2, 3, "block", 1 << 20),
    (4, 1, "interleave", 1 << 20),
    (4, 1, "interleave", 0),
]


@pytest.mark.parametrize(
    "world,cp_d,layout_d,staging_bytes",
    CASES,
    ids=[f"world{w}-{'full' if c == 1 else f'cp{c}-{lay}'}-{'staged' if s else 'direct'}" for w, c, lay, s in CASES],
)
def test_cp_prefill_to_decode_bitwise(ranks2, ranks4, world, cp_d, layout_d, staging_bytes, store, transfer_engine):
    """2 and 4 gloo prefill ranks send owned pages only; decode's pages equal the replicated baseline."""
    ranks = ranks2 if world == 2 else ranks4
    namespace = uuid.uuid4().hex
    num_pages = 45
    proc, conn = _start_decode(
        transfer_engine, store, namespace, cp_d=cp_d, layout_d=layout_d, staging_bytes=staging_bytes
    )
    try:
        results = ranks.run(_prefill_rank, transfer_engine, store.port, namespace, num_pages, staging_bytes)
        msg = _recv(conn, proc)
        if msg[0] == "ready":
            msg = _recv(conn, proc)
        _, pages, meta, report = msg
    finally:
        proc.kill()
    src, _ = _request(num_pages)
    ref = _reference(P_PREFILL)
    for n in ref:
        assert torch.equal(pages[n], ref[n][:, torch.from_numpy(src)]), f"buffer {n!r} differs from the baseline"
    assert meta == [b"hello"] * cp_d  # the replicated row: one sender, every decode rank
    sent = [r["report"] for r in results]
    assert sum(s.num_positions for s in sent) == num_pages == report.num_positions
    assert report.num_entries == sum(s.num_entries for s in sent) >= report.min_entries
    assert all(r["intact"] for r in results)


def test_decode_killed_mid_transfer(ranks2, store, transfer_engine):
    """Decode dies after the first bytes land: every prefill rank raises TransferError in time, pools intact."""
    namespace = uuid.uuid4().hex
    num_pages, num_layers = 50, 96  # strided pages, no staging: 25 x 96 x 2 = 4800 entries per rank, 5 calls
    proc, conn = _start_decode(
        transfer_engine, store, namespace, num_pages=num_pages, staging_bytes=0, die=True, num_layers=num_layers
    )
    try:
        results = ranks2.run(
            _prefill_rank, transfer_engine, store.port, namespace, num_pages, 0, num_layers, return_exceptions=True
        )
    finally:
        proc.kill()
    from dtkv.transfer import TransferError

    for r, res in enumerate(results):
        assert isinstance(res, dict), f"rank {r} crashed: {res!r}"
        err = res["error"]
        assert isinstance(err, TransferError), f"rank {r} must raise TransferError, got {err!r}"
        assert err.request_id == "req-0" and err.peer.startswith(
            f"decode rank 0 at {_engines.session_prefix(transfer_engine)}"
        )
        assert err.pages.size > 0
        assert res["elapsed"] < TIMEOUT_S + 2, f"rank {r} took {res['elapsed']:.1f} s"
        assert res["intact"], f"rank {r}'s pool changed"
