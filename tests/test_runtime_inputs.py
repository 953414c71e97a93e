"""The runtime refuses what they cannot serve, before anything changes (both model adapters, one process).

Every refused call is checked against a snapshot of the runtime: requests, pages, the allocator (digest and every
reference count), the prefix cache, the stats and every pool byte are exactly as before (:mod:`tests._runtime`).
The rules themselves live once in :mod:`dtkv.runtime._batch`.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from dtkv import AllocationError
from tests._runtime import ADAPTERS, PAGE_SIZE, make_runtime, snapshot, unchanged

both = pytest.mark.parametrize("adapter", ADAPTERS)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@both
def test_rejects_a_finished_request_in_every_entry_point(adapter):
    """Finding 4: a released request used to get fresh pages holding another request's KV (and, with a prefix
    cache, had them cached under its tokens)."""
    with make_runtime(adapter, prefix_cache=True) as rt:
        a, b = rt.add_request(_prompt(6)), rt.add_request(_prompt(5, 1))
        rt.prefill(4)
        rt.finish_request(a.rid)  # with the prefix cache, a's full page is cached now
        before = snapshot(rt)
        with pytest.raises(ValueError, match=r"reqs\[0\] must be a live request, got request 0, which is finished"):
            rt.step([a], [1])
        with pytest.raises(ValueError, match=r"reqs\[1\] must be a live request, got request 0, which is finished"):
            rt.decode_step([b, a])
        with pytest.raises(ValueError, match=r"reqs\[0\] must be a live request"):
            rt.plan_step([a], [1])
        with pytest.raises(ValueError, match="rid must name a live request, got rid=0, which is finished already"):
            rt.finish_request(a.rid)
        with pytest.raises(ValueError, match="request 0 is finished: its pages were released, got rid=0"):
            rt.kv_bytes(a.rid)
        assert unchanged(rt, before)
        assert rt.prefill(4) == []  # nothing left to prefill: the freed request is not recomputed
        outputs = rt.decode(1)
        assert len(outputs[a.rid]) == 1 and len(outputs[b.rid]) == 2  # only the live request decodes


@both
def test_rejects_the_same_request_twice_in_one_step(adapter):
    """Finding 5: ``step([a, a], [3, 3])`` computed tokens 0-2 twice and 3-5 never."""
    with make_runtime(adapter) as rt:
        a = rt.add_request(_prompt(6))
        before = snapshot(rt)
        with pytest.raises(ValueError, match=r"reqs must hold each request once per step, got request 0 at reqs\[0\] "):
            rt.step([a, a], [3, 3])
        assert unchanged(rt, before)
        rt.prefill(6)
        before = snapshot(rt)
        with pytest.raises(ValueError, match=r"got request 0 at reqs\[0\] and reqs\[1\]"):
            rt.decode_step([a, a])
        assert unchanged(rt, before)


@both
def test_rejects_a_zero_length_extend(adapter):
    """Finding 6: ``step([a, b], [0, 5])`` returned b's logits as a's."""
    with make_runtime(adapter) as rt:
        a, b = rt.add_request(_prompt(6)), rt.add_request(_prompt(5, 1))
        before = snapshot(rt)
        with pytest.raises(ValueError, match=r"extend_lens must be ints in \[1, tokens not yet computed\], got 0 at "
                                             r"extend_lens\[0\] for request 0 \(0 of 6 tokens computed\)"):  # fmt: skip
            rt.step([a, b], [0, 5])
        assert unchanged(rt, before)


@both
def test_rejects_an_extend_past_the_known_tokens_before_taking_a_page(adapter):
    """Finding 7: ``step([a], [9])`` for a 6-token request took pages and died with a bare ``IndexError``."""
    with make_runtime(adapter) as rt:
        a = rt.add_request(_prompt(6))
        rt.step([a], [2])
        before = snapshot(rt)
        with pytest.raises(ValueError, match=r"got 9 at extend_lens\[0\] for request 0 \(2 of 6 tokens computed\)"):
            rt.step([a], [9])
        with pytest.raises(ValueError, match="extend_lens must hold one length per request of a non-empty batch, "
                                             "got 2 for 1"):  # fmt: skip
            rt.step([a], [1, 1])
        assert unchanged(rt, before)  # the request keeps exactly the pages it had


@both
def test_refuses_a_prompt_that_can_never_fit_the_pool_and_serves_the_others(adapter):
    """Finding 7: ``DSAModelRunner`` half-prefilled a prompt longer than the pool, kept every page and made every
    later ``prefill()`` fail, even for new requests."""
    with make_runtime(adapter, num_pages=4) as rt:
        with pytest.raises(ValueError, match="prompt must fit the pool: its 17 tokens need 5 pages of 4 tokens, the "
                                             "pool can hand out 4"):  # fmt: skip
            rt.add_request(_prompt(4 * PAGE_SIZE + 1))
        assert rt.requests == [] and rt.allocator.num_free() == 4
        rt.add_request(_prompt(6))
        assert len(rt.prefill(4)) == 1
        second = rt.add_request(_prompt(5, 1))
        assert rt.prefill(4) == [second.output[0]]


@both
def test_rejects_an_empty_batch(adapter):
    """Finding 8: an empty batch crashed inside torch; ``decode()`` with nothing to decode stays a no-op."""
    with make_runtime(adapter) as rt:
        before = snapshot(rt)
        for call in (lambda: rt.step([], []), lambda: rt.decode_step([]), lambda: rt.plan_step([], [])):
            with pytest.raises(ValueError, match="reqs must hold at least one request, got an empty batch"):
                call()
        assert rt.decode(2) == [] and unchanged(rt, before)


@both
def test_refuses_float_and_bool_token_ids_and_lengths(adapter):
    """Finding 9: ``[1.7, 2.0]`` became ``[1, 2]`` and ``[True, 5]`` became ``[1, 5]``."""
    with make_runtime(adapter) as rt:
        for prompt, got in (([1.7, 2.0], "1.7 (float)"), ([True, 5], "True (bool)"), (np.array([1.0]), "1.0")):
            with pytest.raises(TypeError, match=re.escape(f"prompt must hold ints, got {got}")):
                rt.add_request(prompt)
        for prompt in (torch.tensor([1.0, 2.0]), torch.tensor([True])):
            with pytest.raises(TypeError, match="prompt must be an integer tensor, got prompt.dtype=torch"):
                rt.add_request(prompt)
        with pytest.raises(ValueError, match=r"prompt token ids must be in \[0, \d+\), got -1 at prompt\[1\]"):
            rt.add_request([3, -1])
        assert rt.requests == []
        a = rt.add_request(torch.tensor([3, 4, 5]))  # an integer tensor is fine
        assert a.prompt == [3, 4, 5] and all(type(t) is int for t in a.prompt)
        before = snapshot(rt)
        for lens, got in (([1.5], "1.5 (float)"), ([True], "True (bool)")):
            with pytest.raises(TypeError, match=re.escape(f"extend_lens must hold ints, got {got}")):
                rt.step([a], lens)
        with pytest.raises(TypeError, match="reqs must be a sequence of requests, got int"):
            rt.step(0, [1])
        with pytest.raises(ValueError, match=r"reqs\[0\] must be one of this runtime's requests"):
            rt.step([0], [1])
        assert unchanged(rt, before)


@both
def test_kv_bytes_refuses_ids_outside_the_requests(adapter):
    """Finding 9: ``kv_bytes(-1)`` returned the last request's bytes."""
    with make_runtime(adapter) as rt:
        rt.add_request(_prompt(5))
        rt.prefill(8)
        for rid in (-1, 1):
            with pytest.raises(ValueError, match=rf"rid must name a request in \[0, 1\), got rid={rid}"):
                rt.kv_bytes(rid)
        for rid in (True, 0.0):
            with pytest.raises(TypeError, match="rid must be an int"):
                rt.kv_bytes(rid)
        with pytest.raises(ValueError, match=r"rid must name a request in \[0, 1\), got rid=-1"):
            rt.finish_request(-1)
        assert rt.kv_bytes(0)["kv"].shape[1] == 5


