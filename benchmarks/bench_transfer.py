"""PD transfer of a 32K-token request over loopback (Mooncake TCP or NIXL/UCX), against one contiguous transfer of
its bytes; and the engines side by side on raw entry shapes.

Run ``python benchmarks/bench_transfer.py`` (``--engine mooncake|nixl``, ``--layers``, ``--tokens``, ``--reps``;
``--json PATH`` writes the rows). The prefill side runs in this process: ``cp_p`` prefill ranks (one :class:`dtkv.transfer.KVShard` each,
sharing one engine, sending one after the other) hold the request's pages, interleaved, in the real
DeepSeek-V3.2 geometry (page 64: fp8 MLA 41 984 B + fp8 indexer 8 448 B per page and layer). A spawned decode
process hosts ``cp_d`` ranks, a decode pool of pages allocated contiguously or fragmented (shuffled runs of 1-8
pages), and a staging buffer.

Per scenario, one verified warm-up and ``--reps`` timed repetitions, each timing back to back:

- ``ceiling``: one ``batch_transfer_sync_write`` entry of the same byte count between two registered regions of
  the same two engines, timed right before the transfer (the transport's ceiling on this machine).
- ``e2e``: prefill ``send_request`` (plan + staging pack + every engine call, each returning only once decode
  acknowledged the bytes) plus decode's staging unpack left after the last sender finished (``tail``; with
  ``--layer-groups`` > 1 the other layer groups are packed and unpacked while later groups are in flight).
  Store polling between the two sides is excluded (protocol latency, not transfer) but shows in ``wall``
  (decode done - prefill start).
- ``best`` = best ceiling time / best e2e time; ``median`` = median of the per-repetition ratios (robust to
  other load on the machine). The target is >= 0.8 with ``staging=auto``.

The warm-up of every scenario is verified: decode hashes its pages in position order and compares with
the prefill side's hash of the same logical pages.

``--engines mooncake,nixl`` compares the engines on the same bytes instead, in one run (module
:func:`run_engines`): for each request size (``--sizes`` tokens, fragmented decode pages) and each pool layout of
``--layouts`` (``layer_major``: ``[num_layers, pages, ...]`` on both sides; ``page_major``: ``[pages, num_layers,
...]`` on both sides, ``ShardedKVPool(page_major=True)``) three entry shapes, each sent with
:func:`dtkv.transfer.send_entries` exactly as a prefill rank sends (calls of at most 1024 entries, one in flight per
peer) from this process to a spawned decode process of the same engine:

- ``per_page``: one entry per page and buffer, and per layer where the layout splits a page's layers (layer-major;
  unit runs through :func:`dtkv.transfer.expand_runs`, no coalescing);
- ``coalesced``: the entries dtkv's planner emits for it and the layout (``plan_request``, staging off, one layer
  group): one per run of pages and layer when layer-major, one per run of pages when page-major;
- ``contiguous``: one entry of the same bytes between two registered regions (timed with each layout's shapes).

Rows (``--jsonl PATH``): ``engine``, ``layout``, ``shape``, ``bytes``, ``entries``, ``gb_s`` (1e9 bytes/s, the
median of ``--reps`` timed repetitions, engines, layouts and shapes interleaved), ``vs_contiguous`` (this shape's
GB/s over the same engine's contiguous GB/s of the same bytes: the median over repetitions of the ratio of the two,
timed back to back in each repetition, so that the machine's load changes both alike; ``vs_contiguous_of_medians`` is
the ratio of the medians), ``cpu_ms`` (this process's CPU time per send, every thread: with NIXL within a host, the copies
themselves) and ``vs_contiguous_cpu`` (the same ratio in CPU time: the work, whatever else runs on the machine),
plus ``tokens``, ``layers``, ``calls``, ``gb_s_best`` and
``verified`` (decode's bytes equal the sources', checked on the warm-up of every shape). With ``--planned``, also
the rows ``planned <scenario>`` (layer-major pools): dtkv's own send of the largest request through the protocol, default policy
(coalescing, staging ``auto``, 4 layer groups; the scenario rows above), ``gb_s`` from its median e2e time and
``vs_contiguous`` the median of its ratios to the contiguous ceiling timed back to back. ``--nixl-sweep`` measures
NIXL's knobs instead, one at a time away from the defaults (:data:`SWEEP`: entries per call, descriptors per
request, requests in flight) on the per-page, coalesced and contiguous shapes, each as the median of its
per-repetition ratios to the defaults' time (``vs_default``; in CPU time ``vs_default_cpu``): the measurement
behind ``BATCH_ENTRIES`` and ``INFLIGHT_PER_PEER`` in ``dtkv/transfer/_nixl.py``.

``--device cuda`` (or ``cpu``) measures the hand-off of pools on a device instead (``HandoffSender`` /
``HandoffReceiver``: CUDA pools through pinned host memory on Mooncake's non-cuda wheel) against a device-to-device
copy of the same bytes, into ``<out>/transfer_<hw>_<date>.jsonl`` (``benchmarks/_transfer_device.py``; ``--smoke``
for a small CPU check, ``--stage always`` to force the host window where the engine could register the pools).

``--protocol`` measures the protocol's own cost instead: one-page requests on the in-process
:class:`dtkv.transfer.LocalEngine`, one thread doing post -> send -> wait, over an in-process ``HashStore`` and over
a loopback ``TCPStore`` (one client per side and rank, as deployed). Per request it reports the fastest, median and
mean milliseconds and the store calls (each one round trip on a ``TCPStore``) issued by the prefill side and by the
decode side, background ones included.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import multiprocessing as mp
import os
import platform
import time
import uuid
from dataclasses import asdict, dataclass

import numpy as np
import torch

from dtkv import IndexerFp8Layout, MLAFp8Layout, PageOwnership
from dtkv._log import phase, setup_cli_logging
from dtkv.transfer import (
    Bootstrap,
    DecodeReceiver,
    KVShard,
    LocalEngine,
    PeerEntries,
    PlanOptions,
    PrefillSender,
    apply_mooncake_env,
    create_engine,
    create_store,
    expand_runs,
    plan_request,
    send_entries,
)

PAGE_SIZE = 64
LAYOUTS = {"index": IndexerFp8Layout(page_size=PAGE_SIZE), "kv": MLAFp8Layout(page_size=PAGE_SIZE)}


@dataclass(frozen=True, kw_only=True, slots=True)
class Scenario:
    cp_p: int
    """Prefill CP ranks (interleave ownership)."""
    cp_d: int
    """Decode ranks (1: non-CP decode holding the full layout)."""
    layout_d: str
    """Decode ownership layout."""
    alloc: str
    """Decode page allocation: ``contiguous`` or ``fragmented``."""
    staging: str
    """Planner staging policy (``off``, ``auto``)."""
    groups: int = 1
    """Pipeline layer groups (``PlanOptions.layer_groups``)."""

    @property
    def name(self) -> str:
        dec = "full" if self.cp_d == 1 else f"cp{self.cp_d}-{self.layout_d}"
        return f"p{self.cp_p}->{dec} {self.alloc}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Result:
    scenario: str
    staging: str
    entries: int
    min_entries: int
    calls: int
    mib: float
    e2e_ms: float
    wall_ms: float
    plan_ms: float
    pack_ms: float
    unpack_ms: float
    tail_ms: float
    ceiling_ms: float
    gib_s: float
    ceiling_gib_s: float
    ratio_best: float
    """Best ceiling time / best e2e time."""
    ratio_median: float
    """Median over repetitions of (ceiling time / e2e time), each pair timed back to back."""
    verified: bool
    e2e_ms_median: float = 0.0


def _pages(num_pages_req: int, pool_pages: int, alloc: str, seed: int) -> np.ndarray:
    if alloc == "contiguous":
        return np.arange(8, 8 + num_pages_req)
    rng = np.random.default_rng(seed)  # shuffled runs of 1..8 pages: a decode pool in steady state
    starts = rng.permutation(pool_pages // 8) * 8
    runs = [np.arange(s, s + rng.integers(1, 9)) for s in starts]
    pages = np.concatenate(runs)
    if pages.shape[0] < num_pages_req:
        raise ValueError(f"a pool of {pool_pages} pages is too small for {num_pages_req} fragmented pages")
    return pages[:num_pages_req]


def _digest(shards: list[KVShard], ownership: PageOwnership, pages: np.ndarray) -> str:
    h = hashlib.blake2b(digest_size=16)
    owner = ownership.owner(torch.from_numpy(pages))
    local = ownership.local_index(torch.from_numpy(pages))
    by_rank = {s.rank: s for s in shards}
    for name in sorted(LAYOUTS):
        for i in range(pages.shape[0]):  # position order; one page per step (verification only)
            buf = by_rank[int(owner[i])].buffers[name]
            h.update(buf[:, int(local[i])].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------- decode
def _decode_main(conn, port: int, layers: int, pool_pages: int, kind: str = "mooncake") -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    engine = create_engine(kind)
    boot_store = create_store(port=port, is_master=False)
    receiver = None
    ceiling = None
    while True:
        cmd, *args = conn.recv()
        if cmd == "setup":
            sc, namespace, staging_bytes = args
            own = PageOwnership(sc["cp_d"], pool_pages, sc["layout_d"])
            shards = [
                KVShard.allocate(LAYOUTS, own, d, num_layers=layers, staging_bytes=staging_bytes)
                for d in range(sc["cp_d"])
            ]
            receiver = DecodeReceiver(shards, Bootstrap(boot_store, namespace=namespace), engine=engine)
            receiver.connect()
            conn.send(("ok",))
        elif cmd == "post":
            rid, dst, staging = args
            receiver.post_request(rid, dst, staging=staging)
            conn.send(("ok",))
        elif cmd == "wait":
            rid, dst, verify = args
            rep = receiver.wait_request(rid)
            done = time.monotonic()
            digest = _digest(list(receiver.shards.values()), receiver.shards[0].ownership, dst) if verify else ""
            conn.send((rep, done, digest))
        elif cmd == "ceiling":
            ceiling = torch.empty(args[0], dtype=torch.uint8)
            engine.register([ceiling])
            conn.send((engine.session, ceiling.data_ptr(), engine.agent_record()))
        elif cmd == "teardown":
            receiver.close()
            if ceiling is not None:
                engine.unregister([ceiling])
            receiver = ceiling = None
            conn.send(("ok",))
        elif cmd == "exit":
            engine.close()
            return


def _ask(conn, *msg, timeout_s: float = 300.0):
    conn.send(msg)
    if not conn.poll(timeout_s):
        raise TimeoutError(f"decode did not answer {msg[0]!r} within {timeout_s} s")
    return conn.recv()


# ---------------------------------------------------------------------------------------------------- prefill
def run(args: argparse.Namespace) -> list[Result]:
    apply_mooncake_env()
    torch.set_num_threads(1)
    n_req = -(-args.tokens // PAGE_SIZE)
    pool_pages = 2 * n_req + 64  # room for the fragmented allocation
    store = create_store(port=0, is_master=True)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_decode_main, args=(child, store.port, args.layers, pool_pages, args.engine), daemon=True)
    proc.start()
    engine = create_engine(args.engine)
    g = torch.Generator().manual_seed(0)
    base = [
        Scenario(cp_p=1, cp_d=1, layout_d="interleave", alloc="contiguous", staging="auto"),
        Scenario(cp_p=1, cp_d=1, layout_d="interleave", alloc="fragmented", staging="auto"),
        Scenario(cp_p=2, cp_d=1, layout_d="interleave", alloc="contiguous", staging="auto"),
        Scenario(cp_p=4, cp_d=1, layout_d="interleave", alloc="fragmented", staging="auto"),
        Scenario(cp_p=2, cp_d=2, layout_d="interleave", alloc="contiguous", staging="auto"),
        Scenario(cp_p=4, cp_d=2, layout_d="block", alloc="fragmented", staging="auto"),
    ]
    scenarios = [Scenario(**{**asdict(s), "groups": args.layer_groups}) for s in base]
    scenarios += [Scenario(**{**asdict(s), "groups": 1}) for s in base] if args.layer_groups != 1 else []
    scenarios += [Scenario(**{**asdict(s), "staging": "off"}) for s in base]
    if args.only:
        scenarios = [s for s in scenarios if args.only in f"{s.name} {s.staging}/{s.groups}"]
    results = []
    for sc in scenarios:
        nbytes = n_req * args.layers * sum(lay.page_bytes for lay in LAYOUTS.values())
        own_p = PageOwnership(sc.cp_p, pool_pages)
        shards = [  # staging as large as the request: it always fits (the planner falls back to direct otherwise)
            KVShard.allocate(LAYOUTS, own_p, r, num_layers=args.layers, staging_bytes=nbytes) for r in range(sc.cp_p)
        ]
        for s in shards:
            for b in s.buffers.values():
                b.view(torch.uint8).copy_(torch.randint(0, 256, b.shape, generator=g, dtype=torch.uint8))
        namespace = uuid.uuid4().hex
        sender = PrefillSender(
            shards,
            Bootstrap(store, namespace=namespace),
            engine=engine,
            options=PlanOptions(staging=sc.staging, layer_groups=sc.groups),
        )
        _ask(conn, "setup", asdict(sc), namespace, nbytes)
        sender.connect()
        src = np.arange(16, 16 + n_req)
        dst = _pages(n_req, pool_pages, sc.alloc, seed=1)
        want = _digest(shards, own_p, src)
        session, ceil_dst, record = _ask(conn, "ceiling", nbytes)
        ceil_src = torch.empty(nbytes, dtype=torch.uint8)
        engine.register([ceil_src])
        if record is not None:  # NIXL: the decode engine registered the ceiling region after the sender connected
            engine.add_peer(record, deadline=time.monotonic() + 30)
        rows = []
        verified = True
        for rep in range(args.reps + 1):  # rep 0 warms every buffer (first-touch page faults) and is verified
            t = time.monotonic()
            if engine.write(session, [ceil_src.data_ptr()], [ceil_dst], [nbytes]) != 0:
                raise RuntimeError("the ceiling transfer failed")
            ceiling = time.monotonic() - t
            rid = f"{sc.name}-{sc.staging}-{sc.groups}-{rep}"
            _ask(conn, "post", rid, dst, sc.staging != "off")
            t0 = time.monotonic()
            sent = sender.send_request(rid, src)
            t1 = time.monotonic()
            got, done, digest = _ask(conn, "wait", rid, dst, rep == 0)
            if rep == 0:
                verified = digest == want
                continue
            rows.append((ceiling, (t1 - t0) + got.tail_s, done - t0, sent, got))
        engine.unregister([ceil_src])
        sender.close()
        _ask(conn, "teardown")
        ratios = sorted(c / e for c, e, *_ in rows)
        ceiling = min(r[0] for r in rows)
        e2e, wall, sent, got = min((r[1:] for r in rows), key=lambda r: r[0])
        results.append(
            Result(
                scenario=sc.name,
                staging=sc.staging if sc.staging == "off" else f"{sc.staging}/{sc.groups}",
                entries=got.num_entries,
                min_entries=got.min_entries,
                calls=got.num_calls,
                mib=got.num_bytes / 2**20,
                e2e_ms=e2e * 1e3,
                wall_ms=wall * 1e3,
                plan_ms=sent.plan_s * 1e3,
                pack_ms=sent.pack_s * 1e3,
                unpack_ms=got.unpack_s * 1e3,
                tail_ms=got.tail_s * 1e3,
                ceiling_ms=ceiling * 1e3,
                gib_s=got.num_bytes / e2e / 2**30,
                ceiling_gib_s=got.num_bytes / ceiling / 2**30,
                ratio_best=ceiling / e2e,
                ratio_median=ratios[len(ratios) // 2],
                verified=verified,
                e2e_ms_median=float(np.median([r[1] for r in rows])) * 1e3,
            )
        )
        print(_row(results[-1]), flush=True)
    conn.send(("exit",))
    proc.join(10)
    engine.close()
    return results


def _row(r: Result) -> str:
    return (
        f"| {r.scenario:<29} | {r.staging:<6} | {r.entries:>7} | {r.min_entries:>3} | {r.calls:>5} | {r.mib:7.1f} | "
        f"{r.e2e_ms:7.1f} | {r.wall_ms:7.1f} | {r.plan_ms:7.1f} | {r.pack_ms:7.1f} | {r.unpack_ms:6.1f} | {r.tail_ms:6.1f} | {r.ceiling_ms:7.1f} | "
        f"{r.gib_s:5.2f} | {r.ceiling_gib_s:10.2f} | {r.ratio_best:4.2f} | {r.ratio_median:6.2f} | {'yes' if r.verified else 'NO':<7} |"
    )


HEADER = (
    "| scenario                      | stag   | entries | min | calls |     MiB |  e2e ms | wall ms | plan ms | pack ms | unpack |   tail | "
    "ceil ms | GiB/s | ceil GiB/s | best | median | bitwise |\n"
    "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|"
)


# ---------------------------------------------------------------------------------------------------- protocol
@dataclass(frozen=True, kw_only=True, slots=True)
class ProtocolResult:
    store: str
    """``hash`` (in-process ``HashStore``) or ``tcp`` (loopback ``TCPStore``)."""
    cp_p: int
    cp_d: int
    """Decode ranks, one receiver (and one store client) each."""
    requests: int
    ms_min: float
    """Fastest request (the protocol's own latency, least disturbed by other load on the machine)."""
    ms_p50: float
    ms_mean: float
    prefill_calls: float
    """Store calls per request issued by the prefill side."""
    decode_calls: float
    """Store calls per request issued by every decode receiver together (background ones included)."""


class _CountingStore:
    """Forwards every call to ``inner`` and counts them (each is one store round trip)."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.calls = 0

    def __getattr__(self, name: str):
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def counted(*args, **kwargs):
            self.calls += 1
            return attr(*args, **kwargs)

        return counted


def _counted_bootstrap(store, namespace: str) -> tuple[Bootstrap, _CountingStore]:
    boot = Bootstrap(store, namespace=namespace)
    boot.store = counter = _CountingStore(boot.store)
    return boot, counter


def run_protocol(args: argparse.Namespace) -> list[ProtocolResult]:
    import torch.distributed as dist

    results = []
    for kind in ("hash", "tcp"):
        for cp_p, cp_d in ((1, 1), (2, 1), (2, 2)):
            master = create_store(port=0, is_master=True) if kind == "tcp" else dist.HashStore()

            def client(master=master, kind=kind):
                return create_store(port=master.port, is_master=False) if kind == "tcp" else master

            namespace = uuid.uuid4().hex
            own_p, own_d = PageOwnership(cp_p, 16), PageOwnership(cp_d, 16)
            pre = [KVShard.allocate(LAYOUTS, own_p, r, num_layers=1) for r in range(cp_p)]
            dec = [KVShard.allocate(LAYOUTS, own_d, d, num_layers=1) for d in range(cp_d)]
            boot_p, count_p = _counted_bootstrap(client(), namespace)
            sender = PrefillSender(pre, boot_p, engine=LocalEngine(), timeout_s=10)
            boots_d = [_counted_bootstrap(client(), namespace) for _ in dec]
            receivers = [DecodeReceiver(s, b, engine=LocalEngine(), timeout_s=10) for s, (b, _) in zip(dec, boots_d)]
            for side in (sender, *receivers):
                side.connect()
            times = []
            calls_p = calls_d = 0
            for i in range(args.protocol_requests + 5):  # the first 5 warm up
                for side in (sender, *receivers):
                    side.bootstrap.flush(10)
                before_p, before_d = count_p.calls, sum(c.calls for _, c in boots_d)
                rid = f"p{i}"
                t0 = time.perf_counter()
                for r in receivers:
                    r.post_request(rid, [i % 16])
                sender.send_request(rid, [(3 * i) % 16])
                for r in receivers:
                    r.wait_request(rid)
                t1 = time.perf_counter()
                for side in (sender, *receivers):
                    side.bootstrap.flush(10)
                if i >= 5:
                    times.append(t1 - t0)
                    calls_p += count_p.calls - before_p
                    calls_d += sum(c.calls for _, c in boots_d) - before_d
            for side in (sender, *receivers):
                side.close()
            n = len(times)
            results.append(
                ProtocolResult(
                    store=kind,
                    cp_p=cp_p,
                    cp_d=cp_d,
                    requests=n,
                    ms_min=float(np.min(times)) * 1e3,
                    ms_p50=float(np.median(times)) * 1e3,
                    ms_mean=float(np.mean(times)) * 1e3,
                    prefill_calls=calls_p / n,
                    decode_calls=calls_d / n,
                )
            )
            r = results[-1]
            print(
                f"| {r.store:<4} | {r.cp_p} | {r.cp_d} | {r.requests:>4} | {r.ms_min:6.2f} | {r.ms_p50:6.2f} | "
                f"{r.ms_mean:6.2f} | "
                f"{r.prefill_calls:6.1f} | {r.decode_calls:6.1f} |",
                flush=True,
            )
    return results


PROTOCOL_HEADER = (
    "| store | cp_p | cp_d | reqs | ms min | ms p50 | ms mean | prefill calls | decode calls |\n"
    "|---|--:|--:|--:|--:|--:|--:|--:|--:|"
)


# ---------------------------------------------------------------------------------------------------- engines
SHAPES = ("per_page", "coalesced", "contiguous")
POOL_LAYOUTS = ("layer_major", "page_major")
"""``--layouts``: the pool layouts of both sides (``ShardedKVPool(page_major=...)``)."""


def _layout_shards(layers: int, pool_pages: int, layouts) -> dict[str, KVShard]:
    """One single-rank shard per pool layout."""
    own = PageOwnership(1, pool_pages)
    return {
        lay: KVShard.allocate(LAYOUTS, own, 0, num_layers=layers, page_major=lay == "page_major") for lay in layouts
    }


def _engine_target(conn, kind: str, port: int, namespace: str, layers: int, pool_pages: int, nbytes: int,
                   layouts=("layer_major",)) -> None:  # fmt: skip
    """Decode side of :func:`run_engines`: one engine of ``kind``, a decode shard per pool layout and a contiguous
    region."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    engine = create_engine(kind)
    shards = _layout_shards(layers, pool_pages, layouts)
    region = torch.zeros(nbytes, dtype=torch.uint8)
    engine.register([t for s in shards.values() for t in s.registered_tensors()] + [region])
    record = engine.agent_record()
    if record is not None:  # NIXL: the record travels through the store, as between PD sides
        Bootstrap(create_store(port=port, is_master=False), namespace=namespace).publish_agent(
            "decode", 0, record, deadline=time.monotonic() + 60
        )
    conn.send(({lay: s.endpoint("decode", engine.session) for lay, s in shards.items()}, region.data_ptr()))
    while True:
        cmd, *args = conn.recv()
        if cmd == "clear":
            for shard in shards.values():
                for b in shard.buffers.values():
                    b.zero_()
            region.zero_()
            conn.send(("ok",))
        elif cmd == "digest":
            lay, dst, contiguous_bytes = args
            if contiguous_bytes:
                conn.send(hashlib.blake2b(region[:contiguous_bytes].numpy().tobytes(), digest_size=16).hexdigest())
            else:
                conn.send(_digest([shards[lay]], shards[lay].ownership, dst))
        elif cmd == "exit":
            engine.close()
            return


def _shape_entries(shape: str, plan_peers, shard_p: KVShard, ep_d, src, dst, contig) -> list[PeerEntries]:
    """The entries of one shape (``contig``: ``(src_addr, dst_addr, nbytes)`` of the contiguous regions)."""
    (peer,) = plan_peers
    if shape == "coalesced":
        return [peer]
    if shape == "contiguous":
        s, d, n = (np.array([x], dtype=np.int64) for x in contig)
    else:  # one entry per page and buffer (and layer, where the layout splits a page's layers): unit runs
        ones = np.ones(src.shape[0], dtype=np.int64)
        parts = []
        for spec in ep_d.buffers:
            buf = shard_p.buffers[spec.name]
            so, do, ln, _ = expand_runs(
                (src, dst, ones), num_layers=shard_p.num_layers, page_bytes=spec.page_bytes,
                src_rows=int(buf.shape[1]), dst_rows=spec.num_local_pages, src_page_major=shard_p.page_major,
                dst_page_major=spec.page_major,
            )  # fmt: skip
            parts.append((buf.data_ptr() + so, spec.addr + do, ln))
        s, d, n = (np.concatenate(x) for x in zip(*parts))
    return [PeerEntries(decode_rank=0, session=peer.session, src=s, dst=d, length=n, positions=peer.positions,
                        dst_pages=peer.dst_pages)]  # fmt: skip


def _time_send(engine, entries, *, max_entries: int = 1024, cpu: list | None = None) -> tuple[float, int]:
    """Seconds and calls of one :func:`send_entries`; ``cpu`` gets this process's CPU seconds (every thread)."""
    c0, t0 = time.process_time(), time.perf_counter()
    calls = send_entries(engine, entries, request_id="bench", deadline=time.monotonic() + 600,
                         max_entries_per_call=max_entries)  # fmt: skip
    dt = time.perf_counter() - t0
    if cpu is not None:
        cpu.append(time.process_time() - c0)
    return dt, calls


@dataclass
class _Side:
    """One engine's pair for :func:`run_engines`: this process's engine and shards (one per pool layout), the
    decode process."""

    kind: str
    engine: object
    shards: dict
    """pool layout -> this process's shard."""
    region: torch.Tensor
    proc: object
    conn: object
    eps_d: dict
    """pool layout -> the decode shard's endpoint."""
    dst_region: int
    record: object = None
    """The decode engine's agent record (NIXL)."""

    @property
    def shard(self) -> KVShard:
        """The first layout's shard."""
        return next(iter(self.shards.values()))

    @property
    def ep_d(self):
        """The first layout's decode endpoint."""
        return next(iter(self.eps_d.values()))


def _start_sides(kinds, store, *, layers: int, pool_pages: int, nbytes: int, g,
                 layouts=("layer_major",)) -> list[_Side]:  # fmt: skip
    ctx = mp.get_context("spawn")
    sides = []
    for kind in kinds:
        namespace = uuid.uuid4().hex
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=_engine_target, daemon=True,
                           args=(child, kind, store.port, namespace, layers, pool_pages, nbytes, tuple(layouts)))  # fmt: skip
        proc.start()
        engine = create_engine(kind)
        shards = _layout_shards(layers, pool_pages, layouts)
        for shard in shards.values():
            for b in shard.buffers.values():
                u8 = b.view(torch.uint8)
                u8.copy_(torch.randint(0, 256, u8.shape, generator=g, dtype=torch.uint8))
        region = torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)
        engine.register([t for s in shards.values() for t in s.registered_tensors()] + [region])
        if not conn.poll(300):
            raise TimeoutError(f"the {kind} decode process did not start")
        eps_d, dst_region = conn.recv()
        record = None
        if kind == "nixl":
            record = Bootstrap(store, namespace=namespace).agent("decode", 0, deadline=time.monotonic() + 60)
            engine.add_peer(record, deadline=time.monotonic() + 60)
        sides.append(_Side(kind, engine, shards, region, proc, conn, eps_d, dst_region, record))
    return sides


