"""``bench_transfer.py --device cuda|cpu``: the hand-off of pools on a device (``HandoffSender`` /
``HandoffReceiver``) over Mooncake, against a device-to-device copy of the same bytes.

The prefill side runs in this process (``cp_p`` ranks, one engine), a spawned decode process hosts ``cp_d`` ranks on
the same device (one GPU serves both, as ``--pd`` on one H200); every pool holds the request's pages in the
DeepSeek-V3.2 geometry of ``bench_transfer.py``. Each side hands over in place where its engine registers the
pools' memory and through its pinned host window where it cannot (Mooncake's non-cuda wheel: every CUDA pool);
``--stage always`` forces the window on both sides (what a CPU smoke measures). Per scenario one verified warm-up
(decode hashes its pages in position order against the prefill side's hash) and ``--reps`` timed repetitions:

- ``e2e_ms``: prefill's ``send_request`` start to decode's ``receive_request`` end (every round, the staging copies
  and the protocol's store round trips included: the hand-off as the runtime sees it);
- ``d2d_ms``: a copy of the same number of bytes from one device buffer to another (``torch`` ``copy_`` on the
  device, the device's own ceiling), and ``host_ms`` a device-to-pinned-host-to-device copy of them (what the
  window's copies cost at least);
- ``gb_s`` = bytes / e2e, ``d2d_gb_s``, ``ratio`` = ``gb_s / d2d_gb_s`` (best repetitions).

One row more (``case: probe``, CUDA only, in a subprocess with a deadline): what the installed Mooncake does when a
CUDA tensor is registered and written raw, as ``MooncakeEngine`` did before it refused such memory -- the
registration's return code and the first write's, and how long the write took (or that it never returned).

Rows go to ``<out>/transfer_<hw>_<date>.jsonl`` (``h200x1`` on one H200), with a markdown table beside them.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import torch
from _dist_bench import hardware_tag, out_dir, today

from dtkv import PageOwnership
from dtkv._log import progress
from dtkv.transfer import Bootstrap, HandoffReceiver, HandoffSender, KVShard, MooncakeEngine, create_store
from dtkv.transfer.memory import mooncake_build

__all__ = ["run_device"]


def _digest(shards: list[KVShard], ownership: PageOwnership, pages: np.ndarray) -> str:
    h = hashlib.blake2b(digest_size=16)
    t = torch.from_numpy(pages)
    owner, local = ownership.owner(t), ownership.local_index(t)
    by_rank = {s.rank: s for s in shards}
    for name in sorted(shards[0].layouts):
        for i in range(pages.shape[0]):  # position order (verification only)
            buf = by_rank[int(owner[i])].buffers[name]
            h.update(buf[:, int(local[i])].contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def _stage(mode: str) -> bool | None:
    return {"auto": None, "always": True, "never": False}[mode]


# ---------------------------------------------------------------------------------------------------- decode
def _decode_main(conn, port: int, layers: int, pool_pages: int, device: str, layouts) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    engine = MooncakeEngine()
    store = create_store(port=port, is_master=False)
    receiver = shards = None
    while True:
        cmd, *args = conn.recv()
        if cmd == "setup":
            cp_d, namespace, round_pages, stage = args
            own = PageOwnership(cp_d, pool_pages, "interleave")
            shards = [KVShard.allocate(layouts, own, d, num_layers=layers, device=device, meta_num_rows=1,
                                       meta_row_bytes=48) for d in range(cp_d)]  # fmt: skip
            receiver = HandoffReceiver(shards, Bootstrap(store, namespace=namespace), engine=engine,
                                       round_pages=round_pages, staged=_stage(stage))  # fmt: skip
            receiver.connect()
            conn.send(("ok", receiver.staged))
        elif cmd == "recv":
            rid, dst, verify = args
            rep = receiver.receive_request(rid, dst)
            done = time.monotonic()
            digest = _digest(shards, shards[0].ownership, dst) if verify else ""
            conn.send((rep, done, digest))
        elif cmd == "teardown":
            receiver.close()
            receiver = shards = None
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
            conn.send(("ok",))
        elif cmd == "exit":
            engine.close()
            return


def _ask(conn, timeout_s: float = 300.0):
    if not conn.poll(timeout_s):
        raise TimeoutError(f"the decode process did not answer within {timeout_s} s")
    return conn.recv()


# ---------------------------------------------------------------------------------------------------- baselines
def _time(fn, device: torch.device, reps: int) -> float:
    """Best seconds of ``fn()`` over ``reps`` runs (after one warm-up), the device idle around each."""
    fn()
    best = float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t)
    return best


def _baselines(nbytes: int, device: torch.device, reps: int) -> tuple[float, float]:
    """``(device-to-device copy seconds, device -> pinned host -> device seconds)`` of ``nbytes``."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    d2d = _time(lambda: dst.copy_(src), device, reps)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")

    def through_host():
        host.copy_(src, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        dst.copy_(host, non_blocking=True)

    via_host = _time(through_host, device, reps)
    return d2d, via_host


_PROBE = r"""
import os, sys, time, json
os.environ.setdefault("MC_FORCE_TCP", "1"); os.environ.setdefault("MC_TRANSFER_TIMEOUT", "10")
import torch
from mooncake.engine import TransferEngine
a, b = TransferEngine(), TransferEngine()
assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0 and b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
src = torch.full((1 << 20,), 7, dtype=torch.uint8, device="cuda")
dst = torch.zeros(1 << 20, dtype=torch.uint8)
out = {"register_rc": a.register_memory(src.data_ptr(), src.numel()), "dst_register_rc": b.register_memory(dst.data_ptr(), dst.numel())}
print(json.dumps(out), flush=True)
t = time.monotonic()
out["write_rc"] = a.transfer_sync_write(f"127.0.0.1:{b.get_rpc_port()}", src.data_ptr(), dst.data_ptr(), src.numel())
out["write_s"] = round(time.monotonic() - t, 3)
out["bytes_landed"] = bool((dst == 7).all())
print(json.dumps(out), flush=True)
"""


def _probe(timeout_s: float = 60.0) -> dict:
    """What the installed Mooncake does with a CUDA tensor registered and written raw (a subprocess, bounded)."""
    row = {"case": "probe", "mooncake_build": mooncake_build(), "timeout_s": timeout_s}
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=timeout_s)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
        row.update(json.loads(lines[-1]) if lines else {})
        row["returncode"] = out.returncode
        row["stderr_tail"] = out.stderr[-600:]
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
        row.update(json.loads(lines[-1]) if lines else {})
        row["hung"] = f"the write did not return within {timeout_s} s"
    return row


