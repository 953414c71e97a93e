"""Sharded decode against full-view decode at DeepSeek-V3.2 geometry: step time and bytes moved per step.

GPU (the measurement, 2 H200 with NCCL; about 2 minutes; ``--view-backend all_gather`` pins the baseline's gather)::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 torchrun --nproc-per-node 2 benchmarks/bench_decode.py

CPU smoke (spawns 2 gloo ranks, tiny geometry; what the test suite runs)::

    python benchmarks/bench_decode.py --smoke

Scenario: ``B`` requests of ``T`` tokens each are decoding one token (the ``T``-th) on ``cp`` ranks. The KV is
random bytes in the real stored formats (656-byte fp8 MLA rows with valid scales, 8448-byte indexer pages at page
size 64), filled straight into a :class:`dtkv.ShardedKVPool` with ``interleave`` ownership -- no prefill. One
*step* runs all ``--layers`` layers' attention part (61 for DeepSeek-V3.2: no dense layers, queries are random)
and per layer writes the ``B`` new rows (owner-filtered fp8 quantize-writes, both modes) and then either

- ``sharded``: :func:`dtkv.decode.decode_layer` -- indexer over the rank's own pages, local top-k, candidate
  all-gather, global top-k, attention over the owned selected rows, LSE merge of the all-gathered partials; or
- ``full_view``: today's path at its best -- the layer's full view of the batch's pages gathered by
  :class:`dtkv.materialize.Materializer` a layer ahead on a side stream (``write_current=True``: the new rows are
  written into the view as well, so nothing is gathered after the writes; all-gather or copy engines, as the
  Materializer picks), then the same :func:`dtkv.decode.decode_layer` over the view as one rank (identical math,
  nothing to merge).

Both run eager (host launch overhead included), float32 scoring and attention on fp8/bf16 KV, top-k 2048, 128
heads, ``kv_lora_rank`` 512 + 64 rope, 64 indexer heads x 128. Per scenario: ``--warmup`` steps, then ``--reps``
steps timed one by one with CUDA events (median reported). Bytes are what one rank sends per step to the
collectives (:func:`dtkv.decode.sharded_decode_comm_bytes` / :func:`dtkv.decode.full_view_comm_bytes`; it
receives ``cp - 1`` times as much). The two modes run on the same pool: ``topk_agree`` is the fraction of queries
whose sharded selection equals the full view's, ``out_rel_diff`` the largest relative difference of the last
layer's output (float32 GEMMs over other shapes round differently: near-ties at the K-th place may swap).

Writes ``benchmarks/results/decode_<device>x<cp>_<date>.jsonl`` and ``.md`` (``--out-dir``), and the same files
under ``$OUT`` when that variable is set. Rank 0 prints one JSON line per scenario.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("dtkv") is None:  # a checkout that is not installed: use it as is
    sys.path.insert(0, str(ROOT))

from dtkv import (  # noqa: E402
    IndexerFp8Layout,
    MLAFp8Layout,
    PageAllocator,
    PageOwnership,
    ShardedKVPool,
    ops,
)
from dtkv._util import cdiv  # noqa: E402
from dtkv.decode import (  # noqa: E402
    DecodeQueries,
    decode_layer,
    full_view_comm_bytes,
    plan_decode,
    sharded_decode_comm_bytes,
)
from dtkv.materialize import Materializer, plan_materialize  # noqa: E402


@dataclass(frozen=True, kw_only=True, slots=True)
class Geometry:
    """Model and cache geometry of the sweep."""

    num_heads: int = 128
    """Attention heads (MQA over the latent row)."""
    kv_lora_rank: int = 512
    """Latent dims."""
    rope_dim: int = 64
    """Rope dims."""
    quant_block: int = 128
    """Latent dims per fp8 scale."""
    index_heads: int = 64
    """Indexer heads."""
    index_head_dim: int = 128
    """Indexer dims."""
    topk: int = 2048
    """Keys each query attends to."""
    page_size: int = 64
    """Tokens per page."""
    num_layers: int = 61
    """Layers per step."""

    @property
    def layouts(self) -> dict[str, object]:
        kv = MLAFp8Layout(
            page_size=self.page_size,
            kv_lora_rank=self.kv_lora_rank,
            rope_dim=self.rope_dim,
            quant_block=self.quant_block,
        )
        return {"index": IndexerFp8Layout(page_size=self.page_size, head_dim=self.index_head_dim), "kv": kv}


DSV32 = Geometry()
SMOKE = Geometry(
    num_heads=4, kv_lora_rank=64, rope_dim=16, quant_block=32, index_heads=2, index_head_dim=32, topk=48, page_size=16,
    num_layers=2,
)  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class Result:
    """One scenario and mode, as written to the JSONL file."""

    mode: str
    """``sharded`` or ``full_view``."""
    context: int
    """Tokens per request (including the one decoded)."""
    batch: int
    """Requests decoding together."""
    cp: int
    layers: int
    step_ms: float
    """Median wall time of one decode step (all layers), CUDA events on GPU."""
    step_ms_min: float
    layer_ms: float
    """``step_ms / layers``."""
    bytes_sent_per_step: int
    """Bytes one rank contributes to the step's collectives."""
    bytes_received_per_step: int
    collectives_per_step: int
    kv_bytes_per_rank: int
    """This rank's pool (all layers)."""
    scratch_bytes_per_rank: int
    """Full-view buffers (0 for sharded decode)."""
    transient_bytes_per_rank: int
    """Peak GPU memory above the pool during the mode's steps: views, temporaries (0 on CPU)."""
    gather_backend: str
    """How the mode moves bytes: ``all_gather`` (candidates, partials) or the Materializer's backend."""
    topk_agree: float
    out_rel_diff: float
    device: str
    torch: str
    date: str


