"""PD with the prefix cache, over loopback once per engine (Mooncake TCP, NIXL/UCX; 2 gloo prefill ranks, sharded KV
with direct writes, fp8):
a request served from cached pages hands decode exactly the bytes of the same request prefilled from scratch --
same KV digest on decode, same bytes sent in total, same generated tokens -- although its pages (and so which
rank sends which of them) differ."""

from __future__ import annotations

import dataclasses

import pytest

from dtkv.model import ModelConfig, ReferenceAdapter
from dtkv.runtime import Runtime

pytestmark = [pytest.mark.multirank]

SYSTEM = [(7 * i + 3) % 97 for i in range(26)]  # six full pages and two tokens
QUESTION, OTHER = [5, 1, 4, 1, 5, 9, 2], [2, 7, 1, 8]
ARGS = {"model": "reference", "seed": 0, "dtype": None, "page_size": 4, "kv_dtype": "fp8", "decode_steps": 2,
        "timeout": 60.0, "decode": "full", "decode_cp": 1, "attention": "torch"}  # fmt: skip


def _prefill_rank(rank, world, args, cached):
    import torch.distributed as dist

    from dtkv.demo._pd import send_from_rank

    cfg = dataclasses.replace(ModelConfig(), page_size=args["page_size"], kv_dtype=args["kv_dtype"])
    eng = Runtime(ReferenceAdapter(cfg), mode="sharded_direct", group=dist.group.WORLD, num_pages=64,
                  prefix_cache=cached)  # fmt: skip
    if cached:  # an earlier request with the same system prompt leaves its pages in the cache
        earlier = eng.add_request(SYSTEM + OTHER)
        eng.prefill(16)
        eng.finish_request(earlier.rid)
    req = eng.add_request(SYSTEM + QUESTION)
    eng.prefill(16)
    report = send_from_rank(eng, args, requests=[req])  # this request alone: decode's first
    return {**report, "cached_tokens": req.cached_tokens, "pages": list(req.pages)}


@pytest.mark.slow  # > 10 s on 2 cores: outside the quick subset (-m 'not slow')
def test_a_cached_request_transfers_the_same_bytes_to_decode_as_one_prefilled_from_scratch(ranks2, transfer_engine):
    from dtkv.demo._pd import start_decode_group

    got = {}
    args = {**ARGS, "transfer_engine": transfer_engine}
    for cached in (False, True):
        decode = start_decode_group(args, [SYSTEM + QUESTION])
        ranks = ranks2.run(_prefill_rank, {**args, **decode.rank_args}, cached)
        (out,) = decode.result(timeout_s=60.0)
        assert "error" not in out, out.get("error")
        assert all(r["pd_kv_digest"] == out["kv_digest"] for r in ranks), "decode's KV must equal the sender's"
        got[cached] = (out, ranks)
    (scratch, scratch_ranks), (hit, hit_ranks) = got[False], got[True]
    assert hit_ranks[0]["cached_tokens"] == 24 and scratch_ranks[0]["cached_tokens"] == 0
    assert hit_ranks[0]["pages"] != scratch_ranks[0]["pages"]  # other pages, other senders ...
    assert hit["kv_digest"] == scratch["kv_digest"]  # ... the same bytes at every position
    assert sum(r["pd_bytes"] for r in hit_ranks) == sum(r["pd_bytes"] for r in scratch_ranks) > 0
    assert hit["outputs"] == scratch["outputs"]