# ---------------------------------------------------------------------------------------------------- scenarios
def run_device(args, layouts, page_size: int) -> list[dict]:
    """Every scenario on ``args.device`` (rows as dicts; also written to ``<out>/transfer_<hw>_<date>.jsonl``)."""
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    n_req = -(-args.tokens // page_size)
    pool_pages = n_req + 64
    per_page = args.layers * sum(lay.page_bytes for lay in layouts.values())
    store = create_store(port=0, is_master=True)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_decode_main, args=(child, store.port, args.layers, pool_pages, str(device), layouts),
                       daemon=True)  # fmt: skip
    proc.start()
    engine = MooncakeEngine()
    hw = hardware_tag(device, 1)
    common = {"device": hw, "date": today(), "torch": torch.__version__, "mooncake_build": mooncake_build(),
              "tokens": args.tokens, "layers": args.layers, "page_size": page_size}  # fmt: skip
    rows: list[dict] = []
    if device.type == "cuda" and not args.smoke:
        rows.append({**common, **_probe()})
        progress("probe: %s", rows[-1])
    scenarios = [(1, 1, None), (1, 1, args.small_rounds), (2, 1, None), (2, 2, None)]
    if args.smoke:
        scenarios = scenarios[:2]
    try:
        for cp_p, cp_d, round_pages in scenarios:
            own_p = PageOwnership(cp_p, pool_pages, "interleave")
            shards = [KVShard.allocate(layouts, own_p, r, num_layers=args.layers, device=device, meta_num_rows=1,
                                       meta_row_bytes=48) for r in range(cp_p)]  # fmt: skip
            for s in shards:
                for b in s.buffers.values():
                    u8 = b.view(torch.uint8)
                    u8.copy_(torch.randint(0, 256, u8.shape, dtype=torch.uint8, device=device))
            namespace = uuid.uuid4().hex
            sender = HandoffSender(shards, Bootstrap(store, namespace=namespace), engine=engine,
                                   round_pages=round_pages, staged=_stage(args.stage))  # fmt: skip
            conn.send(("setup", cp_d, namespace, sender.round_pages, args.stage))
            _, staged_d = _ask(conn)
            sender.connect()
            src = np.arange(16, 16 + n_req)
            rng = np.random.default_rng(cp_p * 10 + cp_d)
            dst = rng.permutation(pool_pages)[:n_req]  # a decode pool in steady state: pages in any order
            want = _digest(shards, own_p, src)
            times, verified, last = [], False, None
            for rep in range(args.reps + 1):  # rep 0 warms every buffer and is verified
                rid = f"s{cp_p}{cp_d}-{rep}"
                conn.send(("recv", rid, dst, rep == 0))
                t0 = time.monotonic()
                sent = sender.send_request(rid, src)
                got, done, digest = _ask(conn)
                if rep == 0:
                    verified = digest == want
                    continue
                times.append(done - t0)
                last = (sent, got)
            sender.close()
            conn.send(("teardown",))
            _ask(conn)
            nbytes = n_req * per_page
            d2d, via_host = _baselines(nbytes, device, max(3, args.reps))
            e2e = min(times)
            sent, got = last
            rows.append({
                **common, "case": "handoff", "cp_p": cp_p, "cp_d": cp_d, "round_pages": sender.round_pages,
                "rounds": -(-n_req // sender.round_pages), "staged_prefill": sender.staged,
                "staged_decode": bool(staged_d), "bytes": nbytes, "e2e_ms": round(e2e * 1e3, 3),
                "e2e_ms_median": round(float(np.median(times)) * 1e3, 3), "gb_s": round(nbytes / e2e / 1e9, 4),
                "d2d_ms": round(d2d * 1e3, 4), "d2d_gb_s": round(nbytes / d2d / 1e9, 2),
                "host_ms": round(via_host * 1e3, 4), "host_gb_s": round(nbytes / via_host / 1e9, 2),
                "ratio": round(d2d / e2e, 5), "pack_ms": round(sent.pack_s * 1e3, 3),
                "unpack_ms": round(got.unpack_s * 1e3, 3), "entries": got.num_entries, "calls": got.num_calls,
                "reps": args.reps, "verified": bool(verified),
            })  # fmt: skip
            progress("%s", rows[-1])
            del shards
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        conn.send(("exit",))
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        engine.close()
    _write(rows, hw, args.out_dir)
    return rows


def _write(rows: list[dict], hw: str, explicit: str | None) -> Path:
    out = out_dir(explicit) / f"transfer_{hw}_{today()}.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    md = out.with_suffix(".md")
    lines = [f"# PD hand-off of {rows[-1]['device'] if rows else hw} pools vs a device-to-device copy ({today()})", "",
             f"`python benchmarks/bench_transfer.py {' '.join(sys.argv[1:])}`; Mooncake build "
             f"`{mooncake_build() or 'unknown'}`, torch {torch.__version__}.", "",
             "| cp_p -> cp_d | rounds x pages | staged (p, d) | MiB | e2e ms | GB/s | d2d ms | d2d GB/s | via host "
             "GB/s | ratio | bitwise |", "|---|--:|---|--:|--:|--:|--:|--:|--:|--:|---|"]  # fmt: skip
    for r in rows:
        if r["case"] == "probe":
            continue
        lines.append(
            f"| {r['cp_p']} -> {r['cp_d']} | {r['rounds']} x {r['round_pages']} | {r['staged_prefill']}, "
            f"{r['staged_decode']} | {r['bytes'] / 2**20:.1f} | {r['e2e_ms']:.1f} | {r['gb_s']:.3f} | "
            f"{r['d2d_ms']:.3f} | {r['d2d_gb_s']:.0f} | {r['host_gb_s']:.1f} | {r['ratio']:.4f} | "
            f"{'yes' if r['verified'] else 'NO'} |"
        )
    probe = [r for r in rows if r["case"] == "probe"]
    if probe:
        p = probe[0]
        lines += ["", f"Raw Mooncake with a CUDA tensor (`{p.get('mooncake_build')}`): register rc "
                  f"{p.get('register_rc')}, first write rc {p.get('write_rc')} after {p.get('write_s')} s"
                  f"{', ' + p['hung'] if 'hung' in p else ''}."]  # fmt: skip
    md.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out} and {md}")
    return out
