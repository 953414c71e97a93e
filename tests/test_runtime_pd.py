"""PD from a prefill CP group of N ranks into a decode group of M ranks (N, M in 1..4, N != M allowed), over loopback
once per engine (Mooncake TCP, NIXL/UCX; the rank groups are shared by both), with the runtime on both sides
(:mod:`dtkv.runtime.pd`).

Both groups run at once (two gloo groups, one per side; the store lives in this process). The prefill group prefills
three requests (one and a partial page, one token short of a page, a long one), sends them and decodes them itself;
the decode group receives every position straight into its owner's page (``PageOwnership(M, ...)``: no relayout, no
full copy on any rank) and decodes sharded. What must hold:

- the KV bytes on the decode owners equal the prefill's bytes (a digest over every layer and pool);
- the decode group's greedy tokens equal the prefill group's (reference model: sharded decode agrees with full-view
  decode to 1e-9, ``tests/test_decode_model.py``; transformers model: also the model's own greedy tokens);
- each decode rank stores 1/M of the pool (its pages only);
- a fault injected mid-handoff -- a prefill rank's engine call failing on the last request, one decode rank failing
  alone, or one decode rank's metadata row forged -- makes *every* decode rank raise ``TransferError`` for that
  request (nothing reported OK that is not), leaves the earlier requests ready and correct, and the failed request's
  pages come back through ``reclaim`` only once no rank quarantines them.

The full grid (16 pairs) runs with ``DTKV_TEST_LONG=1``; every CI run covers N and M each at every size (three pairs
and the three faults' pairs).
"""

from __future__ import annotations

import itertools
import os
import threading
import uuid

import pytest
import torch

from tests._multirank import RankGroup

pytestmark = [pytest.mark.multirank]

PROMPT_LENS = (6, 3, 37)  # the long request last: every prefill rank sends a share of it
STEPS = 4
TIMEOUT_S = 30.0


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _runtime(args, group, *, decode: bool):
    from tests._runtime import runtime

    world = 1 if group is None else group.size()
    page_major = args.get("page_major", (False, False))[1 if decode else 0]
    kw = {"kv_dtype": args["kv_dtype"], "page_size": 4, "num_pages": 24 * max(world, 1), "page_major": page_major}
    if decode:
        kw.update(decode_mode="sharded", scheme=args.get("decode_scheme", "interleave"))
    else:
        kw.update(split=args.get("split", "zigzag"))
    return runtime(args["model"], group=group, **kw)


def _store(args):
    from dtkv.transfer import Bootstrap, create_store

    return Bootstrap(create_store(port=args["port"], is_master=False, timeout_s=60.0), namespace=args["namespace"])


def _prefill_rank(rank, world, args):
    import torch.distributed as dist

    from dtkv.runtime.pd import kv_digest, request_bytes, request_id, send_prefilled, shard_for
    from dtkv.transfer import PrefillSender, TransferError

    rt = _runtime(args, dist.group.WORLD if world > 1 else None, decode=False)
    prompts = _prompts(rt.model_spec.vocab_size)
    for p in prompts:
        rt.add_request(p)
    rt.prefill(16)
    kv = [rt.kv_bytes(r.rid) for r in rt.requests]
    digest, digest2 = kv_digest(kv, [len(p) for p in prompts]), kv_digest(kv[:2], [len(p) for p in prompts[:2]])
    shard = shard_for(rt, staging_bytes=request_bytes(rt, [len(p) for p in prompts]))
    sender = PrefillSender(shard, _store(args), engine=args["engine"], timeout_s=TIMEOUT_S)
    if args.get("fault") == "prefill_engine" and rank == args["fault_rank"]:
        _fail_last_request(sender, request_id(len(prompts) - 1))
    error = None
    try:
        sender.connect()
        send_prefilled(rt, sender)
    except TransferError as e:
        error = str(e)
    finally:
        sender.close()
    outputs = rt.decode(STEPS)
    rt.close()
    return {"digest": digest, "digest_first_two": digest2, "outputs": outputs, "error": error}


def _fail_last_request(sender, last: str) -> None:
    """The sender's first engine call of request ``last`` fails (the others' shares of it land)."""
    armed = {"on": False}
    send, write = sender.send_request, sender.engine.write

    def send_request(request_id, *a, **kw):
        armed["on"] = request_id == last
        return send(request_id, *a, **kw)

    def failing_write(*a, **kw):
        if armed["on"]:
            armed["on"] = False
            return -1  # what the engine returns for a failed call
        return write(*a, **kw)

    sender.send_request, sender.engine.write = send_request, failing_write