def _stop_sides(sides: list[_Side]) -> None:
    for side in sides:
        side.conn.send(("exit",))
        side.proc.join(30)
        side.engine.close()


def run_engines(args: argparse.Namespace) -> list[dict]:
    """Every engine of ``--engines`` on the three shapes of every ``--sizes`` request and ``--layouts`` pool layout
    (module docstring)."""
    torch.set_num_threads(1)
    kinds = [k.strip() for k in args.engines.split(",") if k.strip()]
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    if not layouts or any(lay not in POOL_LAYOUTS for lay in layouts):
        raise SystemExit(f"--layouts must list some of {','.join(POOL_LAYOUTS)}, got --layouts {args.layouts}")
    sizes = [int(x) for x in args.sizes.split(",")]
    max_pages = -(-max(sizes) // PAGE_SIZE)
    pool_pages = 2 * max_pages + 64
    page_bytes = sum(lay.page_bytes for lay in LAYOUTS.values())
    store = create_store(port=0, is_master=True)
    g = torch.Generator().manual_seed(0)
    sides = _start_sides(kinds, store, layers=args.layers, pool_pages=pool_pages,
                         nbytes=max_pages * args.layers * page_bytes, g=g, layouts=layouts)  # fmt: skip
    rows = []
    try:
        for tokens in sizes:
            n_req = -(-tokens // PAGE_SIZE)
            nbytes = n_req * args.layers * page_bytes
            src = np.arange(16, 16 + n_req)
            dst = _pages(n_req, pool_pages, "fragmented", seed=1)
            work = {}
            for side in sides:
                for lay in layouts:
                    shard, ep_d = side.shards[lay], side.eps_d[lay]
                    ep_p = shard.endpoint("prefill", side.engine.session)
                    plan = plan_request(src, dst, prefill=[ep_p], decode=[ep_d],
                                        options=PlanOptions(staging="off", layer_groups=1))  # fmt: skip
                    contig = (side.region.data_ptr(), side.dst_region, nbytes)
                    for shape in SHAPES:
                        entries = _shape_entries(shape, plan.senders[0].peers, shard, ep_d, src, dst, contig)
                        _ask(side.conn, "clear")
                        _time_send(side.engine, entries)  # warm-up, verified
                        contiguous = nbytes if shape == "contiguous" else 0
                        got = _ask(side.conn, "digest", lay, dst, contiguous)
                        if contiguous:
                            want = hashlib.blake2b(side.region[:nbytes].numpy().tobytes(), digest_size=16).hexdigest()
                        else:
                            want = _digest([shard], shard.ownership, src)
                        work[(side.kind, lay, shape)] = [side, entries, got == want, [], 0, []]
            for rep in range(args.reps):  # engines, layouts and shapes interleaved: a slow spell hits all alike
                for side in sides:  # one layout's shapes back to back, their order reversed every other repetition
                    for lay in layouts if rep % 2 == 0 else layouts[::-1]:
                        for shape in SHAPES if rep % 2 == 0 else SHAPES[::-1]:
                            w = work[(side.kind, lay, shape)]
                            dt, w[4] = _time_send(side.engine, w[1], cpu=w[5])
                            w[3].append(dt)
            for (kind, lay, shape), (_side, entries, ok, times, calls, cpu) in work.items():
                base, base_cpu = work[(kind, lay, "contiguous")][3], work[(kind, lay, "contiguous")][5]
                med = float(np.median(times))
                rows.append({"engine": kind, "layout": lay, "shape": shape, "tokens": tokens, "layers": args.layers,
                             "bytes": nbytes, "entries": sum(p.num_entries for p in entries), "calls": calls,
                             "gb_s": nbytes / med / 1e9, "gb_s_best": nbytes / min(times) / 1e9,
                             "vs_contiguous": float(np.median(np.array(base) / np.array(times))),
                             "vs_contiguous_of_medians": float(np.median(base)) / med, "reps": len(times),
                             "cpu_ms": 1e3 * float(np.median(cpu)),
                             "vs_contiguous_cpu": float(np.median(np.array(base_cpu) / np.array(cpu))),
                             "verified": bool(ok)})  # fmt: skip
                print(_engine_row(rows[-1]), flush=True)
    finally:
        _stop_sides(sides)
    if args.planned:  # dtkv's own send of the largest request, default policy, through the protocol
        print(HEADER, flush=True)
        for kind in kinds:
            sub = argparse.Namespace(**{**vars(args), "engine": kind, "tokens": max(sizes), "only": "auto/4",
                                        "layer_groups": 4})  # fmt: skip
            for r in run(sub):
                nbytes = int(round(r.mib * 2**20))
                rows.append({"engine": kind, "layout": "layer_major", "shape": f"planned {r.scenario}",
                             "tokens": max(sizes),
                             "layers": args.layers, "bytes": nbytes, "entries": r.entries, "calls": r.calls,
                             "gb_s": nbytes / (r.e2e_ms_median * 1e-3) / 1e9, "gb_s_best": nbytes / (r.e2e_ms * 1e-3) / 1e9,
                             "vs_contiguous": r.ratio_median, "verified": r.verified})  # fmt: skip
    return rows


ENGINE_HEADER = (
    "| engine | layout | shape | tokens | MB | entries | calls | GB/s (median) | GB/s (best) | vs contiguous | CPU ms | "
    "vs contiguous, CPU | bitwise |\n|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|"
)


def _engine_row(r: dict) -> str:
    cpu = f"{r['cpu_ms']:.1f} | {r['vs_contiguous_cpu']:.2f}" if "cpu_ms" in r else "- | -"
    return (
        f"| {r['engine']} | {r['layout']} | {r['shape']} | {r['tokens']} | {r['bytes'] / 1e6:.1f} | {r['entries']} | {r['calls']} | "
        f"{r['gb_s']:.2f} | {r['gb_s_best']:.2f} | {r['vs_contiguous']:.2f} | {cpu} | "
        f"{'yes' if r['verified'] else 'NO'} |"
    )


SWEEP = (
    {},
    {"batch_entries": 64},
    {"batch_entries": 256},
    {"entries_per_call": 8192, "batch_entries": 4096},
    {"entries_per_call": 8192},
    {"inflight": 1},
    {"inflight": 4},
)
"""``--nixl-sweep``: one knob at a time away from the defaults (the first row): entries per ``send_entries`` call,
descriptors per request, requests in flight."""


def _sweep_config(change: dict) -> dict:
    from dtkv.transfer import _nixl

    base = {"entries_per_call": 1024, "batch_entries": _nixl.BATCH_ENTRIES, "inflight": _nixl.INFLIGHT_PER_PEER}
    return {**base, **change}


def run_nixl_sweep(args: argparse.Namespace) -> list[dict]:
    """NIXL's knobs (:data:`SWEEP`) on the three shapes of the largest ``--sizes`` request: per
    configuration the median GB/s of ``--reps`` and the median of its per-repetition ratios to the defaults' time
    (configurations interleaved, their order reversed every other repetition)."""
    from dtkv.transfer import NixlEngine

    torch.set_num_threads(1)
    tokens = max(int(x) for x in args.sizes.split(","))
    n_req = -(-tokens // PAGE_SIZE)
    pool_pages = 2 * n_req + 64
    nbytes = n_req * args.layers * sum(lay.page_bytes for lay in LAYOUTS.values())
    store = create_store(port=0, is_master=True)
    (side,) = _start_sides(["nixl"], store, layers=args.layers, pool_pages=pool_pages, nbytes=nbytes,
                           g=torch.Generator().manual_seed(0))  # fmt: skip
    src, dst = np.arange(16, 16 + n_req), _pages(n_req, pool_pages, "fragmented", seed=1)
    plan = plan_request(src, dst, prefill=[side.shard.endpoint("prefill", side.engine.session)], decode=[side.ep_d],
                        options=PlanOptions(staging="off", layer_groups=1))  # fmt: skip
    configs = [_sweep_config(c) for c in SWEEP]
    rows = []
    engines = []
    try:
        for c in configs:  # one engine per configuration, each registering the same source memory
            eng = NixlEngine(**{k: v for k, v in c.items() if k != "entries_per_call"})
            eng.register(side.shard.registered_tensors() + [side.region])
            eng.add_peer(side.record, deadline=time.monotonic() + 60)
            engines.append(eng)
        for shape in ("per_page", "coalesced", "contiguous"):
            contig = (side.region.data_ptr(), side.dst_region, nbytes)
            entries = _shape_entries(shape, plan.senders[0].peers, side.shard, side.ep_d, src, dst, contig)
            for c, eng in zip(configs, engines):
                _time_send(eng, entries, max_entries=c["entries_per_call"])  # warm-up
            times: list[list[float]] = [[] for _ in configs]
            cpus: list[list[float]] = [[] for _ in configs]
            for rep in range(args.reps):
                order = list(range(len(configs)))
                for i in order if rep % 2 == 0 else order[::-1]:
                    dt, _ = _time_send(engines[i], entries, max_entries=configs[i]["entries_per_call"], cpu=cpus[i])
                    times[i].append(dt)
            base, base_cpu = np.array(times[0]), np.array(cpus[0])
            for c, ts, cpu in zip(configs, times, cpus):
                rows.append({"engine": "nixl", "shape": shape, "tokens": tokens, "bytes": nbytes,
                             "entries": sum(p.num_entries for p in entries), **c,
                             "ucx_tls": os.environ.get("UCX_TLS", "default"),
                             "gb_s": nbytes / float(np.median(ts)) / 1e9, "gb_s_best": nbytes / min(ts) / 1e9,
                             "vs_default": float(np.median(base / np.array(ts))), "reps": len(ts),
                             "cpu_ms": 1e3 * float(np.median(cpu)),
                             "vs_default_cpu": float(np.median(base_cpu / np.array(cpu)))})  # fmt: skip
                r = rows[-1]
                print(f"| {shape} | {c['entries_per_call']} | {c['batch_entries']} | {c['inflight']} | {r['gb_s']:.2f} | "
                      f"{r['gb_s_best']:.2f} | {r['vs_default']:.2f} | {r['cpu_ms']:.1f} | {r['vs_default_cpu']:.2f} |",
                      flush=True)  # fmt: skip
    finally:
        for eng in engines:
            eng.close()
        _stop_sides([side])
    return rows


SWEEP_HEADER = (
    "| shape | entries per call | descriptors per request | in flight | GB/s (median) | GB/s (best) | vs defaults | "
    "CPU ms | vs defaults, CPU |\n|---|--:|--:|--:|--:|--:|--:|--:|--:|"
)


def _load() -> str:
    """The load averages (1, 5, 15 min): the machine may be shared."""
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    out = [f"torch {torch.__version__}"]
    for name in ("mooncake-transfer-engine-non-cuda", "nixl", "nixl-cu12", "nixl-cu13"):
        try:
            out.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            pass
    return ", ".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32768, help="tokens of the request (default 32768)")
    p.add_argument("--layers", type=int, default=8, help="layers of the KV (default 8)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per scenario (default 5)")
    p.add_argument("--layer-groups", type=int, default=4, help="pipeline layer groups of the auto rows (default 4)")
    p.add_argument("--json", default=None, help="write the rows here, a JSON file (default: none)")
    p.add_argument(
        "--only", default=None, help="run the scenarios whose name and staging contain this text (default: all)"
    )
    p.add_argument("--engine", default="mooncake", choices=("mooncake", "nixl"), help="scenario rows: the engine")
    p.add_argument(
        "--engines", default=None, help="compare these engines on raw entry shapes instead, e.g. mooncake,nixl"
    )
    p.add_argument("--sizes", default="4096,32768", help="--engines: request sizes in tokens (default 4096,32768)")
    p.add_argument(
        "--layouts",
        default=",".join(POOL_LAYOUTS),
        help="--engines: pool layouts of both sides, measured in one run (default layer_major,page_major)",
    )
    p.add_argument("--jsonl", default=None, help="--engines / --nixl-sweep: write the rows here, one JSON per line")
    p.add_argument("--nixl-sweep", action="store_true", help="measure NIXL's knobs one at a time (SWEEP)")
    p.add_argument(
        "--planned",
        action="store_true",
        help="--engines: also dtkv's own send (the scenarios' default policy, auto/4) of the largest size per engine",
    )
    p.add_argument("--protocol", action="store_true", help="measure the protocol's per-request cost instead")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="measure the hand-off of pools on this device against a device-to-device copy (default: the host "
        "scenarios above)",
    )
    p.add_argument(
        "--stage",
        choices=("auto", "always", "never"),
        default="auto",
        help="--device: the host window where the engine cannot register the pools (auto), always, or never",
    )
    p.add_argument("--small-rounds", type=int, default=64, help="--device: round_pages of the many-rounds row (64)")
    p.add_argument("--smoke", action="store_true", help="--device: two small scenarios, no probe (a quick check)")
    p.add_argument("--out-dir", default=None, help="--device: where the results go (default $OUT or results/)")
    p.add_argument("--protocol-requests", type=int, default=100, help="timed requests per --protocol row (default 100)")
    args = p.parse_args()
    setup_cli_logging()
    if args.device is not None:
        from _transfer_device import run_device

        if args.smoke:
            args.tokens, args.layers, args.reps = min(args.tokens, 4096), min(args.layers, 2), min(args.reps, 2)
            args.small_rounds = min(args.small_rounds, 16)  # several rounds through the two slots
        with phase(f"hand-off of {args.device} pools, {args.tokens} tokens x {args.layers} layers, {args.reps} reps"):
            rows = run_device(args, LAYOUTS, PAGE_SIZE)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        if not all(r.get("verified", True) for r in rows):
            raise SystemExit("a hand-off arrived with other bytes (see the rows)")
        return
    if args.protocol:
        print(f"# {datetime.date.today()} | {platform.node()} | {os.cpu_count()} cores | torch {torch.__version__}")
        print(PROTOCOL_HEADER)
        results = run_protocol(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump([asdict(r) for r in results], f, indent=1)
        return
    if args.engines or args.nixl_sweep:
        print(f"# {datetime.date.today()} | {platform.node()} | {os.cpu_count()} cores | {_versions()} | "
              f"sizes={args.sizes} layouts={args.layouts} layers={args.layers} reps={args.reps} | load {_load()}")  # fmt: skip
        if args.nixl_sweep:
            print(SWEEP_HEADER)
            rows = run_nixl_sweep(args)
        else:
            print(ENGINE_HEADER)
            rows = run_engines(args)
        print(f"# load {_load()}")
        if args.jsonl:
            with open(args.jsonl, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        return
    print(
        f"# {datetime.date.today()} | {platform.node()} | {os.cpu_count()} cores | {_versions()} | "
        f"engine={args.engine} tokens={args.tokens} layers={args.layers} reps={args.reps}"
    )
    print(HEADER)
    with phase(f"transfer scenarios, {args.tokens} tokens x {args.layers} layers, {args.reps} reps"):
        results = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)


if __name__ == "__main__":
    main()
