"""Decode steps at DeepSeek-V3.2 geometry: replicated, full view and sharded, eager and as CUDA graphs, one run.

GPU, one H200 (~5 min; ``--quick``: 32K/128K x batch 1/4, ~2 min)::

    torchrun --nproc-per-node 1 benchmarks/bench_decode.py [--quick]

GPU, 2 H200 (the collectives: ``--comm nccl,symm_mem`` measures sharded decode with both)::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 torchrun --nproc-per-node 2 benchmarks/bench_decode.py \\
        --comm nccl,symm_mem

CPU smoke (2 gloo ranks, tiny geometry, torch kernels; what ``tests/test_decode_bench.py`` runs)::

    python benchmarks/bench_decode.py --smoke

Scenario: ``B`` requests of ``T`` tokens each decode one token on ``cp`` ranks. The KV is random bytes in the stored
formats (656-byte fp8 MLA rows, 8448-byte indexer pages at page size 64) in a :class:`dtkv.ShardedKVPool` with
``interleave`` ownership; no prefill. One *step* is :meth:`dtkv.decode.DecodeStep.run` over ``--layers`` layers
(61 for DeepSeek-V3.2; the attention part only, queries random): per layer the new rows' fp8 writes, the Triton fp8
indexer (:func:`dtkv.ops.indexer_scores`), ``torch.topk``, the exchange and global top-k (sharded, ``cp > 1``),
FlashMLA sparse decode through the attention seam, the LSE merge (sharded, ``cp > 1``). Modes:

- ``replicated``: every rank holds the whole KV (a pool of ``cp_size`` 1) and decodes alone: the baseline;
- ``full_view``: the sharded pool, the batch's pages all-gathered into a view every layer, then as replicated;
- ``sharded``: the sharded pool, decode where the pages are (bytes independent of the context).

With one rank the three modes run the same kernels (a group of one holds its full view in its pool) and the pool
is shared. Where ``--layers`` layers of KV do not fit (``--mem-budget-gb``), the layers share fewer pool layers
(layer ``l`` reads pool layer ``l % pool_layers``; the results say how many): the bytes each layer reads are the
same, only their addresses repeat (1M tokens x 64 requests is 53 GB per layer).

Per scenario and mode: ``--warmup`` steps then ``--reps`` steps timed one by one with CUDA events (median), eager
and replaying one captured graph. Unless ``--no-phases``, each phase of one layer is also timed alone (eager, 20
launches each) and the indexer kernel's GB/s on the bytes it must read. ``vs_replicated`` = ``step_ms`` / the
replicated ``step_ms`` of the same context, batch and graph setting. Parity per scenario: top-k agreement of the
last layer with the replicated step (fraction of queries selecting the same set) and the largest relative
difference of its output.

Writes ``decode_graph_<hw>x<cp>_<date>.jsonl`` / ``.md`` / ``.png`` (and ``decode_graph_indexer_...jsonl``) into
``--out-dir`` and into ``$OUT`` when set. Rank 0 prints one JSON line per measurement and the summary last.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
if importlib.util.find_spec("dtkv") is None:  # a checkout that is not installed: use it as is
    sys.path.insert(0, str(ROOT))

import _decode_report as report  # noqa: E402
import bench_indexer_scores as isweep  # noqa: E402
from _dist_bench import barrier, elapsed_ms, hardware_tag, sync, today  # noqa: E402

from dtkv import IndexerFp8Layout, MLAFp8Layout, PageAllocator, PageOwnership, ShardedKVPool  # noqa: E402
from dtkv._util import cdiv  # noqa: E402
from dtkv.decode import MODES, DecodeStep, DecodeStepConfig  # noqa: E402
from dtkv.decode import _step_layer as layer_ops  # noqa: E402
from dtkv.kvio import random_pages  # noqa: E402
from dtkv.ops import indexer_scores  # noqa: E402
from dtkv.ops.indexer_scores import indexer_scores_bytes  # noqa: E402

H200_HBM_GBPS = 4800.0
"""H200 HBM3e bandwidth (spec sheet): the ceiling the indexer's GB/s is held against."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Geometry:
    """Model and cache geometry of the sweep."""

    num_heads: int = 128
    kv_lora_rank: int = 512
    rope_dim: int = 64
    quant_block: int = 128
    index_heads: int = 64
    index_head_dim: int = 128
    topk: int = 2048
    page_size: int = 64
    num_layers: int = 61

    @property
    def layouts(self) -> dict[str, object]:
        kv = MLAFp8Layout(page_size=self.page_size, kv_lora_rank=self.kv_lora_rank, rope_dim=self.rope_dim,
                          quant_block=self.quant_block)  # fmt: skip
        return {"index": IndexerFp8Layout(page_size=self.page_size, head_dim=self.index_head_dim), "kv": kv}

    @property
    def page_bytes(self) -> int:
        return sum(lay.page_bytes for lay in self.layouts.values())

    @property
    def softmax_scale(self) -> float:
        return 1.0 / math.sqrt(128 + self.rope_dim)  # DeepSeek-V3: qk_nope_head_dim 128 + rope


