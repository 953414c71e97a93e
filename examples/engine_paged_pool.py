"""An engine-style paged KV pool on dtkv's main path, on 2 gloo ranks (CPU, a few seconds; NCCL on 2 GPUs):

    python examples/engine_paged_pool.py [--cp 2] [--page-size 4]

The engine keeps a ``req_to_token`` map (``ReqToToken``, sglang's ``ReqToTokenPool.req_to_token``: int32
``[max_reqs, max_len]``, the token slot ``page * page_size + offset`` of every token, ``-1`` where none) and its
scheduler's batches; dtkv gives it, per batch (every rank runs the same decisions, SPMD):

1. the CP split of the batch's new tokens (:func:`dtkv.plan_cp_split`) and pages from the compute owner of each
   page (:func:`dtkv.allocate_for_split`), so each rank writes its own rows straight into its own pages;
2. the fused fp8 writes (MLA rows and indexer keys in the pools' byte formats) with ``direct=True``; only rows on a
   page another rank stores (a chunk starting mid-page) travel, in one small all-gather, to an owner-filtered write;
3. the full view: ONE :class:`dtkv.materialize.Materializer`, built at start-up for the largest batch and
   :meth:`~dtkv.materialize.Materializer.replan`-ned per batch (nothing allocated per batch), captured into CUDA
   graphs where CUDA is present, read through the remapped page table (:func:`dtkv.ops.remap`).

Per batch and layer the script checks that the view holds, at every remapped slot, the bytes of every row the ranks
computed, then finishes a request and reuses its pages. ``docs/engines.md`` puts each call in an engine's hooks.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dtkv
from dtkv import IndexerFp8Layout, MLAFp8Layout, PageAllocator, PageOwnership, ShardedKVPool, ops
from dtkv.materialize import Materializer, plan_materialize

NUM_LAYERS, MAX_REQS, MAX_LEN = 2, 4, 96
ROWS = {"kv": 64 + 16, "index": 32}  # dims per token: MLA latent + rope, indexer key (DeepSeek-V3.2: 512 + 64, 128)


def layouts(page_size: int) -> dict:
    """The pools' byte formats: fp8 MLA rows (e4m3 latent, fp32 scales, bf16 rope) and the fp8 indexer page."""
    return {"kv": MLAFp8Layout(page_size=page_size, kv_lora_rank=64, rope_dim=16, quant_block=32),
            "index": IndexerFp8Layout(page_size=page_size, head_dim=32)}  # fmt: skip


def kv_rows(name: str, req: torch.Tensor, pos: torch.Tensor, layer: int) -> torch.Tensor:
    """Stand-in for the model's projections: float32 ``[num_tokens, dim]`` from (request, position, layer)."""
    base = torch.sin(req[:, None] * 1.3 + pos[:, None] * 0.1 + layer + torch.arange(ROWS[name]) * 0.07)
    return (base * (1 + pos[:, None] % 5)).float()


def write(pool, name: str, layer: int, rows, locs, own, rank: int, group, rows_of: dict) -> None:
    """This rank's rows of ``name``: straight into its own pages, the rest (``rows_of["handoff"]``, on a page
    another rank stores) through one all-gather padded to ``rows_of["width"]`` and an owner-filtered write."""
    put = ops.quantize_write_mla_fp8 if name == "kv" else ops.quantize_write_indexer_fp8
    d, h, width, lay = rows_of["direct"], rows_of["handoff"], rows_of["width"], pool.layouts[name]
    put(pool.local(name, layer), rows[d], locs[d], own, rank, layout=lay, direct=True)
    if width:  # only when a page straddles ranks (a chunk that starts mid-page): every rank takes part
        sent = [torch.zeros(width, rows.shape[1], device=rows.device), torch.full((width,), -1, device=rows.device)]
        sent[0][: len(h)], sent[1][: len(h)] = rows[h], locs[h]
        got = [[torch.empty_like(t) for _ in range(dist.get_world_size(group))] for t in sent]
        for bufs, t in zip(got, sent):
            dist.all_gather(bufs, t, group=group)
        put(pool.local(name, layer), torch.cat(got[0]), torch.cat(got[1]), own, rank, layout=lay)


def view_rows(name: str, view: torch.Tensor, slots: torch.Tensor, lay) -> torch.Tensor:
    """The stored bytes (kv) or dequantized keys (index) at view ``slots``: what an attention kernel reads."""
    if name == "kv":
        return view.reshape(-1, lay.row_bytes)[slots]
    return ops.dequantize_indexer_pages(view, lay).reshape(-1, lay.head_dim)[slots]


def expected(name: str, rows: torch.Tensor, lay) -> torch.Tensor:
    if name == "kv":
        return ops.quantize_mla_fp8(rows, lay)
    q, scale = ops.quantize_indexer_fp8(rows)
    return q.view(torch.float8_e4m3fn).float() * scale[:, None]