@both
def test_a_step_that_cannot_get_its_pages_changes_nothing(adapter):
    """An allocation failure midway (the first request's pages taken, the second's not) used to leave the first
    request holding its new pages; the step is now refused before any page is taken."""
    with make_runtime(adapter, num_pages=8) as rt:
        a, b = rt.add_request(_prompt(20)), rt.add_request(_prompt(20, 1))  # 5 pages each, 8 in the pool
        rt.step([a], [2])
        before = snapshot(rt)
        with pytest.raises(AllocationError, match="the step needs 9 new pages, the pool has 7 free; nothing was"):
            rt.step([a, b], [18, 20])
        assert unchanged(rt, before)
        rt.step([a], [18])  # the pool still serves what fits
        rt.finish_request(a.rid)
        assert rt.prefill(20) == [b.output[0]]


@both
@pytest.mark.parametrize("cache", [False, True], ids=["no_cache", "prefix_cache"])
def test_requests_that_fit_alone_but_not_together_queue_instead_of_wedging_prefill(adapter, cache):
    """Two prompts of 5 pages each in a pool of 8: chunk by chunk both took pages until a step could not get its
    own, and every later ``prefill()`` raised ``AllocationError`` with no request able to finish. Now a step runs
    the requests whose remaining pages fit together (those under way first): the first finishes, the second waits
    (no page taken) and runs once the first is finished; each gets the first token it gets alone. With a prefix
    cache, the pages eviction could free count as room."""
    alone = []
    for seed in (0, 1):
        with make_runtime(adapter, num_pages=8) as rt:
            rt.add_request(_prompt(20, seed))
            alone.append(rt.prefill(4, return_logits=True))
    with make_runtime(adapter, num_pages=8, prefix_cache=cache) as rt:
        if cache:  # a finished request leaves 2 cached pages (only the cache holds them): room by eviction
            rt.add_request(_prompt(8, 7))
            rt.prefill(4)
            rt.finish_request(0)
            assert rt.prefix_cache.num_evictable() == 2
        a, b = rt.add_request(_prompt(20)), rt.add_request(_prompt(20, 1))
        seen = []
        first, logits = rt.prefill(4, return_logits=True, progress=lambda k, n: seen.append((k, n)))
        assert first == [a.output[0]] == alone[0][0] and torch.equal(logits[0], alone[0][1][0])
        assert b.num_computed == 0 and b.pages == [] and not b.output  # queued: nothing taken
        assert seen[-1][0] == 5 and all(k <= n for k, n in seen)
        before = snapshot(rt)
        with pytest.raises(AllocationError, match=f"no request can finish its prompt: request {b.rid} needs 5 more"):
            rt.prefill(4)  # still no room for b: a call that can start nothing says so, taking nothing
        assert unchanged(rt, before)
        rt.finish_request(a.rid)
        assert rt.prefill(4) == [b.output[0]] == alone[1][0]