DSV32 = Geometry()
SMOKE = Geometry(num_heads=4, kv_lora_rank=64, rope_dim=16, quant_block=32, index_heads=2, index_head_dim=32, topk=48,
                 page_size=16, num_layers=2)  # fmt: skip


def fill_random(pool: ShardedKVPool, gen: torch.Generator) -> None:
    """Random bytes in the stored formats (:func:`dtkv.kvio.random_pages`) in every page of both pools."""
    for layer in range(pool.num_layers):
        for name in ("kv", "index"):
            random_pages(pool.local(name, layer), pool.layouts[name], gen)


def fill_inputs(step: DecodeStep, seed: int) -> None:
    """The same random queries and rows on every rank (one generator per device, seeded alike)."""
    g = torch.Generator(device=step.device).manual_seed(seed)
    for x in step.inputs:
        for t in x:
            src = torch.randn(t.shape, generator=g, device=step.device) / (8 if t is x.q else 1)
            t.copy_((src.abs() / src.shape[-1] if t is x.iw else src).to(t.dtype))


def timed(fn, reps: int, warmup: int, device: torch.device, group) -> list[float]:
    """Milliseconds of ``reps`` calls, each alone (every rank starting together), after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        if group is None:
            sync(device)
        else:
            barrier(device, group)
        out.append(elapsed_ms(fn, device))
    return out


def pool_layers_that_fit(geom: Geometry, pages: int, cp: int, budget: int, extra_pools: int) -> int:
    """Pool layers per pool that fit ``budget`` bytes (``extra_pools`` more whole copies: the replicated pool)."""
    per_layer = cdiv(pages, cp) * geom.page_bytes + extra_pools * pages * geom.page_bytes
    return max(0, min(geom.num_layers, budget // max(1, per_layer)))


def phase_times(step: DecodeStep, reps: int, device: torch.device, group) -> dict[str, float]:
    """Microseconds of each phase of layer 0 alone (eager; ``reps`` launches back to back between two events)."""
    x = step.inputs[0]
    kv, index = step.pages(0)
    f = step.fields
    keys = indexer_scores(x.iq, x.iw, index, f["page_ids"], f["page_slots"], f["query_pos"],
                          layout=step.index_layout, q_fp8=step.q_fp8, backend=step.indexer_backend)  # fmt: skip
    chosen = layer_ops.local_topk(keys, step.topk, sorted=False)
    coords = step.rowbase - torch.bitwise_and(chosen, 2**32 - 1)
    idx = step.attn.indices(coords, kv, page_map=f["page_map"])
    runs = {
        "write": lambda: layer_ops.write_rows(step, kv, index, x),
        "indexer": lambda: indexer_scores(
            x.iq,
            x.iw,
            index,
            f["page_ids"],
            f["page_slots"],
            f["query_pos"],
            layout=step.index_layout,
            q_fp8=step.q_fp8,
            backend=step.indexer_backend,
        ),  # fmt: skip
        "topk": lambda: layer_ops.local_topk(keys, step.topk, sorted=False),
        "indices": lambda: step.attn.indices(
            step.rowbase - torch.bitwise_and(chosen, 2**32 - 1), kv, page_map=f["page_map"]
        ),  # fmt: skip
        "attention": lambda: step.attn.decode(x.q, kv, idx, softmax_scale=step.softmax_scale, schedule=step.schedule),
        "layer": lambda: step.layer(0, x),
    }
    if step.merges:
        runs["select_exchange"] = lambda: layer_ops.select(step, index, x)
    out = {}
    for name, fn in runs.items():
        fn()
        ms = timed(lambda fn=fn: [fn() for _ in range(reps)], 1, 0, device, group)[0]
        out[name] = 1e3 * ms / reps
    return out


def indexer_gbps(step: DecodeStep, us: float, context: int, batch: int) -> tuple[int, float]:
    """Bytes the indexer must move at this scenario and the GB/s that ``us`` per call gives."""
    ll = step.plan_layout.scored_pages
    valid = batch * min(context, ll * step.page_size) // (1 if step.mode != "sharded" else step.cp)
    nbytes = indexer_scores_bytes(num_valid_keys=valid, num_cols=batch * ll * step.page_size, num_queries=batch,
                                  heads=step.inputs[0].iq.shape[1], head_dim=step.index_layout.head_dim)  # fmt: skip
    return nbytes, nbytes / (us * 1e3)


def run_scenario(context: int, batch: int, geom: Geometry, opts: dict, *, group, device) -> list[dict]:
    """Every mode of one (context, batch) on this rank (collective over ``group``); rows for the JSONL file."""
    cp = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    ps = geom.page_size
    pages_per_req = cdiv(context, ps)
    num_pages = cdiv(batch * pages_per_req + cp, cp) * cp
    base = {"context": context, "batch": batch, "cp": cp, "layers": geom.num_layers, "device": opts["device_name"],
            "torch": torch.__version__, "date": today()}  # fmt: skip
    modes = [m for m in opts["modes"] if m in MODES]
    extra = 1 if (cp > 1 and "replicated" in modes) else 0
    pool_layers = pool_layers_that_fit(geom, num_pages, cp, opts["mem_budget"], extra)
    if pool_layers < 1:
        return [{**base, "mode": m, "graph": g, "skipped": "KV does not fit the memory budget"}
                for m in modes for g in opts["graphs"]]  # fmt: skip
    own = PageOwnership(cp, num_pages)
    pool = ShardedKVPool(geom.layouts, own, num_layers=pool_layers, group=group, device=device)
    fill_random(pool, torch.Generator(device=device).manual_seed(1234 + rank))
    repl = pool
    if cp > 1 and "replicated" in modes:
        repl = ShardedKVPool(geom.layouts, PageOwnership(1, num_pages), num_layers=pool_layers, device=device)
        for layer in range(pool_layers):
            for name, full in pool.gather_full(layer).items():
                repl.local(name, layer).copy_(full)
    alloc = PageAllocator(own)
    tables = [alloc.alloc_balanced(pages_per_req).tolist() for _ in range(batch)]
    rows, last = [], {}
    for mode in modes:
        for comm in opts["comms"] if (mode == "sharded" and cp > 1) else [opts["comms"][0]]:
            cfg = DecodeStepConfig(mode=mode, num_heads=geom.num_heads, topk=geom.topk,
                                   softmax_scale=geom.softmax_scale, max_batch=batch, max_pages=pages_per_req,
                                   num_layers=geom.num_layers, attention=opts["attention"], indexer=opts["indexer"],
                                   q_fp8=opts["q_fp8"], comm=comm)  # fmt: skip
            step = DecodeStep(repl if mode == "replicated" else pool, cfg)
            step.set_plan(tables, [context] * batch)
            step.alloc_inputs(dtype=opts["dtype"], index_heads=geom.index_heads)
            fill_inputs(step, 99)
            common = {**base, "mode": mode, "comm": comm if (cp > 1 and mode != "replicated") else "none", "pool_layers": pool_layers,
                      "attention": step.attn.name, "indexer": step.indexer_backend, "q_fp8": step.q_fp8,
                      "bytes_sent_per_step": step.comm_bytes().sent, "kv_bytes_per_rank": step.pool.bytes_per_rank()}  # fmt: skip
            ph = {}
            if opts["phases"]:
                ph = phase_times(step, 20, device, group)
                nbytes, gbps = indexer_gbps(step, ph["indexer"], context, batch)
                common.update(phase_us=ph, indexer_bytes=nbytes, indexer_gbps=gbps,
                              indexer_hbm_fraction=gbps / H200_HBM_GBPS)  # fmt: skip
            for graph in opts["graphs"]:
                if graph and device.type != "cuda":
                    continue
                if graph:
                    step.capture()
                    fn = step.replay
                else:
                    fn = step.run
                t = timed(fn, opts["reps"], opts["warmup"], device, group)
                res = fn()[-1]
                last[(mode, common["comm"], graph)] = (DecodeStep.positions(res), res.out.float())
                del res  # graph memory: released with the step
                rows.append({**common, "graph": graph, "step_ms": statistics.median(t), "step_ms_min": min(t)})
                if rank == 0 and opts["print"]:
                    print(json.dumps(rows[-1]), flush=True)
            del step
            gc.collect()
    report.add_parity(rows, last)
    del pool, repl
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _plain_indexer(q, w, pool, ids, lay) -> torch.Tensor:
    """The plain-PyTorch indexer the kernel replaces (the probe's): scores ``[N, L * S]`` float32."""
    n, ps, hd = q.shape[0], lay.page_size, lay.head_dim
    pages = pool[ids.long()]  # [N, L, S * (J + 4)]
    codes = pages[..., : ps * hd].reshape(n, -1, hd).view(torch.float8_e4m3fn).to(torch.bfloat16)
    scales = pages[..., ps * hd :].reshape(n, -1, 4).view(torch.float32).reshape(n, -1)
    s = torch.relu(torch.einsum("nhd,nsd->nhs", q, codes)).float()
    return (s * w[:, :, None]).sum(1) * scales


def indexer_sweep(geom: Geometry, opts: dict, device: torch.device) -> list[dict]:
    """The indexer kernel alone (:mod:`bench_indexer_scores`): with ``--indexer-sweep`` every candidate launch at
    every sweep shape, else the default launch at 16 queries x 128K tokens; plus the plain-torch indexer there."""
    if device.type != "cuda":
        return []
    lay = geom.layouts["index"]
    if opts["indexer_sweep"]:
        rows = isweep.sweep(device, heads=geom.index_heads, lay=lay)
    else:
        rows = isweep.sweep(device, shapes=[(16, 131072)], candidates=isweep.CANDIDATES[:1], heads=geom.index_heads,
                            lay=lay)  # fmt: skip
    n, ctx = 16, 131072
    pool = isweep.make_pool(n * ctx // lay.page_size, lay, device)
    ids, _, _ = isweep.page_sets(n, ctx, pool.shape[0], lay, device)[0]
    q = torch.randn(n, geom.index_heads, geom.index_head_dim, device=device, dtype=torch.bfloat16)
    w = torch.rand(n, geom.index_heads, device=device)
    nbytes = indexer_scores_bytes(num_valid_keys=n * ctx, num_cols=n * ctx, num_queries=n, heads=geom.index_heads,
                                  head_dim=geom.index_head_dim)  # fmt: skip
    try:
        ms = statistics.median(timed(lambda: _plain_indexer(q, w, pool, ids, lay), 3, 1, device, None))
        rows.append({"name": "plain torch (gather, fp8 -> bf16, einsum, relu, head sum)", "config": "plain torch",
                     "q_fp8": False, "queries": n, "context": ctx, "shape": f"{n}x{ctx}", "bucket": [2, 0],
                     "ms": ms, "gbps": nbytes / (ms * 1e6), "hbm_fraction": nbytes / (ms * 1e6) / H200_HBM_GBPS,
                     "bytes": nbytes, "bitwise": False, "ok": False, "max_rel_err": float("nan"),
                     "topk_agree": float("nan")})  # fmt: skip
    except torch.cuda.OutOfMemoryError:
        pass
    return rows


def run(rank: int, world: int, opts: dict, group=None, device: torch.device | None = None) -> dict:
    """The sweep on this rank (collective): ``{"rows": [...], "indexer": [...]}``, the same on every rank."""
    device = device or torch.device("cpu")
    geom = SMOKE if opts.get("smoke") else Geometry(num_layers=opts.get("layers", DSV32.num_layers))
    cuda = device.type == "cuda"
    opts = {"modes": list(MODES), "graphs": [False, True] if cuda else [False], "comms": ["nccl"], "reps": 5,
            "warmup": 1, "attention": "auto", "indexer": "auto", "q_fp8": None, "phases": cuda, "print": True,
            "indexer_sweep": False, **opts}  # fmt: skip
    opts["dtype"] = torch.bfloat16 if cuda else torch.float32
    opts["device_name"] = torch.cuda.get_device_name(device) if cuda else "cpu"
    if "mem_budget" not in opts:
        opts["mem_budget"] = int(0.7 * torch.cuda.get_device_properties(device).total_memory) if cuda else 1 << 30
    rows = []
    for context in opts["contexts"]:
        for batch in opts["batches"]:
            rows += run_scenario(context, batch, geom, opts, group=group, device=device)
    report.add_vs_replicated(rows)
    sweep = indexer_sweep(geom, opts, device) if rank == 0 else []
    return {"rows": rows, "indexer": sweep}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="32768,131072,262144,1048576", help="tokens per request, comma separated")
    p.add_argument("--batches", default="1,4,16,64", help="requests per step, comma separated")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--graphs", default="off,on", help="off, on or both (CUDA only)")
    p.add_argument("--comm", default="nccl", help="collectives of sharded decode at cp > 1: nccl, symm_mem or both")
    p.add_argument("--layers", type=int, default=DSV32.num_layers)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--attention", default="auto", help="attention seam backend (auto: FlashMLA where it runs)")
    p.add_argument("--indexer", default="auto", help="indexer op backend (auto: Triton on CUDA)")
    p.add_argument("--q-fp8", choices=("auto", "on", "off"), default="auto", help="fp8 indexer queries")
    p.add_argument("--mem-budget-gb", type=float, help="GPU memory the pools may take (default 70%% of the GPU)")
    p.add_argument("--no-phases", action="store_true", help="skip the per-phase timing of one layer")
    p.add_argument(
        "--indexer-sweep",
        action="store_true",
        help="time the indexer kernel's candidate launches at its sweep shapes (bench_indexer_scores.py)",
    )
    p.add_argument("--quick", action="store_true", help="32K and 128K x batch 1 and 4, 3 reps (~2 minutes)")
    p.add_argument("--smoke", action="store_true", help="CPU: spawn 2 gloo ranks, tiny geometry and contexts")
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    return p


def _options(ns) -> dict:
    opts = {
        "contexts": [int(x) for x in ns.contexts.split(",")],
        "batches": [int(x) for x in ns.batches.split(",")],
        "modes": ns.modes.split(","),
        "graphs": [{"off": False, "on": True}[g] for g in ns.graphs.split(",")],
        "comms": ns.comm.split(","),
        "layers": ns.layers,
        "reps": ns.reps,
        "warmup": ns.warmup,
        "attention": ns.attention,
        "indexer": ns.indexer,
        "q_fp8": {"auto": None, "on": True, "off": False}[ns.q_fp8],
        "indexer_sweep": ns.indexer_sweep,
        "smoke": ns.smoke,
    }
    if ns.no_phases:
        opts["phases"] = False
    if ns.mem_budget_gb:
        opts["mem_budget"] = int(ns.mem_budget_gb * 2**30)
    if ns.quick:
        opts.update(contexts=[32768, 131072], batches=[1, 4], reps=3)
    return opts


def _smoke_worker(rank: int, world: int, opts: dict, init_file: str, queue) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", store=dist.FileStore(init_file, world), rank=rank, world_size=world)
        out = run(rank, world, {**opts, "print": False}, group=dist.group.WORLD)
        queue.put((rank, out))
        dist.destroy_process_group()
    except BaseException as e:  # report, never hang the parent
        queue.put((rank, f"{type(e).__name__}: {e}"))


def _smoke(opts: dict) -> dict | str:
    import multiprocessing as mp
    import tempfile

    fd, init_file = tempfile.mkstemp(prefix="dtkv_bench_decode_")
    os.close(fd)
    os.unlink(init_file)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_smoke_worker, args=(r, 2, opts, init_file, queue), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    bad = [v for v in got.values() if isinstance(v, str)]
    return bad[0] if bad else got[0]


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    opts = _options(ns)
    args = argv if argv is not None else sys.argv[1:]
    if ns.smoke and "RANK" not in os.environ:
        if ns.contexts == _parser().get_default("contexts"):
            opts["contexts"] = [200, 800]
        if ns.batches == _parser().get_default("batches"):
            opts["batches"] = [1, 3]
        opts["reps"], opts["warmup"] = min(ns.reps, 2), min(ns.warmup, 1)
        opts.setdefault("phases", True)
        out = _smoke(opts)
        if isinstance(out, str):
            print(f"error: {out}", file=sys.stderr)
            return 1
        command, world = "python benchmarks/bench_decode.py " + " ".join(args), 2
    else:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        cuda = torch.cuda.is_available() and not ns.smoke
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
        group = None
        if cuda:
            torch.cuda.set_device(device)
        if world > 1:
            dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                                    device_id=device if cuda else None)  # fmt: skip
            group = dist.group.WORLD
        out = run(rank, world, opts, group=group, device=device)
        if group is not None:
            dist.barrier()
            dist.destroy_process_group()
        if rank != 0:
            return 0
        command = f"torchrun --nproc-per-node {world} benchmarks/bench_decode.py " + " ".join(args)
        tag = hardware_tag(device, world)
        out["tag"] = tag
    tag = out.get("tag") or f"cpux{world}"
    for path in report.write_results(out["rows"], out["indexer"], Path(ns.out_dir), command, tag):
        print(f"wrote {path}")
    print(report.short_summary(out["rows"], out["indexer"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
