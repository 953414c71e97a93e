"""A step that fails on one CP rank fails on every rank, and every rank undoes it (:mod:`dtkv.runtime._outcome`).

The fault is injected where it happens in production: in the LM head of one rank (an out-of-memory error on one
GPU), after the step's last collective, so the other ranks have finished the step. Every rank then raises the same
error naming the failing rank, every rank is back where it was before the step (requests, allocator with its
cursor, prefix cache with its evictions and insertions, stats, the KV of every computed token and cached page), and
the serving loop goes on: the tokens and the state at the end are a fault-free run's. Without the vote one rank
rolled back while the others kept the step, and the ranks stepped the same requests from different positions
(``replicated`` prefill stored wrong KV; sharded decode's greedy tokens parted ways).

Also: ranks whose requests stand at different positions (a broken SPMD contract) raise before any collective.
Gloo, 2 and 3 ranks, the reference model (float64).
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from dtkv.model import ModelConfig, ReferenceAdapter
from dtkv.runtime import Runtime

CFG = ModelConfig(page_size=4, num_layers=2)
PROMPTS = ((0, 13), (1, 6), (2, 1))  # (seed, length): partial last pages, a one-token prompt
CHUNK = 3  # not a multiple of the page size: steps end mid-page


def _prompts(vocab: int) -> list[list[int]]:
    return [torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(s)).tolist() for s, n in PROMPTS]


class _FailOnce:
    """``adapter.logits`` that raises on its ``at``-th call (the LM head, after the step's last collective)."""

    def __init__(self, logits, at: int) -> None:
        self.logits, self.at, self.calls = logits, at, 0

    def __call__(self, hidden):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("injected fault in the LM head")
        return self.logits(hidden)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def _state(rt: Runtime) -> dict:
    """Everything a step may change that later steps read (collective: the KV of every computed token)."""
    alloc = rt.allocator
    state = {
        "requests": [(r.rid, list(r.pages), r.num_computed, r.finished) for r in rt.requests],  # outputs: the loop's
        "allocator": alloc.digest(),
        "refcounts": [alloc.refcount(p) for p in range(alloc.ownership.num_pages)],
        "free": [alloc.num_free(o) for o in range(alloc.ownership.cp_size)],
        "stats": dict(rt.stats),
        "kv": [{n: _digest(t) for n, t in sorted(rt.kv_bytes(r.rid).items())} for r in rt.requests if not r.finished],
    }
    if rt.prefix_cache is not None:
        from dtkv.pool import gather_pages

        cache = rt.prefix_cache
        pages = torch.tensor(cache.cached_pages(), dtype=torch.int64)
        cached = {}
        for name in sorted(rt.pool.layouts):
            for layer in range(rt.model_spec.num_layers):
                full = gather_pages(rt.pool.local(name, layer), rt.ownership, rt.pool.group)
                cached[f"{name}{layer}"] = _digest(full[pages].cpu())
        state["cache"] = (cache.digest().hex(), cache.cached_pages(), dict(cache.stats), cached)
    return state


CASES = {
    # kwargs of the runtime, pool pages, decode steps, whether cached pages fill the pool first (so steps evict)
    "replicated_prefill": (dict(mode="replicated"), None, 4, False),
    "sharded_decode": (dict(decode_mode="sharded"), None, 4, False),
    "sharded_decode_cache": (dict(decode_mode="sharded", prefix_cache=True), 11, 4, True),
    "balanced_prefill_cache": (dict(mode="sharded", split="round_robin", prefix_cache=True), 8, 2, True),
}
PREFILL_FAULT = ("replicated_prefill", "balanced_prefill_cache")


def _single_run(prompts, *, decode_steps: int) -> dict:
    rt = Runtime(ReferenceAdapter(CFG), num_pages=64)
    for p in prompts:
        rt.add_request(p)
    rt.prefill(CHUNK)
    rt.decode(decode_steps)
    return {"outputs": [list(r.output) for r in rt.requests], "state": _state(rt)}


def _refused(fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares what every rank raised
        return type(e).__name__, str(e)
    return "", ""


def _serve(rank, world, case: str, fail_rank: int | None) -> dict:
    """One run of ``case`` on every rank, ``fail_rank``'s LM head failing once (``None``: a fault-free run).

    Prefill cases fail the serving loop's second step; decode cases the third decode step (the one that opens a
    page, evicting with a cache)."""
    import torch.distributed as dist

    kw, num_pages, decode_steps, warm = CASES[case]
    group = dist.group.WORLD if world > 1 else None
    rt = Runtime(ReferenceAdapter(CFG), num_pages=num_pages or 12 * world, group=group, **kw)
    if warm:  # two finished requests leave 4 cached pages behind (only the cache holds them): steps evict them
        for seed in (10, 11):
            w = rt.add_request(
                torch.randint(0, CFG.vocab_size, (9,), generator=torch.Generator().manual_seed(seed)).tolist()
            )
            rt.prefill(CHUNK)
            rt.finish_request(w.rid)
        assert rt.prefix_cache.num_pages == 4
    reqs = [rt.add_request(p) for p in _prompts(CFG.vocab_size)]
    fail = _FailOnce(rt.adapter.logits, at=0)
    if rank == fail_rank:
        rt.adapter.logits = fail
    out: dict = {}
    if case in PREFILL_FAULT:
        snaps: list[dict] = []
        fail.at = fail.calls + 2
        out["error"] = _refused(lambda: rt.prefill(CHUNK, progress=lambda k, n: snaps.append(_state(rt))))
        before = snaps[0]
    else:
        rt.prefill(CHUNK)
        rt.decode(2)
        fail.at = fail.calls + 1
        before = _state(rt)
        out["error"] = _refused(lambda: rt.decode(decode_steps - 2))
    out["rolled_back"] = _state(rt) == before
    rt.prefill(CHUNK)  # the serving loop goes on (a no-op once every prompt is computed)
    rt.decode(decode_steps - len(reqs[0].output) + 1)
    if warm:
        out["evicted"] = rt.prefix_cache.stats["evicted_pages"]
    out["outputs"] = [list(r.output) for r in reqs]
    out["state"] = _state(rt)
    rt.close()
    return out


def _fault_and_twin(rank, world, case):
    faulty = _serve(rank, world, case, fail_rank=world - 1)
    clean = _serve(rank, world, case, fail_rank=None)
    single = _single_run(_prompts(CFG.vocab_size), decode_steps=CASES[case][2])
    return {"faulty": faulty, "clean": clean, "single": single}


@pytest.mark.parametrize(
    "world", [1, pytest.param(2, marks=pytest.mark.multirank), pytest.param(3, marks=pytest.mark.multirank)]
)
@pytest.mark.parametrize("case", list(CASES))
def test_a_fault_after_the_last_collective_fails_every_rank_and_the_loop_goes_on(request, world, case):
    """World 1 is one process (no group, no vote): the same rollback."""
    if world == 1:
        results = [_fault_and_twin(0, 1, case)]
    else:
        results = request.getfixturevalue(f"ranks{world}").run(_fault_and_twin, case)
    what = "step" if case in PREFILL_FAULT else "decode step"
    for rank, res in enumerate(results):
        faulty, clean, single = res["faulty"], res["clean"], res["single"]
        kind, message = faulty["error"]
        want = f"Runtime {what} failed on 1 of {world} ranks; rank {world - 1}: RuntimeError: injected fault"
        if world == 1:
            want = "injected fault in the LM head"
        assert kind == "RuntimeError" and want in message, (rank, kind, message)
        assert faulty["rolled_back"], f"rank {rank} kept part of the failed step"
        assert faulty["outputs"] == clean["outputs"] == single["outputs"], rank  # the tokens of one process
        assert faulty["state"] == clean["state"], rank  # bitwise, and the rank's own counters (stats)
        shared = {k: v for k, v in faulty["state"].items() if k != "stats"}
        assert shared == {k: v for k, v in results[0]["faulty"]["state"].items() if k != "stats"}, rank
        if case == "replicated_prefill":  # a replicated pool is allocated as one process's: the same state
            assert faulty["state"]["requests"] == single["state"]["requests"]
            assert faulty["state"]["kv"] == single["state"]["kv"]
        if case in ("sharded_decode_cache", "balanced_prefill_cache"):
            assert faulty["evicted"] == clean["evicted"] > 0, "the failed step must have evicted cached pages"


def _host(rt: Runtime) -> tuple:
    alloc = rt.allocator
    return [(list(r.pages), r.num_computed, list(r.output)) for r in rt.requests], alloc.digest(), dict(rt.stats)


def _diverged(rank, world):
    import torch.distributed as dist

    rt = Runtime(ReferenceAdapter(CFG), num_pages=12 * world, group=dist.group.WORLD, decode_mode="sharded")
    for p in _prompts(CFG.vocab_size):
        rt.add_request(p)
    rt.prefill(CHUNK)
    if rank == 1:  # as if this rank alone had undone request 0's last token
        rt.requests[0].num_computed -= 1
    before = _host(rt)
    got = [_refused(lambda: rt.step([rt.requests[0]], [1])), _refused(lambda: rt.decode(1))]
    got.append(_refused(lambda: rt.kv_bytes(0)))
    if rank == 1:  # a page taken on this rank alone (its free pages differ)
        rt.allocator.alloc([0])
        rt.requests[0].num_computed += 1
    got.append(_refused(lambda: rt.step([rt.requests[1]], [1])))
    unchanged = before == _host(rt) if rank == 0 else None
    rt.close()
    return {"refused": got, "unchanged": unchanged}


@pytest.mark.multirank
def test_ranks_whose_requests_stand_at_different_positions_fail_before_any_collective(ranks2):
    """The step's agreement covers each request's ``num_computed`` and page count (and the free pages), so a
    diverged rank raises on every rank, naming the field, before the step's first collective; nothing changes."""
    results = ranks2.run(_diverged)
    for res in results:
        (k1, m1), (k2, m2), (k3, m3), (k4, m4) = res["refused"]
        assert k1 == "ConfigMismatchError" and "field 'num_computed[0]' differs (rank 0: 13, rank 1: 12)" in m1, m1
        assert k2 == "ConfigMismatchError" and "field 'extend_lens.len' differs (rank 0: 3, rank 1: 2)" in m2, m2
        assert k3 == "ConfigMismatchError" and "Runtime.kv_bytes" in m3, m3
        assert k4 == "ConfigMismatchError" and "field 'free_pages' differs (rank 0: 17, rank 1: 16)" in m4, m4
    assert results[0]["unchanged"]


# ------------------------------------------------------------------------------------------- the decode loop
def _counting_gathers():
    """Count the agreement headers (48-byte all-gathers of :mod:`dtkv._agree`)."""
    import dtkv._agree as agree_mod

    seen: list[bool] = []
    real = agree_mod.all_gather_into

    def counted(out, x, group, *, async_op=False):
        if x.numel() == 48:
            seen.append(async_op)
        return real(out, x, group, async_op=async_op)

    agree_mod.all_gather_into = counted
    return seen, lambda: setattr(agree_mod, "all_gather_into", real)


def _loop(rank, world, decode_mode: str, mode: str, fault: str | None) -> dict:
    """``decode(6)`` on every rank: the headers it sends, and (``fault``) what a fault at its fourth step does:
    ``"lm_head"`` raises in the last rank's LM head, ``"diverge"`` commits an extra token of request 0 on the last
    rank, ``"progress"`` lets the last rank's progress callback move request 0 (a broken SPMD contract)."""
    import torch.distributed as dist

    rt = Runtime(ReferenceAdapter(CFG), num_pages=12 * world, group=dist.group.WORLD, decode_mode=decode_mode,
                 mode=mode)  # fmt: skip
    for p in _prompts(CFG.vocab_size):
        rt.add_request(p)
    rt.prefill(CHUNK)
    rt.decode(1)
    seen, restore = _counting_gathers()
    out: dict = {}
    steps = {"n": 0}
    progress = None
    last = rank == world - 1
    if fault == "lm_head" and last:
        rt.adapter.logits = _FailOnce(rt.adapter.logits, at=4)
    if fault == "diverge" and last:
        real_commit = rt._commit

        def commit(reqs, lens):
            real_commit(reqs, lens)
            steps["n"] += 1
            if steps["n"] == 4:
                reqs[0].num_computed += 1

        rt._commit = commit
    if fault == "progress":

        def progress(k, n):
            if k == 3 and last:
                rt.requests[0].num_computed -= 1

    snaps: list[dict] = []
    real_step = rt._decode_step

    def snap_step(reqs, **kw):
        snaps.append(_host(rt))
        return real_step(reqs, **kw)

    rt._decode_step = snap_step
    try:
        out["error"] = _refused(lambda: rt.decode(6, progress=progress))
    finally:
        restore()
    out["headers"] = seen
    out["rolled_back"] = _host(rt) == snaps[3] if len(snaps) > 3 else None
    if fault in (None, "lm_head"):
        rt._decode_step = real_step
        rt.decode(6 - (len(rt.requests[0].output) - 2))  # the loop goes on to the same tokens
        out["outputs"] = [list(r.output) for r in rt.requests]
    rt.close()
    return out


@pytest.mark.multirank
@pytest.mark.parametrize(("decode_mode", "mode"), [("sharded", None), ("full", None), ("full", "replicated")])
def test_the_decode_loop_votes_while_a_step_runs_and_agrees_on_inputs_once_a_call(ranks234, decode_mode, mode):
    """Six steps of one ``decode()`` call send seven agreement headers, not twelve: the first step's input
    agreement, then one vote a step (started as the step leaves its block: it travels while the step runs and is
    awaited before the step's tokens are taken), standing for the next step's input agreement. (Full-view decode
    over page-sharded pools also agrees on each step's view plan, a digest of the pages themselves: six more.)"""
    results = ranks234.run(_loop, decode_mode, mode, None)
    views = 6 if decode_mode == "full" and mode is None else 0
    for res in results:
        assert res["error"] == ("", "")
        assert len(res["headers"]) == 7 + views, res["headers"]
        assert res["outputs"] == results[0]["outputs"]


@pytest.mark.multirank
def test_a_fault_inside_a_decode_call_fails_every_rank_and_the_loop_goes_on(ranks3):
    """A fault in the last rank's LM head at the fourth step of a call (a step with no input agreement of its own):
    every rank raises it at the step's vote, every rank undoes the step, and the loop goes on to the tokens of a
    fault-free run."""
    faulty = ranks3.run(_loop, "sharded", None, "lm_head")
    clean = ranks3.run(_loop, "sharded", None, None)
    for res, ok in zip(faulty, clean):
        kind, message = res["error"]
        assert kind == "RuntimeError" and "Runtime decode step failed on 1 of 3 ranks; rank 2" in message, message
        assert res["rolled_back"] and res["outputs"] == ok["outputs"]


@pytest.mark.multirank
@pytest.mark.parametrize("fault", ["diverge", "progress"])
def test_ranks_that_diverge_inside_a_decode_call_raise_on_every_rank(ranks2, fault):
    """State that parts ways inside a call -- a rank committing what the others did not (caught by the step's vote,
    which names the field), or a progress callback moving a request on one rank (with ``progress`` every step agrees
    on its inputs first: caught before the step runs) -- raises on every rank, and every rank is back where the
    step began."""
    for res in ranks2.run(_loop, "sharded", None, fault):
        kind, message = res["error"]
        assert kind == "ConfigMismatchError", message
        if fault == "diverge":  # the vote compares the committed state
            assert "Runtime decode step" in message and "field 'num_computed[0]' differs" in message, message
            assert res["rolled_back"]
        else:  # the moved request is not in the last rank's batch: the input agreement sees another batch
            assert "Runtime step configuration: field 'extend_lens.len' differs (rank 0: 3, rank 1: 2)" in message