def _decode_rank(rank, world, args):
    import time

    import torch.distributed as dist

    from dtkv.runtime.pd import kv_digest, receive_prefilled, reclaim, request_bytes, request_id, shard_for
    from dtkv.transfer import DecodeReceiver, TransferError

    rt = _runtime(args, dist.group.WORLD if world > 1 else None, decode=True)
    prompts = _prompts(rt.model_spec.vocab_size)
    if args.get("fault") == "other_prompt":  # every decode rank is given another prompt of the same length
        prompts[2] = [(t + 1) % rt.model_spec.vocab_size for t in prompts[2]]
    free_before = rt.allocator.num_free()
    shard = shard_for(rt, staging_bytes=request_bytes(rt, [len(p) for p in prompts]))
    receiver = DecodeReceiver(shard, _store(args), engine=args["engine"], timeout_s=TIMEOUT_S)
    fault = args.get("fault") if rank == args.get("fault_rank") else None
    if fault in ("decode_alone", "forged_meta"):
        _break_last_receive(receiver, request_id(len(prompts) - 1), fault)
    error = None
    try:
        receiver.connect()
        receive_prefilled(rt, receiver, prompts)
    except TransferError as e:
        error = str(e)
    ready = [r.rid for r in rt.requests if not r.finished]
    digest = kv_digest([rt.kv_bytes(rid) for rid in ready], [len(prompts[rid]) for rid in ready])
    held = sum(len(p) for p in rt.transfer_held.values())
    outputs = rt.decode(STEPS)
    deadline = time.monotonic() + 3 * TIMEOUT_S
    freed = []
    while rt.transfer_held and time.monotonic() < deadline:  # collective: every rank loops the same number of times
        freed += reclaim(rt, receiver, timeout_s=0.5)
    receiver.close()
    rt.close()
    return {
        "error": error,
        "ready": ready,
        "digest": digest,
        "outputs": outputs,
        "held": held,
        "freed": len(freed),
        "still_held": len(rt.transfer_held),
        "free_lost": free_before - rt.allocator.num_free(),
        "pages_in_use": sum(len(r.pages) for r in rt.requests),
        "page_major": rt.pool.page_major,
        "bytes_per_rank": rt.pool.bytes_per_rank(),
        "replicated_bytes": rt.pool.replicated_bytes(),
    }


def _break_last_receive(receiver, last: str, how: str) -> None:
    """On this decode rank only: the last request fails here after its bytes landed, or its metadata row is
    forged (another first token) -- the other ranks see nothing wrong locally."""
    receive = receiver.receive_request

    def receive_request(request_id, *a, **kw):
        report = receive(request_id, *a, **kw)
        if request_id == last:
            if how == "decode_alone":
                from dtkv.transfer import TransferError

                raise TransferError("injected: this rank lost its share", request_id=request_id, peer="test")
            meta = next(iter(receiver.shards.values())).meta
            meta[0, 8] ^= 1  # the first token's low bit
        return report

    receiver.receive_request = receive_request


@pytest.fixture(scope="module")
def groups():
    made: dict[tuple[str, int], RankGroup] = {}

    def get(role: str, size: int) -> RankGroup:
        if (role, size) not in made:
            made[(role, size)] = RankGroup(size, timeout_s=600)
        return made[(role, size)]

    yield get
    for g in made.values():
        g.close()


def _handoff(groups, n: int, m: int, **args) -> tuple[list[dict], list[dict]]:
    from dtkv.transfer import create_store

    store = create_store(port=0, is_master=True, timeout_s=60.0)
    args = {"model": "reference", "kv_dtype": "fp8", **args, "port": store.port, "namespace": uuid.uuid4().hex}
    prefill: list = []
    thread = threading.Thread(target=lambda: prefill.extend(groups("prefill", n).run(_prefill_rank, args)))
    thread.start()
    try:
        decode = groups("decode", m).run(_decode_rank, args)
    finally:
        thread.join(timeout=600)
    assert not thread.is_alive() and len(prefill) == n, "the prefill group did not finish"
    return prefill, decode


def _check_ok(prefill, decode, m: int) -> None:
    p0 = prefill[0]
    assert all(p["error"] is None for p in prefill), [p["error"] for p in prefill]
    for d in decode:
        assert d["error"] is None, d["error"]
        assert d["ready"] == [0, 1, 2]
        assert d["digest"] == p0["digest"], "the decode owners must hold the prefill's bytes"
        assert d["outputs"] == p0["outputs"], "decode must continue with the prefill group's greedy tokens"
        assert d["bytes_per_rank"] * m == d["replicated_bytes"], "a decode rank stores its own pages only"
        assert d["held"] == d["still_held"] == 0


