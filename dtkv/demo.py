"""``python -m dtkv.demo``: chunked CP prefill of the reference model with sharded KV, checked end to end.

Spawns ``--cp`` ranks (gloo on CPU; NCCL when that many GPUs are visible), runs the same prompts through the
replicated-KV baseline (what engines do today) and through page-ownership-sharded KV, and checks that tokens,
logits and every stored KV byte agree. Prints a table, or one JSON object with ``--json``. Exit code 1 on any
mismatch. ``--pd`` also spawns a non-CP decode process that receives every request's owned pages from
the CP ranks over the Mooncake Transfer Engine (TCP loopback), reconstructs the full KV and continues with greedy
decode; ``pd_parity`` is true when its KV bytes equal the replicated baseline's and its tokens equal the CP run's.
``--decode sharded`` decodes the sharded run straight on its shards (:mod:`dtkv.decode`: no full view); parity then
also needs its decode logits within 1e-9 relative of the baseline's full-view decode (``decode_logits_max_rel``).

``--model deepseek-v32|glm5`` runs a tiny random transformers DSA model (``DeepseekV32ForCausalLM`` /
``GlmMoeDsaForCausalLM``, no download) through :mod:`dtkv.integrations.transformers` instead, and checks every
prompt and decode logit against the model's own forward (``parity``, ``max_abs_logit_diff``); ``--dtype`` sets
the model's dtype. Under ``torchrun --nproc-per-node N -m dtkv.demo ...`` the demo runs one N-rank job on
torchrun's process group (gloo on CPU, NCCL on ``cuda:LOCAL_RANK``) and rank 0 prints the one result.

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

    from dtkv.model import ModelConfig, ModelRunner

    use_cuda = args["device"] == "cuda"
    local_rank = args.get("local_rank", rank)
    if init_file is not None:
        if use_cuda:
            torch.cuda.set_device(local_rank)
        store = dist.FileStore(init_file, world)
        dist.init_process_group(
            "nccl" if use_cuda else "gloo",
            store=store,
            rank=rank,
            world_size=world,
            device_id=torch.device("cuda", local_rank) if use_cuda else None,  # NCCL: no guessing the GPU
        )
    group = dist.group.WORLD if world > 1 else None
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if args["model"] != "reference":
        from dtkv.integrations.transformers._demo import run_rank as run_hf_rank

        prompts = _prompts(args["tokens"], args["requests"], _vocab(args["model"]), args["seed"])
        out = run_hf_rank(rank, world, args, group, device, prompts)
        if init_file is not None:
            dist.barrier()
            dist.destroy_process_group()
        return out
    cfg = replace(ModelConfig(), page_size=args["page_size"], kv_dtype=args["kv_dtype"])
    if args.get("attention") == "flashmla":  # FlashMLA's dims (dtkv.attention): 64 heads, 512 + 64, pages of 64
        cfg = replace(cfg, num_heads=64, kv_lora_rank=512, rope_dim=64, quant_block=128, page_size=64)
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
        eng = ModelRunner(
            cfg,
            mode=mode,
            split=args["split"],
            group=group,
            num_pages=num_pages,
            device=device,
            decode_mode=decode_mode,
            attention=args.get("attention", "torch"),
        )
        for p in prompts:
            eng.add_request(p)
        if group is not None:
            dist.barrier(group)
        t0 = time.perf_counter()
        eng.prefill(args["chunk"], prefetch=True)
        pd_report = {}
        if mode != "replicated" and args.get("pd_port"):  # hand the prefilled requests to the decode process
            from dtkv.model.pd import send_from_rank

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


def _vocab(model: str) -> int:
    """Vocabulary of the demo's model (token ids of the prompts are drawn below it)."""
    if model == "reference":
        from dtkv.model import ModelConfig

        return ModelConfig().vocab_size
    from dtkv.integrations.transformers import tiny_config

    return tiny_config(model).vocab_size


def _torchrun_env() -> tuple[int, int, int] | None:
    """``(rank, world_size, local_rank)`` when started by torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``)."""
    if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])