def _fill_random(pool: ShardedKVPool, geom: Geometry, gen: torch.Generator) -> None:
    """Random bytes in the stored formats: e4m3 codes without NaN, positive fp32 scales, bf16 rope."""
    kv, index = pool.layouts["kv"], pool.layouts["index"]
    for layer in range(pool.num_layers):
        buf = pool.local("kv", layer)
        buf.random_(0, 256, generator=gen)
        codes = buf[..., : kv.kv_lora_rank]
        codes.masked_fill_((codes & 0x7F) == 0x7F, 0x7E)  # 0x7F/0xFF are NaN in e4m3fn
        buf[..., kv.scale_offset : kv.rope_offset].view(torch.float32).uniform_(2e-3, 4e-3, generator=gen)
        buf[..., kv.rope_offset :].view(torch.bfloat16).normal_(generator=gen)
        ib = pool.local("index", layer)
        ib.random_(0, 256, generator=gen)
        icodes = ib[:, : index.scale_offset]
        icodes.masked_fill_((icodes & 0x7F) == 0x7F, 0x7E)
        ib[:, index.scale_offset :].view(torch.float32).uniform_(2e-3, 4e-3, generator=gen)


def _timed(step, reps: int, warmup: int, device: torch.device, group) -> list[float]:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(reps):
        if group is not None:
            dist.barrier(group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def run_scenario(
    context: int,
    batch: int,
    geom: Geometry,
    *,
    group,
    device: torch.device,
    reps: int,
    warmup: int,
    verify: bool = False,
    view_backend: str = "auto",
) -> list[Result]:
    """Both modes of one (context, batch) on this rank (collective over ``group``).

    With ``verify`` one extra full-view step checks every view row against the owners' bytes (tests).
    """
    cp = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    ps, layers = geom.page_size, geom.num_layers
    pages_per_req = cdiv(context, ps)
    num_pages = cdiv(batch * pages_per_req + cp, cp) * cp
    own = PageOwnership(cp, num_pages)
    pool = ShardedKVPool(geom.layouts, own, num_layers=layers, group=group, device=device)
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    _fill_random(pool, geom, gen)
    alloc = PageAllocator(own)
    tables = [alloc.alloc_balanced(pages_per_req).tolist() for _ in range(batch)]
    seq_lens = [context] * batch
    plan = plan_decode(tables, seq_lens, own, rank, page_size=ps, topk=geom.topk, device=device)
    # inputs identical on every rank: one seeded generator, then moved
    g = torch.Generator().manual_seed(99)
    f32 = lambda *s: torch.randn(*s, generator=g).to(device)  # noqa: E731
    queries = [
        DecodeQueries(
            iq=f32(batch, geom.index_heads, geom.index_head_dim),
            iw=f32(batch, geom.index_heads) / geom.index_heads,
            q_nope=f32(batch, geom.num_heads, geom.kv_lora_rank),
            q_rope=f32(batch, geom.num_heads, geom.rope_dim),
        )
        for _ in range(layers)
    ]
    new_kv = [f32(batch, geom.kv_lora_rank + geom.rope_dim).to(torch.bfloat16) for _ in range(layers)]
    new_ik = [f32(batch, geom.index_head_dim).to(torch.bfloat16) for _ in range(layers)]
    kv_lay, idx_lay = pool.layouts["kv"], pool.layouts["index"]
    scale = 1.0 / math.sqrt(128 + geom.rope_dim)  # DeepSeek-V3: qk_nope_head_dim 128 + rope
    spec = own.spec

    def write(layer: int) -> None:
        ops.quantize_write_mla_fp8(
            pool.local("kv", layer), new_kv[layer], plan.new_locs, spec, rank, layout=kv_lay, validate=False
        )
        ops.quantize_write_indexer_fp8(
            pool.local("index", layer), new_ik[layer], plan.new_locs, spec, rank, layout=idx_lay, validate=False
        )

    last = {}

    def sharded_step() -> None:
        for layer in range(layers):
            write(layer)
            last["sharded"] = decode_layer(
                pool.local("kv", layer), pool.local("index", layer), kv_lay, idx_lay, plan, queries[layer],
                softmax_scale=scale, group=group,
            )  # fmt: skip

    cuda = device.type == "cuda"

    def mark() -> int:
        if not cuda:
            return 0
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)

    def above(base: int) -> int:
        return torch.cuda.max_memory_allocated(device) - base if cuda else 0

    times, transient = {}, {}
    base = mark()
    times["sharded"] = _timed(sharded_step, reps, warmup, device, group)
    transient["sharded"] = above(base)
    # full view, the engine's best: every page a layer ahead (write_current: the step's rows are written into the
    # view too, so nothing is gathered after the writes); the Materializer picks all-gather or copy engines
    base = mark()
    hist = [p for t in tables for p in t[:-1]]
    cur = [t[-1] for t in tables]
    mat_plan = plan_materialize(hist, cur, own, rank, device=device, group=group, write_current=True)
    view_tables = mat_plan.page_map.to("cpu", torch.int64)[torch.tensor(tables)]
    view_own = PageOwnership(1, mat_plan.num_view_pages)
    view_plan = plan_decode(view_tables, seq_lens, view_own, 0, page_size=ps, topk=geom.topk, device=device)
    view_locs = ops.remap(plan.new_locs, mat_plan.page_map, page_size=ps)
    mat = Materializer(pool, mat_plan, backend=view_backend)
    check = False

    def full_view_step() -> None:
        mat.prefetch(0)
        for layer in range(layers):
            write(layer)
            mat.prefetch(layer + 1)
            views = mat.view(layer)
            ops.quantize_write_mla_fp8(
                views["kv"], new_kv[layer], view_locs, view_own.spec, 0, layout=kv_lay, validate=False
            )
            ops.quantize_write_indexer_fp8(
                views["index"], new_ik[layer], view_locs, view_own.spec, 0, layout=idx_lay, validate=False
            )
            if check:  # every view row equals its owner's bytes, the rows written into the view included
                mat.check(layer)
            last["full_view"] = decode_layer(
                views["kv"], views["index"], kv_lay, idx_lay, view_plan, queries[layer], softmax_scale=scale, group=None
            )

    times["full_view"] = _timed(full_view_step, reps, warmup, device, group)
    transient["full_view"] = above(base)
    a, b = last["sharded"], last["full_view"]
    agree = float((a.positions.sort(dim=1).values == b.positions.sort(dim=1).values).all(dim=1).float().mean())
    rel = float((a.out - b.out).abs().max() / b.out.abs().max().clamp(min=1e-30))
    if verify:  # one more step with new rows, checked (collective, synchronizing: never timed)
        for t in new_kv + new_ik:
            t.copy_(torch.randn(t.shape, generator=g).to(t))
        check = True
        full_view_step()
    page_bytes = sum(lay.page_bytes for lay in geom.layouts.values())
    comm = {
        "sharded": sharded_decode_comm_bytes(
            num_queries=batch, topk=geom.topk, num_heads=geom.num_heads, kv_lora_rank=geom.kv_lora_rank, cp_size=cp
        ).scaled(layers),
        "full_view": full_view_comm_bytes(
            max_pages_per_rank=mat_plan.history_rows_per_rank + mat_plan.current_rows_per_rank,
            page_bytes=page_bytes, cp_size=cp,
            num_collectives=int(mat_plan.history_rows_per_rank > 0) + int(mat_plan.current_rows_per_rank > 0),
        ).scaled(layers),
    }  # fmt: skip
    scratch = {"sharded": 0, "full_view": mat.scratch_bytes()}
    backend = {"sharded": "all_gather" if cp > 1 else "local", "full_view": mat.backend}
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out = []
    for mode in ("sharded", "full_view"):
        t = times[mode]
        out.append(
            Result(
                mode=mode,
                context=context,
                batch=batch,
                cp=cp,
                layers=layers,
                step_ms=statistics.median(t),
                step_ms_min=min(t),
                layer_ms=statistics.median(t) / layers,
                bytes_sent_per_step=comm[mode].sent,
                bytes_received_per_step=comm[mode].received,
                collectives_per_step=comm[mode].num_collectives,
                kv_bytes_per_rank=pool.bytes_per_rank(),
                scratch_bytes_per_rank=scratch[mode],
                transient_bytes_per_rank=transient[mode],
                gather_backend=backend[mode],
                topk_agree=agree,
                out_rel_diff=rel,
                device=dev_name,
                torch=torch.__version__,
                date=datetime.date.today().isoformat(),
            )  # fmt: skip
        )
    return out


