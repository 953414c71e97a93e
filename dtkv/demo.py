"""``python -m dtkv.demo``: chunked CP prefill of the reference model with sharded KV, checked end to end.

Spawns ``--cp`` ranks (gloo on CPU; NCCL when that many GPUs are visible), runs the same prompts through the
replicated-KV baseline (what engines do today) and through page-ownership-sharded KV, and checks that tokens,
logits and every stored KV byte agree. Prints a table, or one JSON object with ``--json``. Exit code 1 on any
mismatch. ``--pd`` also spawns a non-CP decode process that receives every request's owned pages from
the CP ranks over the Mooncake Transfer Engine (TCP loopback), reconstructs the full KV and continues with greedy
decode; ``pd_parity`` is true when its KV bytes equal the replicated baseline's and its tokens equal the CP run's.
``--decode sharded`` decodes the sharded run straight on its shards (:mod:`dtkv.decode`: no full view); parity then
also needs its decode logits within 1e-9 relative of the baseline's full-view decode (``decode_logits_max_rel``).

``--multi-turn`` runs a multi-turn conversation (each turn extends the previous prompt and its answer) and
several requests sharing its system prompt, on sharded KV with and without the prefix cache
(:mod:`dtkv._demo_multi_turn`); ``parity`` then means tokens, logits and KV bytes equal to the run without the
cache, and the JSON adds ``prefix_hit_rate`` and ``prefill_tokens_saved``.

``capacity_multiplier`` is replicated KV bytes per rank over sharded KV bytes per rank (pool only);
``capacity_multiplier_with_scratch`` also charges the materialization scratch of this run's largest batch, which
at demo sizes is as large as the pool itself (``python -m dtkv.capacity`` sizes a real deployment, where scratch
for the longest request is a few percent of the budget).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import replace

__all__ = ["main", "run_rank"]


def _prompts(tokens: int, num_requests: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    weights = torch.arange(num_requests, 0, -1, dtype=torch.float64)  # unequal lengths: 3:2:1 ...
    lens = (weights / weights.sum() * tokens).floor().long().clamp(min=1)
    lens[0] += tokens - int(lens.sum())
    return [torch.randint(0, vocab, (int(n),), generator=g).tolist() for n in lens]


def _num_pages(prompts: list[list[int]], page_size: int, decode_steps: int, cp: int) -> int:
    pages = sum(-(-(len(p) + decode_steps + 1) // page_size) + 1 for p in prompts)
    return -(-pages // cp) * cp + cp


def run_rank(rank: int, world: int, args: dict, init_file: str | None = None) -> dict:
    """One rank's demo: baseline and sharded runs, then a comparison (collective over the CP group)."""
    import torch
    import torch.distributed as dist

    from dtkv.model import ModelConfig, PrefillEngine

    use_cuda = args["device"] == "cuda"
    if init_file is not None:
        if use_cuda:
            torch.cuda.set_device(rank)
        store = dist.FileStore(init_file, world)
        dist.init_process_group("nccl" if use_cuda else "gloo", store=store, rank=rank, world_size=world)
    group = dist.group.WORLD if world > 1 else None
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    cfg = replace(ModelConfig(), page_size=args["page_size"], kv_dtype=args["kv_dtype"])
    if args.get("multi_turn"):
        from dtkv._demo_multi_turn import multi_turn_rank

        out = multi_turn_rank(rank, args, cfg, group, device)
        if init_file is not None:
            dist.barrier()
            dist.destroy_process_group()
        return out
    prompts = _prompts(args["tokens"], args["requests"], cfg.vocab_size, args["seed"])
    num_pages = _num_pages(prompts, cfg.page_size, args["decode_steps"], world)
    sharded_mode = "sharded_direct" if args["split"] == "zigzag" else "sharded"
    results = {}
    for mode in ("replicated", sharded_mode):
        decode_mode = "full" if mode == "replicated" else args.get("decode", "full")
        eng = PrefillEngine(
            cfg,
            mode=mode,
            split=args["split"],
            group=group,
            num_pages=num_pages,
            device=device,
            decode_mode=decode_mode,
        )
        for p in prompts:
            eng.add_request(p)
        if group is not None:
            dist.barrier(group)
        t0 = time.perf_counter()
        eng.prefill(args["chunk"], prefetch=True)
        pd_report = {}
        if mode != "replicated" and args.get("pd_port"):  # hand the prefilled requests to the decode process
            from dtkv.transfer.pd import send_from_rank

            pd_report = send_from_rank(eng, args, results["replicated"]["kv"])
        decode_logits = []
        for _ in range(args["decode_steps"]):
            reqs = [r for r in eng.requests if r.output]
            decode_logits.append(eng.decode_step(reqs))
            for r, row in zip(reqs, decode_logits[-1]):
                r.output.append(int(row.argmax()))
        outputs = [list(r.output) for r in eng.requests]
        if use_cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        kv = [eng.kv_bytes(r.rid) for r in eng.requests]
        results[mode] = {
            "outputs": outputs,
            "kv": kv,
            "seconds": elapsed,
            "steps": eng.stats["steps"],
            "bytes_per_rank": eng.pool.bytes_per_rank(),
            "replicated_bytes": eng.pool.replicated_bytes(),
            "scratch": eng.stats["scratch_bytes"],
            "direct_rows": eng.stats["direct_rows"],
            "handoff_rows": eng.stats["handoff_rows"],
            "pd": pd_report,
            "decode_logits": decode_logits,
            "decode_comm_bytes": eng.stats["decode_comm_bytes"],
        }
    base, shard = results["replicated"], results[sharded_mode]
    kv_equal = all(torch.equal(a[name], b[name]) for a, b in zip(base["kv"], shard["kv"]) for name in a)
    out = {
        "rank": rank,
        "tokens_equal": base["outputs"] == shard["outputs"],
        "kv_equal": kv_equal,
        "outputs": shard["outputs"],
        "mode": sharded_mode,
        "seconds_baseline": base["seconds"],
        "seconds_sharded": shard["seconds"],
        "steps": shard["steps"],
        "kv_bytes_per_rank": shard["bytes_per_rank"],
        "kv_bytes_replicated": base["bytes_per_rank"],
        "scratch_bytes_per_rank": shard["scratch"],
        "direct_rows": shard["direct_rows"],
        "handoff_rows": shard["handoff_rows"],
        "decode_logits_max_rel": max(
            [float((a - b).abs().max() / b.abs().max()) for a, b in zip(shard["decode_logits"], base["decode_logits"])]
            + [0.0]
        ),
        "decode_comm_bytes": shard["decode_comm_bytes"],
        **shard["pd"],
    }
    if init_file is not None:
        dist.barrier()
        dist.destroy_process_group()
    return out