def _json_all_gather(obj: object, group) -> list:
    """Every rank's JSON-serializable ``obj``, in rank order (as bytes: no pickle on received data)."""
    import torch
    import torch.distributed as dist

    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64), group=group)
    width = max(int(n) for n in sizes)
    bufs = [torch.zeros(width, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(bufs, torch.cat([data, data.new_zeros(width - data.numel())]), group=group)
    return [json.loads(bytes(b[: int(n)].tolist()).decode()) for b, n in zip(bufs, sizes)]


def _torchrun(args: dict, rank: int, world: int, local_rank: int) -> tuple[list[dict], float, object]:
    """One rank of a torchrun job: join torchrun's process group, run, gather every rank's result (JSON)."""
    import datetime

    import torch
    import torch.distributed as dist

    use_cuda = args["device"] == "cuda"
    if use_cuda:
        torch.cuda.set_device(local_rank)
    timeout = datetime.timedelta(seconds=args["timeout"])
    device_id = torch.device("cuda", local_rank) if use_cuda else None  # NCCL: no guessing the GPU by rank
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout, device_id=device_id)
    meta = dist.new_group(backend="gloo", timeout=timeout)  # results travel on their own CPU group
    pd = None
    try:
        if args["pd"]:
            if rank == 0:
                pd = _start_decode(args)
            args.update(_json_all_gather(pd.rank_args if pd is not None else None, meta)[0])
        t0 = time.perf_counter()
        try:
            result = run_rank(rank, world, {**args, "local_rank": local_rank})
        except Exception as e:  # report through the exchange, so rank 0 prints the error
            import traceback

            result = {"rank": rank, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
        results = _json_all_gather(result, meta)
        wall = time.perf_counter() - t0
    finally:
        dist.destroy_process_group()
    return results, wall, pd


def _start_decode(args: dict):
    """Spawn the decode process of ``--pd`` (the reference model's or the transformers model's)."""
    prompts = _prompts(args["tokens"], args["requests"], _vocab(args["model"]), args["seed"])
    if args["model"] == "reference":
        from dtkv.model.pd import start_decode
    else:
        from dtkv.integrations.transformers._demo_pd import start_decode
    return start_decode(args, prompts)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dtkv.demo", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        choices=("reference", "deepseek-v32", "glm5"),
        default="reference",
        help="the float64 reference model (default) or a tiny random transformers DSA model",
    )
    p.add_argument("--cp", type=int, default=None, help="CP ranks (default 2; under torchrun: its WORLD_SIZE)")
    p.add_argument("--tokens", type=int, default=1536, help="prompt tokens over all requests (default 1536)")
    p.add_argument("--requests", type=int, default=2, help="requests in the batch (default 2)")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk per request per step (default 256)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    p.add_argument(
        "--kv-dtype",
        choices=("bf16", "fp8", "fp32"),
        default="bf16",
        help="stored KV format (fp32: transformers models only)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of a transformers model (default float32)",
    )
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
        "--attention",
        choices=("torch", "triton", "flashmla"),
        default="torch",
        help="attention backend (dtkv.attention; default torch, the reference); flashmla runs the model at its dims: "
        "64 heads, kv_lora_rank 512, rope 64, page size 64",
    )
    p.add_argument(
        "--decode",
        choices=("full", "sharded"),
        default="full",
        help="decode of the reference model's sharded run: over a full view (default) or straight on the shards",
    )
    return p  # fmt: skip


