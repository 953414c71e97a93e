"""Host cost of a runtime step's input rules (:mod:`dtkv.runtime._batch`) and of failing together across the CP group.

Per batch size, p50/p90 in microseconds over ``--iters`` steps, on every rank (rank 0 prints):

- ``check``: :func:`dtkv.runtime._batch.check_batch` + :func:`check_capacity` alone (local, what one process pays);
- ``check+agree``: :func:`dtkv.runtime._batch.agreed_step`, the same checks plus the verdict and batch exchange (one
  48-byte all-gather on the group's CPU channel: gloo, also for an NCCL group, so it never waits for the GPU);
- ``vote``: the step's outcome vote after its run (:func:`dtkv.runtime._outcome.vote` of the committed state: one
  more 48-byte all-gather per step).

The reference point is the step it guards: a decode step of a real model is milliseconds, a prefill chunk more.

Usage: ``torchrun --nproc-per-node 2 benchmarks/bench_step_checks.py [--iters 500]``; writes
``step_checks_<hw>_<date>.json`` under ``$OUT`` (else ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from dtkv import PageAllocator, PageOwnership
from dtkv.runtime import _batch
from dtkv.runtime._outcome import vote

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _dist_bench as db  # noqa: E402


@dataclass
class _Req:
    rid: int
    prompt: list[int]
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0
    output: list[int] = field(default_factory=list)
    finished: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


def _time_us(fn, iters: int, group) -> tuple[float, float]:
    samples = []
    for _ in range(iters):
        dist.barrier(group)
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples), db.p90(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    rank, world, device = db.init()
    from dtkv._collectives import cpu_channel

    group = dist.group.WORLD
    channel = cpu_channel(group)
    page_size = 64
    rows = []
    for num_reqs in (1, 64, 512):
        requests = [_Req(rid=i, prompt=[1] * 4096, num_computed=1024, pages=list(range(16))) for i in range(num_reqs)]
        alloc = PageAllocator(PageOwnership(world, 64 * num_reqs * world))
        lens = [64] * num_reqs

        def check(requests=requests, lens=lens, alloc=alloc):
            out = _batch.check_batch(requests, requests, lens)
            _batch.check_capacity(requests, out, page_size=page_size, allocator=alloc)
            return out

        agreed_step = functools.partial(
            _batch.agreed_step, group, what="bench", check=check, value=functools.partial(_batch.batch_value, requests)
        )
        state = {"num_computed": [r.num_computed for r in requests], "num_pages": [len(r.pages) for r in requests],
                 "free_pages": alloc.num_free()}  # fmt: skip
        local = _time_us(check, args.iters, channel)
        agreed = _time_us(agreed_step, args.iters, channel)
        voted = _time_us(functools.partial(vote, group, None, what="bench", value=state), args.iters, channel)
        rows.append({"num_reqs": num_reqs, "check_us": local, "check_agree_us": agreed, "vote_us": voted})
    tag = db.hardware_tag(device, world)
    if rank == 0:
        path = db.out_dir(args.out_dir) / f"step_checks_{tag}_{db.today()}.json"
        path.write_text(json.dumps({"world": world, "device": str(device), "rows": rows, **db.versions()}, indent=1))
        for r in rows:
            print(
                f"num_reqs={r['num_reqs']:4d}  check p50/p90 {r['check_us'][0]:8.1f}/{r['check_us'][1]:8.1f} us  "
                f"check+agree {r['check_agree_us'][0]:8.1f}/{r['check_agree_us'][1]:8.1f} us  "
                f"vote {r['vote_us'][0]:8.1f}/{r['vote_us'][1]:8.1f} us"
            )
        print(f"step checks ({tag}): wrote {path}")
    db.finish()


if __name__ == "__main__":
    main()
