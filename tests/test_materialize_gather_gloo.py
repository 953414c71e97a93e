"""On gloo, the views' many-tensor all-gather is one all-gather per tensor, never gloo's coalesced one.

Gloo's coalesced all-gather has crashed its process when run asynchronously (pytorch/pytorch#65231, #65237); a CI
rank died of heap corruption while the other ranks waited in one. Every rank here replaces the coalesced method by one
that raises, then gathers several tensors (sync and async, awkward sizes, an empty one): the bytes must arrive and
the method must never be called.
"""

from __future__ import annotations

import pytest
import torch


def _gather_without_coalescing(rank: int, world: int) -> list[bool]:
    import torch.distributed as dist

    from dtkv.materialize import _gather

    group = dist.group.WORLD
    names = [n for n in ("all_gather_single_coalesced", "allgather_into_tensor_coalesced")
             if hasattr(dist.ProcessGroup, n)]  # fmt: skip
    saved = {n: getattr(dist.ProcessGroup, n) for n in names}
    calls = []

    def refuse(self, *args, **kwargs):
        calls.append(1)
        raise AssertionError("gloo's coalesced all-gather was called")

    for n in names:
        setattr(dist.ProcessGroup, n, refuse)
    try:
        ok = []
        for async_op in (False, True):
            sizes = [7, 1, 0, 13]
            ins = [torch.full((s, 3), rank + 10 * k, dtype=torch.uint8) for k, s in enumerate(sizes)]
            outs = [torch.empty((world * s, 3), dtype=torch.uint8) for s in sizes]
            work = _gather._all_gather_many(outs, ins, group, async_op)
            if work is not None:
                work.wait()
            for k, (o, s) in enumerate(zip(outs, sizes)):
                want = (torch.arange(world).repeat_interleave(s) + 10 * k).to(torch.uint8)
                ok.append(torch.equal(o, want[:, None].expand(-1, 3)))
        return ok + [not calls]
    finally:
        for n, f in saved.items():
            setattr(dist.ProcessGroup, n, f)


@pytest.mark.multirank
def test_gloo_gathers_each_tensor_alone_and_never_coalesces(ranks234):
    for res in ranks234.run(_gather_without_coalescing):
        assert all(res), res