GRID = list(itertools.product((1, 2, 3, 4), (1, 2, 3, 4)))
COVERING = {(1, 3), (2, 4), (4, 1)}  # with the fault cases' (2, 3), (3, 2), (2, 2): every N and M at every size
LONG = [pytest.mark.slow, pytest.mark.skipif(os.environ.get("DTKV_TEST_LONG", "0") != "1", reason="DTKV_TEST_LONG=1")]


@pytest.mark.parametrize(
    ("n", "m"),
    [pytest.param(n, m, marks=() if (n, m) in COVERING else LONG) for n, m in GRID],
    ids=[f"prefill{n}-decode{m}" for n, m in GRID],
)
def test_n_to_m_handoff_writes_each_page_once_on_its_decode_owner(groups, n, m, transfer_engine):
    prefill, decode = _handoff(groups, n, m, engine=transfer_engine, decode_scheme="block" if m == 3 else "interleave")
    _check_ok(prefill, decode, m)


@pytest.mark.parametrize(
    ("n", "m", "page_major"),
    [(2, 3, (True, True)), (3, 2, (False, True)), (1, 2, (True, False))],
    ids=["page-major-both-prefill2-decode3", "layer-major-into-page-major-prefill3-decode2",
         "page-major-into-layer-major-prefill1-decode2"],
)  # fmt: skip
def test_page_major_pools_on_either_side(groups, n, m, page_major, transfer_engine):
    """Page-major pools (``Runtime(page_major=True)``) on both sides or one: the decode owners hold the prefill's
    bytes and decode on them."""
    prefill, decode = _handoff(groups, n, m, engine=transfer_engine, page_major=page_major)
    _check_ok(prefill, decode, m)
    assert all(d["page_major"] is page_major[1] for d in decode)


@pytest.mark.parametrize(
    ("n", "m", "fault", "fault_rank"),
    [(2, 3, "prefill_engine", 1), (3, 2, "decode_alone", 1), (2, 2, "forged_meta", 0), (2, 3, "other_prompt", None)],
    ids=[
        "prefill-engine-call-fails", "one-decode-rank-fails-alone", "one-decode-rank-metadata-forged",
        "decode-given-another-prompt-of-the-same-length",
    ],
)  # fmt: skip
def test_a_fault_mid_handoff_fails_every_decode_rank_and_reports_nothing_ok(
    groups, n, m, fault, fault_rank, transfer_engine
):
    """``other_prompt``: the decode side is given another prompt of the same length for the last request (prompts
    in another order, say): the metadata row's prompt digest differs, so no rank decodes its KV under that prompt."""
    prefill, decode = _handoff(groups, n, m, engine=transfer_engine, fault=fault, fault_rank=fault_rank)
    errors = [d["error"] for d in decode]
    from dtkv.runtime.pd import request_id

    assert all(e is not None and request_id(2) in e for e in errors), errors  # every rank, the same request
    if fault == "other_prompt":
        assert all("prompt digest" in e and "another prompt of 37 tokens" in e for e in errors), errors
    p0 = prefill[0]
    for d in decode:
        assert d["ready"] == [0, 1], "the earlier requests stay ready; the failed one never is"
        assert d["outputs"][:2] == p0["outputs"][:2] and d["outputs"][2] == []
        assert d["held"] > 0 and d["still_held"] == 0 and d["freed"] == d["held"]  # back once no rank holds them
        assert d["free_lost"] == d["pages_in_use"], "every page is held by a live request or back in the pool"
        assert d["digest"] == p0["digest_first_two"], "the ready requests hold the prefill's bytes"


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("DTKV_TEST_LONG", "0") != "1", reason="DTKV_TEST_LONG=1 (demo and PD tests cover it)"
)
def test_transformers_model_from_two_prefill_ranks_into_three_decode_ranks(groups, transfer_engine):
    """GLM-5 with a layer that reuses the previous top-k: decode tokens equal the model's own greedy tokens."""
    pytest.importorskip("transformers", reason="the hf extra (transformers==5.17.0)")
    prefill, decode = _handoff(groups, 2, 3, engine=transfer_engine, model="glm5-shared", kv_dtype="bf16")
    _check_ok(prefill, decode, 3)
    from dtkv.integrations.transformers import geometry_of, kv_layouts, reference_logits
    from tests._runtime import tiny_lm

    lm = tiny_lm("glm5-shared")
    layouts = kv_layouts(geometry_of(lm), "bf16", 1)  # the reference reads keys as the pools store them
    for p, out in zip(_prompts(256), decode[0]["outputs"]):
        ref = reference_logits(lm, p + out[:-1], layouts=layouts)
        assert ref[len(p) - 1 :].argmax(-1).tolist() == out