def _usage_error(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    env = _torchrun_env()
    for name in ("cp", "tokens", "requests", "chunk", "page_size"):
        value = getattr(ns, name)
        if value is not None and value < 1:
            return _usage_error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if ns.multi_turn:
        for name in ("turns", "shared_requests", "pool_pages"):
            value = getattr(ns, name)
            if value is not None and value < 1:
                return _usage_error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if ns.pd or ns.decode != "full":
            return _usage_error("--multi-turn runs the full-view decode without --pd: drop --pd / --decode")
        if ns.model != "reference":
            return _usage_error(f"--multi-turn is for the reference model, got --model {ns.model}")
    if ns.tokens < ns.requests:
        return _usage_error(f"--tokens must be >= --requests, got {ns.tokens} < {ns.requests}")
    if ns.decode_steps < 0:
        return _usage_error(f"--decode-steps must be >= 0, got {ns.decode_steps}")
    if env is not None and ns.cp is not None and ns.cp != env[1]:
        return _usage_error(f"--cp must equal torchrun's WORLD_SIZE={env[1]} (or be left out), got --cp {ns.cp}")
    if env is not None and ns.pd and os.environ.get("LOCAL_WORLD_SIZE", str(env[1])) != str(env[1]):
        return _usage_error("--pd under torchrun needs a single node (the decode process rendezvouses on 127.0.0.1), "
                            f"got WORLD_SIZE={env[1]}, LOCAL_WORLD_SIZE={os.environ['LOCAL_WORLD_SIZE']}")  # fmt: skip
    if ns.decode != "full" and ns.attention != "torch":
        return _usage_error("--decode sharded checks its float64 decode against the torch attention's: drop "
                            f"--attention {ns.attention}")  # fmt: skip
    if ns.model != "reference" and ns.decode != "full":
        return _usage_error(f"--decode sharded is for the reference model, got --model {ns.model} --decode {ns.decode}")
    if ns.model == "reference" and (ns.kv_dtype == "fp32" or ns.dtype != "float32"):
        return _usage_error("--kv-dtype fp32 and --dtype are for --model deepseek-v32|glm5 (the reference model "
                            f"computes in float64 and stores bf16 or fp8), got --kv-dtype {ns.kv_dtype} "
                            f"--dtype {ns.dtype}")  # fmt: skip
    cp = env[1] if env is not None else (ns.cp or 2)
    import torch

    device = ns.device
    if device == "auto":
        want = env[2] + 1 if env is not None else cp
        device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= want else "cpu"
    args = {**vars(ns), "cp": cp, "device": device}
    if env is not None:
        rank = env[0]
        results, wall, pd = _torchrun(args, rank, cp, env[2])
    else:
        rank, pd = 0, _start_decode(args) if ns.pd else None
        if pd is not None:
            args.update(pd.rank_args)
        t0 = time.perf_counter()
        results = _spawn(args)
        wall = time.perf_counter() - t0
    return _report(ns, args, results, wall, pd, printing=rank == 0)  # one job, one report: rank 0 prints


def _report(ns, args: dict, results: list[dict], wall: float, pd, *, printing: bool = True) -> int:
    """Print the table or the JSON object of a finished run; the exit code (0 parity, 1 otherwise).

    Every torchrun rank computes the verdict from the same gathered results (the same exit code everywhere);
    only rank 0 prints, and only rank 0, which hosts the decode process of ``--pd``, adds its verdict.
    """
    errors = [r for r in results if "error" in r]
    if errors:
        if printing:
            for e in errors:
                print(f"rank {e['rank']} failed: {e['error']}", file=sys.stderr)
            if ns.json:
                print(json.dumps({"parity": False, "cp": args["cp"], "error": errors[0]["error"].splitlines()[0]}))
        return 1
    if ns.multi_turn:
        from dtkv._demo_multi_turn import multi_turn_summary, print_table

        summary = multi_turn_summary(results, args, wall)
        if printing:
            if ns.json:
                print(json.dumps(summary))
            else:
                print_table(summary)
        return 0 if summary["parity"] else 1
    if ns.model == "reference":
        summary = _reference_summary(ns, args, results, wall)
    else:
        from dtkv.integrations.transformers._demo import summary as hf_summary

        summary = hf_summary(args, results, wall, args["device"])
    if pd is not None:
        summary.update(pd.finish(results, timeout_s=ns.timeout))
        summary["parity"] = summary["parity"] and summary["pd_parity"]
    if not printing:
        return 0 if summary["parity"] else 1
    if ns.json:
        print(json.dumps(summary))
    else:
        _print_table(ns, args, summary, wall, pd is not None)
    return 0 if summary["parity"] else 1


def _reference_summary(ns, args: dict, results: list[dict], wall: float) -> dict:
    r0 = results[0]
    decode_rel = max(r["decode_logits_max_rel"] for r in results)
    parity = all(r["tokens_equal"] and r["kv_equal"] for r in results) and all(
        r["outputs"] == r0["outputs"] for r in results
    )
    parity = parity and decode_rel <= 1e-9
    per_rank = max(r["kv_bytes_per_rank"] for r in results)
    scratch = max(r["scratch_bytes_per_rank"] for r in results)
    return {
        "parity": parity,
        "cp": args["cp"],
        "tokens": ns.tokens,
        "requests": ns.requests,
        "chunk": ns.chunk,
        "chunks": -(-max(len(p) for p in _prompts(ns.tokens, ns.requests, 97, ns.seed)) // ns.chunk),
        "page_size": 64 if ns.attention == "flashmla" else ns.page_size,
        "kv_dtype": ns.kv_dtype,
        "split": ns.split,
        "mode": r0["mode"],
        "device": args["device"],
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
        "attention": ns.attention,
        "decode_logits_max_rel": decode_rel,
        "decode_comm_bytes_per_step": r0["decode_comm_bytes"] // max(1, ns.decode_steps),
    }


def _print_table(ns, args: dict, summary: dict, wall: float, pd: bool) -> None:
    kib, s, cp = 1024, summary, args["cp"]
    chunks = -(-max(len(p) for p in _prompts(ns.tokens, ns.requests, 2, ns.seed)) // ns.chunk)
    rows = [
        ("model", ns.model if ns.model == "reference" else f"{ns.model} (tiny, random weights, {ns.dtype})"),
        ("tokens (requests)", f"{ns.tokens} ({ns.requests})"),
        ("chunks x chunk size", f"{chunks} x {ns.chunk}"),
        ("split / KV mode", f"{ns.split} / {s['mode']}"),
        ("KV dtype, page size", f"{ns.kv_dtype}, {ns.page_size}"),
        ("KV bytes per rank: replicated", f"{s['kv_bytes_replicated'] / kib:,.1f} KiB"),
        ("KV bytes per rank: sharded", f"{s['kv_bytes_per_rank'] / kib:,.1f} KiB"),
        ("materialization scratch per rank", f"{s['scratch_bytes_per_rank'] / kib:,.1f} KiB"),
        ("capacity multiplier (pool bytes)", f"{s['capacity_multiplier']:.2f}x (cp={cp})"),
        ("rows direct-written / handed off", f"{s['direct_rows']} / {s['handoff_rows']}"),
    ]
    if ns.model == "reference":
        rows += [
            ("  with this batch's scratch charged", f"{s['capacity_multiplier_with_scratch']:.2f}x"),
            ("time: replicated / sharded", f"{s['seconds_baseline']:.2f} s / {s['seconds_sharded']:.2f} s"),
            ("decode (logits vs full view)", f"{ns.decode} ({s['decode_logits_max_rel']:.1e} max relative difference)"),
            ("parity with replicated baseline", "OK (tokens, logits path and KV bytes)" if s["parity"] else "MISMATCH"),
        ]
    else:
        verdict = "OK" if s["parity"] else "MISMATCH"
        rows += [
            ("time: sharded prefill + decode", f"{s['seconds_sharded']:.2f} s"),
            ("parity with the model's own forward",
             f"{verdict} (tokens equal: {s['tokens_equal']}, max |logit diff| {s['max_abs_logit_diff']:.2e}, "
             f"{100 * s['within_tolerance']:.1f}% within {s['tolerance']:.0e})"),
            ("  vs full-precision keys (format cost)",
             f"max |logit diff| {s['max_abs_logit_diff_full_precision']:.2e}"),
        ]  # fmt: skip
    if pd:
        pd_ok = "OK (KV bytes and tokens)" if s["pd_parity"] else f"MISMATCH {s.get('pd_error', '')}"
        rows.append(("PD decode over Mooncake", pd_ok))
        if "pd_entries" in s:
            sent = f"{s['pd_entries']} ({s['pd_min_entries']}) / {s['pd_bytes'] / kib:,.1f} KiB"
            rows.append(("  entries (minimum) / bytes sent", sent))
    width = max(len(k) for k, _ in rows)
    print(f"dtkv demo: cp={cp} on {args['device']}, {wall:.1f} s wall")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    print(f"  generated tokens: {s['generated']}")


if __name__ == "__main__":
    sys.exit(main())