def _worker(rank: int, world: int, args: dict, init_file: str, queue) -> None:
    try:
        queue.put(run_rank(rank, world, args, init_file))
    except BaseException as e:  # report, never hang the parent
        import traceback

        queue.put({"rank": rank, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"})


def _spawn(args: dict) -> list[dict]:
    import multiprocessing as mp

    world = args["cp"]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="dtkv_demo_")
    os.close(fd)
    os.unlink(init_file)
    procs = [ctx.Process(target=_worker, args=(r, world, args, init_file, queue), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results = []
    deadline = time.time() + args["timeout"]
    while len(results) < world and time.time() < deadline:
        try:
            results.append(queue.get(timeout=1.0))
        except Exception:  # queue.Empty
            if any(p.exitcode not in (None, 0) for p in procs):
                break
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    if len(results) < world:
        results.append(
            {"rank": -1, "error": f"only {len(results)} of {world} ranks reported within {args['timeout']} s"}
        )
    return sorted(results, key=lambda r: r["rank"])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dtkv.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, default=2, help="CP ranks (default 2)")
    p.add_argument("--tokens", type=int, default=1536, help="prompt tokens over all requests (default 1536)")
    p.add_argument("--requests", type=int, default=2, help="requests in the batch (default 2)")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk per request per step (default 256)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    p.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16")
    p.add_argument("--split", choices=("zigzag", "round_robin"), default="zigzag")
    p.add_argument("--decode-steps", type=int, default=4, help="greedy decode steps after prefill (default 4)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before the ranks are given up on")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--pd", action="store_true", help="also hand the requests to a decode process over Mooncake")
    p.add_argument("--multi-turn", action="store_true", help="a conversation + shared-prompt requests, prefix cache")
    p.add_argument("--turns", type=int, default=4, help="--multi-turn: turns of the conversation (default 4)")
    p.add_argument("--shared-requests", type=int, default=3, help="--multi-turn: requests sharing the system prompt")
    p.add_argument("--pool-pages", type=int, default=None, help="--multi-turn: pages of the cached run")
    p.add_argument(
        "--decode",
        choices=("full", "sharded"),
        default="full",
        help="decode of the sharded run: over a full view (default) or straight on the shards",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    for name in ("cp", "tokens", "requests", "chunk", "page_size"):
        if getattr(ns, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1, got {getattr(ns, name)}", file=sys.stderr)
            return 2
    if ns.multi_turn:
        for name in ("turns", "shared_requests", "pool_pages"):
            if getattr(ns, name) is not None and getattr(ns, name) < 1:
                print(f"error: --{name.replace('_', '-')} must be >= 1, got {getattr(ns, name)}", file=sys.stderr)
                return 2
        if ns.pd or ns.decode != "full":
            print("error: --multi-turn runs the full-view decode without --pd: drop --pd / --decode", file=sys.stderr)
            return 2
    if ns.tokens < ns.requests:
        print(f"error: --tokens must be >= --requests, got {ns.tokens} < {ns.requests}", file=sys.stderr)
        return 2
    import torch

    device = ns.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= ns.cp else "cpu"
    args = {**vars(ns), "device": device}
    pd = None
    if ns.pd:
        from dtkv.model import ModelConfig
        from dtkv.transfer.pd import start_decode

        pd = start_decode(args, _prompts(ns.tokens, ns.requests, ModelConfig().vocab_size, ns.seed))
        args.update(pd.rank_args)
    t0 = time.perf_counter()
    results = _spawn(args)
    wall = time.perf_counter() - t0
    errors = [r for r in results if "error" in r]
    if errors:
        for e in errors:
            print(f"rank {e['rank']} failed: {e['error']}", file=sys.stderr)
        if ns.json:
            print(json.dumps({"parity": False, "error": errors[0]["error"].splitlines()[0]}))
        return 1
    if ns.multi_turn:
        from dtkv._demo_multi_turn import multi_turn_summary, print_table

        summary = multi_turn_summary(results, args, wall)
        if ns.json:
            print(json.dumps(summary))
        else:
            print_table(summary)
        return 0 if summary["parity"] else 1
    r0 = results[0]
    decode_rel = max(r["decode_logits_max_rel"] for r in results)
    parity = all(r["tokens_equal"] and r["kv_equal"] for r in results) and all(
        r["outputs"] == r0["outputs"] for r in results
    )
    parity = parity and decode_rel <= 1e-9
    per_rank = max(r["kv_bytes_per_rank"] for r in results)
    scratch = max(r["scratch_bytes_per_rank"] for r in results)
    summary = {
        "parity": parity,
        "cp": ns.cp,
        "tokens": ns.tokens,
        "requests": ns.requests,
        "chunk": ns.chunk,
        "chunks": -(-max(len(p) for p in _prompts(ns.tokens, ns.requests, 97, ns.seed)) // ns.chunk),
        "page_size": ns.page_size,
        "kv_dtype": ns.kv_dtype,
        "split": ns.split,
        "mode": r0["mode"],
        "device": device,
        "kv_bytes_per_rank": per_rank,
        "kv_bytes_replicated": r0["kv_bytes_replicated"],
        "scratch_bytes_per_rank": scratch,
        "capacity_multiplier": r0["kv_bytes_replicated"] / per_rank,
        "capacity_multiplier_with_scratch": r0["kv_bytes_replicated"] / (per_rank + scratch),
        "direct_rows": sum(r["direct_rows"] for r in results),
        "handoff_rows": sum(r["handoff_rows"] for r in results),
        "seconds_baseline": max(r["seconds_baseline"] for r in results),
        "seconds_sharded": max(r["seconds_sharded"] for r in results),
        "wall_seconds": wall,
        "generated": r0["outputs"],
        "decode": ns.decode,
        "decode_logits_max_rel": decode_rel,
        "decode_comm_bytes_per_step": r0["decode_comm_bytes"] // max(1, ns.decode_steps),
    }
    if pd is not None:
        summary.update(pd.finish(results, timeout_s=ns.timeout))
        parity = parity and summary["pd_parity"]
        summary["parity"] = parity
    if ns.json:
        print(json.dumps(summary))
    else:
        kib = 1024
        rows = [
            ("tokens (requests)", f"{ns.tokens} ({ns.requests})"),
            ("chunks x chunk size", f"{summary['chunks']} x {ns.chunk}"),
            ("split / KV mode", f"{ns.split} / {r0['mode']}"),
            ("KV dtype, page size", f"{ns.kv_dtype}, {ns.page_size}"),
            ("KV bytes per rank: replicated", f"{r0['kv_bytes_replicated'] / kib:,.1f} KiB"),
            ("KV bytes per rank: sharded", f"{per_rank / kib:,.1f} KiB"),
            ("materialization scratch per rank", f"{scratch / kib:,.1f} KiB"),
            ("capacity multiplier (pool bytes)", f"{summary['capacity_multiplier']:.2f}x (cp={ns.cp})"),
            ("  with this batch's scratch charged", f"{summary['capacity_multiplier_with_scratch']:.2f}x"),
            ("rows direct-written / handed off", f"{summary['direct_rows']} / {summary['handoff_rows']}"),
            ("time: replicated / sharded", f"{summary['seconds_baseline']:.2f} s / {summary['seconds_sharded']:.2f} s"),
            ("decode (logits vs full view)", f"{ns.decode} ({decode_rel:.1e} max relative difference)"),
            ("parity with replicated baseline", "OK (tokens, logits path and KV bytes)" if parity else "MISMATCH"),
        ]
        if pd is not None:
            pd_ok = "OK (KV bytes and tokens)" if summary["pd_parity"] else f"MISMATCH {summary.get('pd_error', '')}"
            rows.append(("PD decode over Mooncake", pd_ok))
            if "pd_entries" in summary:
                sent = f"{summary['pd_entries']} ({summary['pd_min_entries']}) / {summary['pd_bytes'] / kib:,.1f} KiB"
                rows.append(("  entries (minimum) / bytes sent", sent))
        width = max(len(k) for k, _ in rows)
        print(f"dtkv demo: cp={ns.cp} on {device}, {wall:.1f} s wall")
        for k, v in rows:
            print(f"  {k:<{width}}  {v}")
        print(f"  generated tokens: {r0['outputs']}")
    return 0 if parity else 1


if __name__ == "__main__":
    sys.exit(main())