def test_prefill_that_cannot_start_any_request_raises_and_takes_nothing():
    with make_runtime("reference", num_pages=8) as rt:
        a = rt.add_request(_prompt(24))  # 6 pages
        rt.prefill(8)
        b = rt.add_request(_prompt(12, 1))  # 3 pages, 2 free
        before = snapshot(rt)
        with pytest.raises(
            AllocationError,
            match=r"prefill cannot start: no request can finish its prompt: request 1 needs 3 more pages of 4 tokens, "
            r"the pool has 2 free; nothing was allocated",
        ):
            rt.prefill(4)
        assert unchanged(rt, before) and not b.pages
        rt.finish_request(a.rid)
        assert len(rt.prefill(4)) == 1


@both
def test_a_step_whose_run_fails_returns_the_pages_it_took(adapter):
    """A failure inside the run (here an injected one) gives the step's new pages back: the requests keep the pages
    and computed tokens they had, and the next step plans from there."""
    with make_runtime(adapter, num_pages=8) as rt:
        a = rt.add_request(_prompt(9))
        rt.step([a], [3])
        before = snapshot(rt)[0]
        forward = rt.forward

        def boom(*args, **kwargs):
            raise RuntimeError("injected fault in the run")

        rt.forward = boom
        with pytest.raises(RuntimeError, match="injected fault"):
            rt.step([a], [6])
        after = snapshot(rt)[0]
        assert after["requests"] == before["requests"] and after["refcounts"] == before["refcounts"]
        rt.forward = forward
        rt.step([a], [6])
        assert a.num_computed == 9 and len(a.pages) == 3


@both
@pytest.mark.parametrize("cache", [False, True], ids=["no_cache", "prefix_cache"])
def test_sharded_decode_mode_refuses_the_same_batches(adapter, cache):
    """``Runtime(decode_mode="sharded")`` decodes on its own path (:mod:`dtkv.runtime._decode`): the same rules hold
    there, for every model, and a decode step that cannot get its page changes nothing (no eviction either)."""
    with make_runtime(adapter, num_pages=3, decode_mode="sharded", prefix_cache=cache) as rt:
        a, b = rt.add_request(_prompt(4)), rt.add_request(_prompt(8, 1))  # 1 + 2 pages: the pool is full
        rt.prefill(8)
        before = snapshot(rt)
        with pytest.raises(ValueError, match=r"got request 0 at reqs\[0\] and reqs\[1\]"):
            rt.decode_step([a, a])
        with pytest.raises(ValueError, match="reqs must hold at least one request, got an empty batch"):
            rt.decode_step([])
        with pytest.raises(AllocationError, match="the step needs 1 new pages, the pool has 0 free"):
            rt.decode_step([a])  # token 5 opens a second page
        assert unchanged(rt, before)
        rt.finish_request(b.rid)
        a.num_computed = len(a.tokens)  # as if a's next token were computed already
        before = snapshot(rt)
        with pytest.raises(ValueError, match="request 0 has no token to decode"):
            rt.decode_step([a])
        assert unchanged(rt, before)
