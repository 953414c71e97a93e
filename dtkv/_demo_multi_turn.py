"""``python -m dtkv.demo --multi-turn``: a conversation and shared-system-prompt requests, with and without the
prefix cache, on sharded KV (:mod:`dtkv.model.workloads` drives both runs).

Sizes follow ``--tokens``: a system prompt of ``tokens // 4``, user turns of about ``tokens // 16`` and
shared-prompt questions of about ``tokens // 32`` tokens. The run without the cache gets a pool with room for every
request; ``--pool-pages`` shrinks the cached run's pool, so that it has to evict. ``parity`` is true when every
produced token, its logits and every request's stored KV bytes are equal, bit for bit, with and without the cache.
"""

from __future__ import annotations

from dtkv._util import cdiv

__all__ = ["multi_turn_rank", "multi_turn_summary", "pool_pages", "print_table"]


def _workload(args: dict, vocab: int):
    from dtkv.model.workloads import chat_workload

    tokens = args["tokens"]
    return chat_workload(
        system_tokens=max(1, tokens // 4),
        turn_tokens=max(1, tokens // 16),
        turns=args["turns"],
        questions=args["shared_requests"],
        question_tokens=max(1, tokens // 32),
        vocab=vocab,
        seed=args["seed"],
    )


def pool_pages(workload, *, page_size: int, decode_steps: int, cp_size: int) -> int:
    """Logical pages that hold every request of ``workload`` at once (so nothing is ever evicted)."""
    answer = decode_steps + 1
    turns, system = workload.user_turns, len(workload.system)
    total = 0
    for t in range(len(turns)):
        prompt = system + sum(len(u) for u in turns[: t + 1]) + t * answer
        total += cdiv(prompt + answer, page_size)
    for q in workload.questions:
        total += cdiv(system + len(q) + answer * (len(turns) + 1), page_size)
    return cdiv(total, cp_size) * cp_size + cp_size


def multi_turn_rank(rank: int, args: dict, cfg, group, device) -> dict:
    """One rank's runs: the workload without and with the prefix cache (collective over ``group``)."""
    import time

    import torch.distributed as dist

    from dtkv.model import ModelRunner
    from dtkv.model.workloads import compare_runs, run_workload

    workload = _workload(args, cfg.vocab_size)
    world = 1 if group is None else dist.get_world_size(group)
    room = pool_pages(workload, page_size=cfg.page_size, decode_steps=args["decode_steps"], cp_size=world)
    num_pages = args.get("pool_pages") or room  # the cached run's pool; the run without cache always gets room
    mode = "sharded_direct" if args["split"] == "zigzag" else "sharded"
    runs, seconds = {}, {}
    for cache in (False, True):
        eng = ModelRunner(
            cfg,
            mode=mode,
            split=args["split"],
            group=group,
            num_pages=num_pages if cache else room,
            device=device,
            prefix_cache=cache,
            attention=args.get("attention", "torch"),
        )
        if group is not None:
            dist.barrier(group)
        t0 = time.perf_counter()
        runs[cache] = run_workload(eng, workload, chunk=args["chunk"], decode_steps=args["decode_steps"])
        seconds[cache] = time.perf_counter() - t0
    base, cached = runs[False], runs[True]
    return {
        "rank": rank,
        **compare_runs(base, cached),
        "mode": mode,
        "num_pages": num_pages,
        "requests": len(base.outputs),
        "prompt_tokens": cached.prompt_tokens,
        "prefill_tokens": cached.prefill_tokens,
        "prefill_tokens_no_cache": base.prefill_tokens,
        "hit_tokens": cached.hit_tokens,
        "prefix_hit_rate": cached.hit_rate,
        "evicted_pages": cached.evicted_pages,
        "shared_pages_distinct": cached.shared_pages_distinct,
        "shared_pages_referenced": cached.shared_pages_referenced,
        "shared_pages_no_cache": base.shared_pages_distinct,
        "peak_pages_allocated": cached.peak_pages_allocated,
        "peak_pages_allocated_no_cache": base.peak_pages_allocated,
        "seconds_cache": seconds[True],
        "seconds_no_cache": seconds[False],
        "outputs": {str(k): v for k, v in cached.outputs.items()},
    }


def multi_turn_summary(results: list[dict], args: dict, wall: float) -> dict:
    """The demo's JSON object from every rank's :func:`multi_turn_rank` result."""
    r0 = results[0]
    parity = all(r["parity"] for r in results) and all(r["outputs"] == r0["outputs"] for r in results)
    return {
        "parity": parity,
        "tokens_equal": all(r["tokens_equal"] for r in results),
        "logits_equal": all(r["logits_equal"] for r in results),
        "kv_equal": all(r["kv_equal"] for r in results),
        "prefix_hit_rate": r0["prefix_hit_rate"],
        "prefill_tokens_saved": r0["prefill_tokens_no_cache"] - r0["prefill_tokens"],
        "prefill_tokens": r0["prefill_tokens"],
        "prefill_tokens_no_cache": r0["prefill_tokens_no_cache"],
        "prompt_tokens": r0["prompt_tokens"],
        "requests": r0["requests"],
        "turns": args["turns"],
        "shared_requests": args["shared_requests"],
        "cp": args["cp"],
        "split": args["split"],
        "mode": r0["mode"],
        "kv_dtype": args["kv_dtype"],
        "page_size": args["page_size"],
        "chunk": args["chunk"],
        "num_pages": r0["num_pages"],
        "evicted_pages": r0["evicted_pages"],
        "shared_pages_distinct": r0["shared_pages_distinct"],
        "shared_pages_referenced": r0["shared_pages_referenced"],
        "shared_pages_no_cache": r0["shared_pages_no_cache"],
        "peak_pages_allocated": r0["peak_pages_allocated"],
        "peak_pages_allocated_no_cache": r0["peak_pages_allocated_no_cache"],
        "seconds_cache": max(r["seconds_cache"] for r in results),
        "seconds_no_cache": max(r["seconds_no_cache"] for r in results),
        "wall_seconds": wall,
        "device": args["device"],
    }


def print_table(summary: dict) -> None:
    """The human-readable form of :func:`multi_turn_summary`."""
    s = summary
    rows = [
        ("requests (turns + shared-prompt)", f"{s['requests']} ({s['turns']} + {s['shared_requests']})"),
        ("split / KV mode", f"{s['split']} / {s['mode']}"),
        ("KV dtype, page size, chunk", f"{s['kv_dtype']}, {s['page_size']}, {s['chunk']}"),
        ("prompt tokens", f"{s['prompt_tokens']}"),
        ("prefill tokens: no cache / cache", f"{s['prefill_tokens_no_cache']} / {s['prefill_tokens']}"),
        ("prefix hit rate", f"{s['prefix_hit_rate']:.1%} ({s['prefill_tokens_saved']} prefill tokens saved)"),
        (
            "shared-prompt pages: distinct / table entries",
            f"{s['shared_pages_distinct']} / {s['shared_pages_referenced']} (no cache: {s['shared_pages_no_cache']})",
        ),
        ("pool pages, evicted", f"{s['num_pages']}, {s['evicted_pages']}"),
        ("time: no cache / cache", f"{s['seconds_no_cache']:.2f} s / {s['seconds_cache']:.2f} s"),
        ("parity with the run without cache", "OK (tokens, logits, KV bytes)" if s["parity"] else "MISMATCH"),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"dtkv demo --multi-turn: cp={s['cp']} on {s['device']}, {s['wall_seconds']:.1f} s wall")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