def run(rank: int, world: int, opts: dict, group=None, device: torch.device | None = None) -> list[dict]:
    """The sweep on this rank (collective); every rank returns the same list of result dicts."""
    device = device or torch.device("cpu")
    geom = SMOKE if opts.get("smoke") else Geometry(num_layers=opts.get("layers", DSV32.num_layers))
    rows = []
    for context in opts["contexts"]:
        for batch in opts["batches"]:
            for r in run_scenario(
                context,
                batch,
                geom,
                group=group,
                device=device,
                reps=opts["reps"],
                warmup=opts["warmup"],
                verify=opts.get("verify", False),
                view_backend=opts.get("view_backend", "auto"),
            ):
                rows.append(asdict(r))
                if rank == 0 and opts.get("print", True):
                    print(json.dumps(rows[-1]), flush=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the scenario's pool and views are gone: give their memory back
    return rows


def summary_markdown(rows: list[dict], command: str) -> str:
    """The results as a markdown table: sharded vs full view per scenario."""
    r0 = rows[0]
    lines = [
        f"# Sharded decode vs full-view decode -- {r0['date']}",
        "",
        f"- **Hardware**: {r0['cp']}x {r0['device']}; torch {r0['torch']}.",
        f"- **Command**: `{command}`",
        f"- **Per step**: {r0['layers']} layers, each writing the new rows and attending (eager, host launch cost "
        "included); bytes are what one rank sends to the step's collectives (it receives `cp - 1` times that).",
        "",
        "| context | batch | sharded ms | full view ms | speedup | sharded MB sent | full view MB sent | bytes ratio "
        "| KV MB per rank | transient MB sharded / full view | top-k agree | out rel diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_key = {}
    for r in rows:
        by_key.setdefault((r["context"], r["batch"]), {})[r["mode"]] = r
    for (context, batch), m in sorted(by_key.items()):
        s, f = m["sharded"], m["full_view"]
        lines.append(
            f"| {context} | {batch} | {s['step_ms']:.2f} | {f['step_ms']:.2f} | {f['step_ms'] / s['step_ms']:.2f}x | "
            f"{s['bytes_sent_per_step'] / 1e6:.2f} | {f['bytes_sent_per_step'] / 1e6:.1f} | "
            f"{f['bytes_sent_per_step'] / max(1, s['bytes_sent_per_step']):.0f}x | "
            f"{s['kv_bytes_per_rank'] / 1e6:.0f} | "
            f"{s['transient_bytes_per_rank'] / 1e6:.0f} / {f['transient_bytes_per_rank'] / 1e6:.0f} | "
            f"{s['topk_agree']:.2f} | {s['out_rel_diff']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def write_results(rows: list[dict], out_dir: Path, command: str) -> list[Path]:
    """Write ``decode_<device>x<cp>_<date>.jsonl`` and ``.md`` into ``out_dir`` (and ``$OUT`` if set)."""
    r0 = rows[0]
    tag = "h200" if "H200" in r0["device"] else ("cpu" if r0["device"] == "cpu" else "gpu")
    stem = f"decode_{tag}x{r0['cp']}_{r0['date']}"
    paths = []
    for d in [out_dir] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else []):
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{stem}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (d / f"{stem}.md").write_text(summary_markdown(rows, command))
        paths += [d / f"{stem}.jsonl", d / f"{stem}.md"]
    return paths


def _smoke_worker(rank: int, world: int, opts: dict, init_file: str, queue) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", store=dist.FileStore(init_file, world), rank=rank, world_size=world)
        rows = run(rank, world, {**opts, "print": False}, group=dist.group.WORLD)
        queue.put((rank, rows))
        dist.destroy_process_group()
    except BaseException as e:  # report, never hang the parent
        queue.put((rank, f"{type(e).__name__}: {e}"))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="32768,65536,131072,262144", help="tokens per request, comma separated")
    p.add_argument("--batches", default="1,4", help="requests per step, comma separated")
    p.add_argument("--layers", type=int, default=DSV32.num_layers)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--view-backend",
        choices=("auto", "all_gather", "copy_engine"),
        default="auto",
        help="how the full-view baseline gathers (the Materializer's backend; auto picks by size and topology)",
    )
    p.add_argument("--smoke", action="store_true", help="CPU: spawn 2 gloo ranks, tiny geometry and contexts")
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    return p


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    opts = {
        "contexts": [int(x) for x in ns.contexts.split(",")],
        "batches": [int(x) for x in ns.batches.split(",")],
        "layers": ns.layers,
        "reps": ns.reps,
        "warmup": ns.warmup,
        "smoke": ns.smoke,
        "view_backend": ns.view_backend,
    }
    command = "python " + " ".join([Path(sys.argv[0]).as_posix()] + (argv if argv is not None else sys.argv[1:]))
    if ns.smoke and "RANK" not in os.environ:
        import multiprocessing as mp
        import tempfile

        if ns.contexts == _parser().get_default("contexts"):
            opts["contexts"] = [200, 800]
        opts["reps"], opts["warmup"] = min(ns.reps, 3), min(ns.warmup, 1)
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
        if bad:
            print(f"error: {bad[0]}", file=sys.stderr)
            return 1
        rows = got[0]
        for r in rows:
            print(json.dumps(r))
    else:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        cuda = torch.cuda.is_available() and not ns.smoke
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        group = None
        if world > 1:
            dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
            group = dist.group.WORLD
        rows = run(rank, world, opts, group=group, device=device)
        if group is not None:
            dist.barrier()
            dist.destroy_process_group()
        if rank != 0:
            return 0
        command = "torchrun --nproc-per-node " + str(world) + " " + command.removeprefix("python ")
    for path in write_results(rows, Path(ns.out_dir), command):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
