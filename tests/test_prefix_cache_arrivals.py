"""The prefix cache under requests that arrive between chunk steps, bitwise against the same workload without it.

Chunks that are not multiples of the page size leave a request mid-page after a step; a request that arrives then
and shares its prompt must reuse only the pages that are full of computed KV. Arrivals run their first chunk in a
step of their own (the requests under way write nothing in it), then join the others. (Caching a request's partly computed
last page -- the cache's key cut at ``ceil(num_computed / page_size)`` pages instead of the full ones -- passed the
rest of the suite, although the arriving request then read KV nobody wrote: A steps 3 of 10 tokens, B arrives with
A's first 8 tokens, and B's logits moved by 0.46.) Every request's prompt logits, greedy tokens, decode logits and
stored KV bytes must equal the run without the cache, bit for bit (the reference model computes in float64 with a
fixed summation order per row, so a token's results do not depend on the rows sharing its step).
"""

from __future__ import annotations

import pytest
import torch

from dtkv.model import ModelConfig, ReferenceAdapter
from dtkv.runtime import Runtime

PS = 4
CFG = ModelConfig(page_size=PS, num_layers=2)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


A = _tokens(10, 0)
# tick -> prompts arriving before that tick's step; they share A's prefix at and off page edges, and each other's
ARRIVALS = {
    0: [A],
    1: [A[:8], A[:3] + _tokens(6, 1)],  # A is mid-page (3 or 5 or 7 of 10 computed): only full pages may be reused
    2: [A + _tokens(5, 2), A[:8]],  # A's whole prompt and more; B's prompt again
    4: [A[:9] + _tokens(9, 3), _tokens(1, 4)],  # late: A is done, its last partial page is not cached
}
DECODE_STEPS = 3


def _serve(cache: bool, chunk: int) -> dict:
    rt = Runtime(ReferenceAdapter(CFG), num_pages=64, prefix_cache=cache)
    first_logits: dict[int, torch.Tensor] = {}
    tick = 0

    def step(todo) -> None:
        lens = [min(chunk, len(r.prompt) - r.num_computed) for r in todo]
        out = rt.step(todo, lens)
        for r, row in zip(todo, out):
            if r.num_computed == len(r.prompt):
                first_logits[r.rid] = row
                r.output.append(int(row.argmax()))

    while tick <= max(ARRIVALS) or any(r.num_computed < len(r.prompt) for r in rt.requests):
        new = [rt.add_request(p) for p in ARRIVALS.get(tick, [])]
        if new and tick:  # the arrivals' first chunk alone: the requests under way do not write in this step
            step(new)
        todo = [r for r in rt.requests if r.num_computed < len(r.prompt)]
        if todo:
            step(todo)
        tick += 1
    outputs, decode_logits = rt.decode(DECODE_STEPS, return_logits=True)
    kv = [rt.kv_bytes(r.rid) for r in rt.requests]
    hits = rt.stats["prefix_hit_tokens"]
    rt.close()
    return {"first": first_logits, "outputs": outputs, "decode": decode_logits, "kv": kv, "hits": hits}


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 6, 7])
def test_requests_arriving_between_chunk_steps_reuse_only_full_pages_bitwise(chunk):
    base, cached = _serve(False, chunk), _serve(True, chunk)
    assert cached["hits"] > 0, "the workload must hit the cache"
    assert sorted(cached["first"]) == sorted(base["first"]) == list(range(7))
    for rid in base["first"]:
        assert torch.equal(cached["first"][rid], base["first"][rid]), f"request {rid}'s prompt logits"
    assert cached["outputs"] == base["outputs"]
    for a, b in zip(cached["decode"], base["decode"]):
        assert torch.equal(a, b)
    for rid, (a, b) in enumerate(zip(cached["kv"], base["kv"])):
        for name in a:
            assert torch.equal(a[name], b[name]), f"request {rid}'s stored {name!r} bytes"
