"""An engine-style paged KV pool driving dtkv: a ``req_to_token`` map and a token-slot allocator, as serving
engines keep them, turned into dtkv's page tables, on 2 gloo ranks (CPU, a few seconds).

    python examples/engine_paged_pool.py [--cp 2] [--page-size 4]

What stays the engine's (every rank runs the same scheduler decisions, SPMD):

- ``ReqToToken``: ``req_to_token[req_slot, position]`` = the token slot (``page * page_size + offset``) of each
  token of each running request, ``-1`` where none (sglang's ``ReqToTokenPool.req_to_token``, int32
  ``[max_reqs, max_context_len]``);
- ``TokenSlotAllocator``: hands out whole pages and fills the slots; here it asks :class:`dtkv.PageAllocator`
  for owner-balanced pages, so the pages of a request spread over the CP ranks that store them;
- the batch: which requests run this step and how many new tokens each computes (chunked prefill).

What dtkv owns: where each page is stored (``PageOwnership``: page ``p`` on rank ``p % cp``), the sharded pool,
the CP split of the step's tokens, the owner-filtered writes, and the full view with its remapped page table.
The bridge is :func:`page_tables`: the engine's token map -> dtkv's ``kv_indptr`` / ``kv_indices`` /
``kv_last_page_len`` (``dtkv/page_table.py``). Per step and layer the script checks that the view, read through
the remapped table, holds every row the ranks computed, then finishes a request and reuses its pages.
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
import dtkv.page_table
from dtkv import MLALatentLayout, PageAllocator, PageOwnership, ShardedKVPool, ops
from dtkv.materialize import Materializer, plan_materialize

NUM_LAYERS = 2
MAX_REQS, MAX_LEN = 4, 96


class ReqToToken:
    """The engine's request -> token-slot map: int32 ``[max_reqs, max_len]``, ``-1`` where no token is."""

    def __init__(self, max_reqs: int, max_len: int) -> None:
        self.table = torch.full((max_reqs, max_len), -1, dtype=torch.int32)
        self.lens = [0] * max_reqs


