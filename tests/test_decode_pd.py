"""PD feeds sharded decode: a cp=2 prefill group hands its owned pages to a decode group of another cp and page
ownership (cp=3 ``block``, cp=4 ``interleave``), which decodes straight on its shards with ``decode_mode="sharded"``.

The prefill ranks run on gloo and return their pool shards; this process moves the pages between the shards with
the transfer protocol on the in-process ``LocalEngine`` (each position sent once, by its owner, to its owner on the
decode side); the decode ranks load their shards and decode 8 greedy steps (the 32-step parity runs in
``tests/test_decode_model.py``). Tokens must equal the single-process full-view decode of the same prompts, and
every layer's top-k must equal the full view's (``DTKV_DEBUG``).

A decode group with the *same* ownership as prefill needs no transfer and no page movement at all: the prefill
engine decodes on its own pool (``tests/test_decode_model.py``: no view is built and only candidates and partials
move).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dtkv import PageAllocator, PageOwnership
from dtkv._util import cdiv
from dtkv.model import ModelConfig
from dtkv.transfer import Bootstrap, DecodeReceiver, KVShard, LocalEngine, PrefillSender
from tests._runtime import reference_runtime

PROMPT_LENS = (45, 11, 3)
STEPS = 8
NUM_PAGES_P, NUM_PAGES_D = 48, 60
CFG = ModelConfig(kv_dtype="fp8", page_size=4, num_layers=2)


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _prefill_rank(rank, world, page_major=False):
    eng = reference_runtime(
        CFG, mode="sharded_direct", group=dist.group.WORLD, num_pages=NUM_PAGES_P, page_major=page_major
    )
    for p in _prompts():
        eng.add_request(p)
    eng.prefill(16)
    ps = CFG.page_size
    return {
        "buffers": {n: eng.pool.storage(n).clone() for n in CFG.layouts},  # contiguous, in the pool's layout
        "page_major": eng.pool.page_major,
        "pages": [r.pages[: cdiv(len(r.prompt), ps)] for r in eng.requests],
        "first": [r.output[0] for r in eng.requests],
    }


def _transfer(
    prefill: list[dict], cp_d: int, scheme: str, page_major_d: bool = False
) -> tuple[list[dict], list[list[int]]]:
    """Prefill shards -> decode shards of ``PageOwnership(cp_d, NUM_PAGES_D, scheme)`` over the LocalEngine."""
    own_p = PageOwnership(len(prefill), NUM_PAGES_P)
    own_d = PageOwnership(cp_d, NUM_PAGES_D, scheme)
    pre = []
    for r, res in enumerate(prefill):
        pm = res["page_major"]
        bufs = {n: b.transpose(0, 1) if pm else b for n, b in res["buffers"].items()}  # the [L, P, ...] views
        pre.append(KVShard(bufs, CFG.layouts, own_p, r, page_major=pm))
    dec = [
        KVShard.allocate(CFG.layouts, own_d, r, num_layers=CFG.num_layers, page_major=page_major_d) for r in range(cp_d)
    ]
    bootstrap = Bootstrap(dist.HashStore(), namespace="decode-pd")
    sender = PrefillSender(pre, bootstrap, engine=LocalEngine(), timeout_s=20.0)
    receiver = DecodeReceiver(dec, bootstrap, engine=LocalEngine(), timeout_s=20.0)
    sender.connect()
    receiver.connect()
    allocator = PageAllocator(own_d)  # what every decode rank's engine allocator will do, in the same order
    dst_pages = []
    try:
        for i, (src, n) in enumerate(zip(prefill[0]["pages"], PROMPT_LENS)):
            dst = allocator.alloc_balanced(len(src)).tolist()
            receiver.post_request(f"r{i}", dst, num_tokens=n)
            sender.send_request(f"r{i}", src)
            receiver.wait_request(f"r{i}")
            dst_pages.append(dst)
    finally:
        sender.close()
        receiver.close()
    return [{n: s.buffers[n].clone() for n in CFG.layouts} for s in dec], dst_pages


def _decode_rank(rank, world, shards, dst_pages, first, scheme):
    import dtkv

    eng = reference_runtime(
        CFG, mode="sharded", group=dist.group.WORLD, num_pages=NUM_PAGES_D, scheme=scheme,
        decode_mode="sharded",
    )  # fmt: skip
    for name, buf in shards[rank].items():
        eng.pool.buffer(name).copy_(buf)
    for p, pages, tok in zip(_prompts(), dst_pages, first):
        req = eng.add_request(p)
        req.pages = eng.allocator.alloc_balanced(len(pages)).tolist()
        assert req.pages == pages, "the SPMD allocator must reproduce the pages decode posted"
        req.num_computed, req.output = len(p), [tok]
    with dtkv.debug_mode():
        outputs = eng.decode(STEPS)
    return outputs, eng.stats["topk_checks"]


def _reference():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model is 40x slower on two OpenMP threads of a busy 2-core box
    try:
        eng = reference_runtime(CFG, mode="single", num_pages=NUM_PAGES_P + STEPS)
        for p in _prompts():
            eng.add_request(p)
        eng.prefill(16)
        return eng.decode(STEPS)
    finally:
        torch.set_num_threads(before)


@pytest.mark.multirank
@pytest.mark.parametrize(
    "cp_d,scheme,page_major",
    [(3, "block", (False, False)), (4, "interleave", (False, False)), (3, "block", (True, True)),
     (4, "interleave", (True, False))],
    ids=["cp2-to-cp3-block", "cp2-to-cp4", "cp2-to-cp3-block-page-major", "cp2-page-major-to-cp4-layer-major"],
)  # fmt: skip
def test_pd_into_a_decode_group_of_another_cp_then_sharded_decode(ranks2, ranks3, ranks4, cp_d, scheme, page_major):
    prefill = ranks2.run(_prefill_rank, page_major[0])
    assert prefill[0]["pages"] == prefill[1]["pages"] and prefill[0]["first"] == prefill[1]["first"]
    assert all(res["page_major"] is page_major[0] for res in prefill)
    shards, dst_pages = _transfer(prefill, cp_d, scheme, page_major[1])
    decode = ranks3 if cp_d == 3 else ranks4
    results = decode.run(_decode_rank, shards, dst_pages, prefill[0]["first"], scheme)
    want = _reference()
    for outputs, checks in results:
        assert outputs == want
        assert checks == STEPS * CFG.num_layers