def step(rank, cp, group, pool, own, alloc, r2t, lens, mat, batch: dict[int, int]) -> tuple[bool, int, int]:
    """One prefill step of ``batch`` (request slot -> new tokens): whether every view row checked out, and this
    rank's rows written directly and handed off."""
    ps, dev = pool.page_size, pool.device
    slots = sorted(batch)
    prefix = [lens[s] for s in slots]
    # plan phase (host; identical on every rank): split, compute-owner pages, the engine's token slots, the view plan
    split = dtkv.plan_cp_split(prefix, [batch[s] for s in slots], cp_size=cp, page_size=ps)
    table = torch.full((len(slots), MAX_LEN // ps), -1, dtype=torch.int64)
    for i, s in enumerate(slots):
        table[i, : -(-prefix[i] // ps)] = r2t[s, : prefix[i] : ps].long() // ps
    got = dtkv.allocate_for_split(alloc, split, table)
    for i, s in enumerate(slots):
        lens[s] += batch[s]
        pages = got.req_pages[i, : -(-lens[s] // ps)]
        r2t[s, : lens[s]] = (pages[:, None] * ps + torch.arange(ps)).reshape(-1)[: lens[s]].int()
    hist = [int(p) for i in range(len(slots)) for p in got.req_pages[i, : prefix[i] // ps]]
    cur = [int(p) for i, s in enumerate(slots) for p in got.req_pages[i, prefix[i] // ps : -(-lens[s] // ps)]]
    mat.replan(plan_materialize(hist, cur, own, rank, device=dev, group=group))  # no allocation, no sync
    if dev.type == "cuda":
        mat.capture()  # every layer's gathers as CUDA graphs, for this plan (replan drops them)
    mine = split.local(rank)
    req, pos = torch.tensor(slots)[mine.req_idx], mine.positions
    locs = got.local_locs(rank)  # the engine's out_cache_loc of this rank's rows
    away = [own.owner(got.local_locs(r) // ps) != r for r in range(cp)]  # rows on a page another rank stores
    rows_of = {"direct": torch.nonzero(~away[rank]).flatten().to(dev), "handoff": torch.nonzero(away[rank]).flatten(),
               "width": max(int(a.sum()) for a in away)}  # fmt: skip
    rows_of["handoff"], locs = rows_of["handoff"].to(dev), locs.to(dev)
    ok = True
    for layer in range(NUM_LAYERS):  # run phase: tensors only
        for name in ROWS:
            write(pool, name, layer, kv_rows(name, req, pos, layer).to(dev), locs, own, rank, group, rows_of)
        mat.prefetch(layer + 1)  # the next layer's history pages, in flight while this layer attends
        views = mat.view(layer)  # valid until prefetch(layer + 2) or replan: read it in this layer only
        for s in slots:
            t = torch.arange(lens[s])
            slots_ = ops.remap(r2t[s, : lens[s]].long().to(dev), mat.plan.page_map, page_size=ps)
            for name, lay in pool.layouts.items():
                want = expected(name, kv_rows(name, torch.full_like(t, s), t, layer), lay)
                ok &= torch.equal(view_rows(name, views[name], slots_, lay).cpu(), want)
    return ok, len(rows_of["direct"]), len(rows_of["handoff"])


def run_rank(rank: int, cp: int, page_size: int, init: str) -> None:
    cuda = torch.cuda.device_count() >= cp
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=cp)
    try:
        group, dev = dist.group.WORLD, torch.device("cuda", rank) if cuda else torch.device("cpu")
        own = PageOwnership(cp, -(-MAX_REQS * MAX_LEN // page_size))  # a page for every slot of req_to_token
        pool = ShardedKVPool(layouts(page_size), own, num_layers=NUM_LAYERS, group=group, device=dev)
        alloc, r2t, lens = PageAllocator(own), torch.full((MAX_REQS, MAX_LEN), -1, dtype=torch.int32), [0] * MAX_REQS
        # start-up: one Materializer for the largest batch (every rank, same arguments: collective); its plan is
        # the empty batch. A history group of its own lets captured prefetches replay beside other collectives.
        most = 2 * cp * -(-own.num_pages // cp)  # here a batch may read every page: both groups, padded per owner
        mat = Materializer(pool, plan_materialize([], [], own, rank, device=dev, group=group), max_view_pages=most,
                           history_group=dist.new_group(list(range(cp))) if cuda else None)  # fmt: skip
        before = mat.capacity_pages
        checks = [step(rank, cp, group, pool, own, alloc, r2t, lens, mat, {0: 32, 1: 9}),
                  step(rank, cp, group, pool, own, alloc, r2t, lens, mat, {0: 13, 2: 20})]  # fmt: skip
        alloc.free(r2t[1, : lens[1] : page_size].long() // page_size)  # request 1 finishes; request 3 reuses its pages
        r2t[1], lens[1] = -1, 0
        checks.append(step(rank, cp, group, pool, own, alloc, r2t, lens, mat, {3: 7, 2: 8}))
        ok, direct, handoff = all(c[0] for c in checks), sum(c[1] for c in checks), sum(c[2] for c in checks)
        line = (f"rank {rank}/{cp} on {dev}: 3 engine steps, {direct} rows written directly, {handoff} handed off; "
                f"one Materializer replanned ({before} view pages, {mat.capacity_pages - before} allocated since "
                f"start-up); fp8 views equal to the computed rows: {ok}; free pages per owner "
                f"{[alloc.num_free(r) for r in range(cp)]}")  # fmt: skip
        data = torch.zeros(1024, dtype=torch.uint8)  # rank 0 prints every rank's line, in order (bytes, no pickle)
        data[: len(line.encode())] = torch.tensor(list(line.encode()), dtype=torch.uint8)
        lines = [torch.empty_like(data) for _ in range(cp)]
        dist.all_gather(lines, data.to(dev), group=group)
        if rank == 0:
            print("\n".join(bytes(x[x != 0].tolist()).decode() for x in lines), flush=True)
        if not ok:
            raise SystemExit(f"rank {rank}: a view row differs from the row computed for it")
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, default=2, help="CP ranks to spawn (default 2)")
    p.add_argument("--page-size", type=int, default=4, help="tokens per KV page (default 4)")
    args = p.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors run the ops' torch backend anyway
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    mp.start_processes(run_rank, args=(args.cp, args.page_size, init), nprocs=args.cp, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