class TokenSlotAllocator:
    """The engine's allocator of token slots, page by page, over dtkv's owner-aware page allocator."""

    def __init__(self, pages: PageAllocator, page_size: int) -> None:
        self.pages, self.page_size = pages, page_size

    def extend(self, r2t: ReqToToken, slot: int, num_tokens: int) -> None:
        """Give request ``slot`` the token slots of its next ``num_tokens`` tokens (new pages where needed)."""
        start, ps = r2t.lens[slot], self.page_size
        have, need = -(-start // ps), -(-(start + num_tokens) // ps)
        if need > have:
            r2t.table[slot, have * ps : need * ps] = self._slots(self.pages.alloc_balanced(need - have))
        r2t.lens[slot] = start + num_tokens

    def free(self, r2t: ReqToToken, slot: int) -> None:
        """Release request ``slot``'s pages (the engine would hand them to its prefix cache instead)."""
        n = r2t.lens[slot]
        self.pages.free(r2t.table[slot, : n : self.page_size].to(torch.int64) // self.page_size)
        r2t.table[slot] = -1
        r2t.lens[slot] = 0

    def _slots(self, pages: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(self.page_size)
        return (pages[:, None] * self.page_size + offsets).reshape(-1).to(torch.int32)


def page_tables(r2t: ReqToToken, slots: list[int], page_size: int):
    """The engine's token map -> dtkv's page tables (``dtkv/page_table.py``) of requests ``slots``.

    Returns:
        ``kv_indptr`` int32 ``[num_reqs + 1]``, ``kv_indices`` int32 ``[kv_indptr[-1]]`` (logical pages in token
        order: the engine's page ids are dtkv's logical pages), ``kv_last_page_len`` int32 ``[num_reqs]``, and the
        dense ``req_pages`` int64 ``[num_reqs, max_pages]`` (``-1`` padded) the CP split takes.
    """
    lens = torch.tensor([r2t.lens[s] for s in slots])
    num_pages = (lens + page_size - 1) // page_size
    per_req = [r2t.table[s, : r2t.lens[s] : page_size].to(torch.int64) // page_size for s in slots]
    kv_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), num_pages.cumsum(0)]).to(torch.int32)
    kv_indices = torch.cat(per_req).to(torch.int32)
    kv_last_page_len = (lens - (num_pages - 1) * page_size).to(torch.int32)
    req_pages = torch.full((len(slots), int(num_pages.max())), -1, dtype=torch.int64)
    for i, p in enumerate(per_req):
        req_pages[i, : len(p)] = p
    return kv_indptr, kv_indices, kv_last_page_len, req_pages


def kv_rows(slot: torch.Tensor, positions: torch.Tensor, layer: int, dim: int) -> torch.Tensor:
    """Stand-in for the model's KV projection: float32 ``[num_tokens, dim]`` from (request, position, layer)."""
    base = (slot * 1000 + positions * 10 + layer).to(torch.float32)
    return base[:, None] + torch.arange(dim, dtype=torch.float32) / dim


def step(rank, cp, group, pool, ownership, r2t, alloc, batch: dict[int, int]) -> bool:
    """One prefill step of the requests ``batch`` (slot -> new tokens); whether every view row checked out."""
    ps, dim = pool.page_size, pool.layouts["kv"].row_dim
    slots = sorted(batch)
    prefix = [r2t.lens[s] for s in slots]
    for s in slots:  # engine: token slots for the new tokens
        alloc.extend(r2t, s, batch[s])
    kv_indptr, kv_indices, kv_last_page_len, req_pages = page_tables(r2t, slots, ps)
    assert torch.equal(dtkv.page_table.seq_lens_from_indptr(kv_indptr, kv_last_page_len, ps),
                       torch.tensor([r2t.lens[s] for s in slots], dtype=torch.int32))  # fmt: skip
    # dtkv: the CP split of the new tokens, each rank's rows, owner-filtered writes (all-gather, keep own pages).
    split = dtkv.plan_cp_split(prefix, [batch[s] for s in slots], cp_size=cp, page_size=ps)
    mine = split.local(rank)
    slot_of = torch.tensor(slots)[mine.req_idx]
    locs = r2t.table[slot_of, mine.positions].to(torch.int64)  # the engine's out_cache_loc of these rows
    n = max(split.local(r).num_tokens for r in range(cp))
    for layer in range(NUM_LAYERS):
        rows = torch.zeros(n, dim)
        rows[: mine.num_tokens] = kv_rows(slot_of, mine.positions, layer, dim)
        padded = torch.full((n,), -1, dtype=torch.int64)
        padded[: mine.num_tokens] = locs
        all_rows, all_locs = [torch.empty_like(rows) for _ in range(cp)], [torch.empty_like(padded) for _ in range(cp)]
        dist.all_gather(all_rows, rows, group=group)
        dist.all_gather(all_locs, padded, group=group)
        ops.write_owned(pool.local("kv", layer), torch.cat(all_rows), torch.cat(all_locs), ownership, rank)
    # dtkv: the full view (history = pages before each prefix end, current = the rest), read through the
    # remapped page table as an unmodified attention kernel would.
    hist = [int(p) for i, s in enumerate(slots) for p in req_pages[i, : prefix[i] // ps]]
    cur = [int(p) for p in kv_indices.tolist() if p not in set(hist)]
    plan = plan_materialize(hist, cur, ownership, rank, group=group)
    views = Materializer(pool, plan)
    ok = True
    for layer in range(NUM_LAYERS):
        if layer + 1 < NUM_LAYERS:
            views.prefetch(layer + 1)
        view = views.view(layer)["kv"].reshape(-1, dim)
        view_indices = ops.remap(kv_indices, plan.page_map)  # the page table the attention kernel reads
        for i, s in enumerate(slots):
            pages = view_indices[kv_indptr[i] : kv_indptr[i + 1]].to(torch.int64)
            t = torch.arange(r2t.lens[s])
            got = view[pages[t // ps] * ps + t % ps]
            ok &= torch.equal(got, kv_rows(torch.full_like(t, s), t, layer, dim))
    return ok


def run_rank(rank: int, cp: int, page_size: int, init: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=cp)
    try:
        group = dist.group.WORLD
        ownership = PageOwnership(cp, 48)
        layout = MLALatentLayout(page_size=page_size, kv_lora_rank=16, rope_dim=8, store_dtype=torch.float32)
        pool = ShardedKVPool({"kv": layout}, ownership, num_layers=NUM_LAYERS, group=group)
        r2t, alloc = ReqToToken(MAX_REQS, MAX_LEN), TokenSlotAllocator(PageAllocator(ownership), page_size)
        checks = [
            step(rank, cp, group, pool, ownership, r2t, alloc, {0: 32, 1: 9}),  # request 0's first chunk, request 1
            step(rank, cp, group, pool, ownership, r2t, alloc, {0: 13, 2: 20}),  # request 0's second chunk, request 2
        ]
        alloc.free(r2t, 1)  # request 1 finishes: its pages go back; request 3 reuses them
        checks.append(step(rank, cp, group, pool, ownership, r2t, alloc, {3: 7, 2: 5}))
        free = [alloc.pages.num_free(r) for r in range(cp)]
        say_in_rank_order(f"rank {rank}/{cp}: 3 engine steps, every view row equal to the computed rows: "
                          f"{all(checks)}; free pages per owner {free}", rank, cp, group)  # fmt: skip
        if not all(checks):
            raise SystemExit(f"rank {rank}: a view row differs from the row computed for it")
    finally:
        dist.destroy_process_group()


def say_in_rank_order(line: str, rank: int, cp: int, group) -> None:
    """Rank 0 prints every rank's ``line``, in rank order (the lines travel as bytes: one process writes)."""
    width = 1024
    data = line.encode()[:width]
    mine = torch.zeros(width, dtype=torch.uint8)
    mine[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    rows = [torch.empty_like(mine) for _ in range(cp)]
    dist.all_gather(rows, mine, group=group)
    if rank == 0:
        for row in rows:
            print(bytes(row[row != 0].tolist()).decode(errors="replace"), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, default=2, help="CP ranks to spawn (default 2)")
    p.add_argument("--page-size", type=int, default=4, help="tokens per KV page (default 4)")
    args = p.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    init = f"tcp://127.0.0.1:{_free_port()}"
    mp.start_processes(run_rank, args=(args.cp, args.page_size, init), nprocs=args.cp, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
