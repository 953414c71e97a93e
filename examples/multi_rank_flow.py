"""The multi-rank flow a model writes on dtkv, end to end, on 2 gloo ranks (CPU, a few seconds).

    python examples/multi_rank_flow.py [--cp 2] [--page-size 4]

Every rank runs the same SPMD program:

1. pool: a :class:`dtkv.ShardedKVPool` holding only the pages this rank owns (``PageOwnership``: page ``p`` lives
   on rank ``p % cp``);
2. split: :func:`dtkv.plan_cp_split` cuts each request's new tokens over the ranks, and
   :func:`dtkv.allocate_for_split` takes pages so that the rank computing a page also stores it;
3. writes: each rank computes the KV rows of its own tokens (here a stand-in function of request, position and
   layer) and writes them where :func:`dtkv.split.local_locs` says, with :func:`dtkv.ops.write_owned`:
   directly when every page has one compute owner, else after an all-gather, each rank keeping its own rows;
4. view: :func:`dtkv.materialize.plan_materialize` plans the full view of the batch and
   :class:`dtkv.materialize.Materializer` gathers it per layer, with a remapped page table
   (:func:`dtkv.ops.remap`) that an unmodified attention kernel would read.

The script checks every view row against the rows the ranks computed and prints one line per rank.
Copy it, replace ``kv_rows`` with your model's projection, and keep the rest.
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
from dtkv import MLALatentLayout, PageAllocator, PageOwnership, ShardedKVPool, ops
from dtkv.materialize import Materializer, plan_materialize
from dtkv.page_table import pages_to_locs

PROMPT_LENS = [37, 11, 1]  # three new requests: awkward sizes, a partial last page, a one-token request
NUM_LAYERS = 2


def kv_rows(req_idx: torch.Tensor, positions: torch.Tensor, layer: int, dim: int) -> torch.Tensor:
    """Stand-in for a model's KV projection: float32 ``[num_tokens, dim]``, a function of (request, position,
    layer) only, so any rank can recompute what another rank wrote."""
    base = (req_idx * 1000 + positions * 10 + layer).to(torch.float32)
    return base[:, None] + torch.arange(dim, dtype=torch.float32) / dim


def run_rank(rank: int, cp: int, page_size: int, init: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=cp)
    try:
        group = dist.group.WORLD
        layout = MLALatentLayout(page_size=page_size, kv_lora_rank=16, rope_dim=8, store_dtype=torch.float32)
        ownership = PageOwnership(cp, 64)
        # 1. the pool: this rank's pages only (collective: every rank checks the others' configuration).
        pool = ShardedKVPool({"kv": layout}, ownership, num_layers=NUM_LAYERS, group=group)

        # 2. the split and the pages (plan phase: host work, identical on every rank).
        split = dtkv.plan_cp_split([0] * len(PROMPT_LENS), PROMPT_LENS, cp_size=cp, page_size=page_size)
        allocation = dtkv.allocate_for_split(PageAllocator(ownership), split)
        direct = all(allocation.verify_direct_write(r) for r in range(cp))  # the same answer on every rank

        # 3. the writes of this rank's rows, layer by layer.
        mine = split.local(rank)
        locs = allocation.local_locs(rank)
        for layer in range(NUM_LAYERS):
            rows = kv_rows(mine.req_idx, mine.positions, layer, layout.row_dim)
            if direct:  # every page has one compute owner: write straight into the own pool
                ops.write_owned(pool.local("kv", layer), rows, locs, ownership, rank, direct=True)
            else:  # some pages straddle ranks: everyone gets every row, each keeps the rows of its pages
                n = max(split.local(r).num_tokens for r in range(cp))  # all-gathers take equal sizes: pad
                padded_rows = torch.zeros(n, layout.row_dim)
                padded_rows[: len(rows)] = rows
                padded_locs = torch.full((n,), -1, dtype=torch.int64)  # location -1: a row every write skips
                padded_locs[: len(locs)] = locs
                all_rows = [torch.empty_like(padded_rows) for _ in range(cp)]
                all_locs = [torch.empty_like(padded_locs) for _ in range(cp)]
                dist.all_gather(all_rows, padded_rows, group=group)
                dist.all_gather(all_locs, padded_locs, group=group)
                ops.write_owned(pool.local("kv", layer), torch.cat(all_rows), torch.cat(all_locs), ownership, rank)

        # 4. the full view of the batch, per layer (every page is "current": written this step).
        pages = allocation.req_pages[allocation.req_pages >= 0]
        plan = plan_materialize([], pages, ownership, rank, group=group)
        views = Materializer(pool, plan)
        ok = True
        for layer in range(NUM_LAYERS):
            view = views.view(layer)["kv"].reshape(-1, layout.row_dim)  # [view_pages * page_size, row_dim]
            for req, n in enumerate(PROMPT_LENS):
                req_locs = pages_to_locs(allocation.req_pages[req], page_size, n)
                got = view[ops.remap(req_locs, plan.page_map, page_size=page_size)]
                want = kv_rows(torch.full((n,), req), torch.arange(n), layer, layout.row_dim)
                ok &= torch.equal(got, want)
        stored = pool.bytes_per_rank() / pool.replicated_bytes()
        say_in_rank_order(
            f"rank {rank}/{cp}: {mine.num_tokens} rows computed, {'direct' if direct else 'owner-filtered'} writes, "
            f"view of {plan.num_view_pages} pages equal to the computed rows: {ok}; stores {stored:.2f} of the pool",
            rank, cp, group,
        )  # fmt: skip
        if not ok:
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
    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors run the ops' torch backend anyway
    init = f"tcp://127.0.0.1:{_free_port()}"
    mp.start_processes(run_rank, args=(args.cp, args.page_size, init), nprocs=args.cp, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
