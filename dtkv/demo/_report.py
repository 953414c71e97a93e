"""The demo's one JSON object and its table, from every rank's result (and the decode group's, with ``--pd``).

``parity`` is the conjunction of ``checks`` (one per phase that ran: ``prefill`` / ``decode`` or
``prefill_decode``, ``prefix_cache``, ``pd``; each with its rule, its worst case and why, see
:mod:`dtkv.demo._verdict`) and of the ranks agreeing on the generated tokens.

Rows of KV (per layer) add up: a prompt token's row is written directly by its compute owner, handed off to its
page's owner through a small all-gather, or all-gathered with the step (owner-filtered, or replicated); a decode
token's likewise over a full view, or kept by its page's owner with no collective in sharded decode.
"""

from __future__ import annotations

__all__ = ["print_table", "summary", "toy_size_note"]


def _agree(results: list[dict]) -> bool:
    return all(r["outputs"] == results[0]["outputs"] for r in results)


def summary(args: dict, results: list[dict], wall: float, pd: dict | None) -> dict:
    """The demo's JSON object (see the module docstring)."""
    r0 = results[0]
    checks = dict(r0["checks"])
    if pd is not None:
        checks["pd"] = pd.pop("pd_check")
    agree = _agree(results)
    out = {
        "parity": bool(agree and all(c["ok"] for c in checks.values())),
        "checks": checks,
        "ranks_agree": agree,
        "model": args["model"],
        "model_dtype": r0["model_dtype"],
        "cp": args["cp"],
        "tokens": args["tokens"],
        "chunk": args["chunk"],
        "page_size": args["page_size"],
        "kv_dtype": args["kv_dtype"],
        "split": args["split"],
        "decode": args["decode"],
        "attention": args["attention"],
        "mode": r0["mode"],
        "device": args["device"],
        "wall_seconds": wall,
    }
    if args["multi_turn"]:
        keys = ("requests", "prompt_tokens", "prefill_tokens", "prefill_tokens_no_cache", "hit_tokens",
                "prefix_hit_rate", "evicted_pages", "num_pages", "shared_pages_distinct", "shared_pages_referenced",
                "shared_pages_no_cache", "peak_pages_allocated", "peak_pages_allocated_no_cache", "tokens_equal",
                "logits_equal", "kv_equal")  # fmt: skip
        out.update({k: r0[k] for k in keys})
        out.update(
            turns=args["turns"], shared_requests=args["shared_requests"],
            prefill_tokens_saved=r0["prefill_tokens_no_cache"] - r0["prefill_tokens"],
            seconds_cache=max(r["seconds_cache"] for r in results),
            seconds_no_cache=max(r["seconds_no_cache"] for r in results),
        )  # fmt: skip
        return out
    per_rank = max(r["kv_bytes_per_rank"] for r in results)
    scratch = max(r["scratch_bytes_per_rank"] for r in results)
    out.update(
        requests=args["requests"],
        chunks=max(-(-n // args["chunk"]) for n in _prompt_lens(args)),
        steps=r0["steps"],
        kv_bytes_per_rank=per_rank,
        kv_bytes_replicated=r0["kv_bytes_replicated"],
        scratch_bytes_per_rank=scratch,
        capacity_multiplier=r0["kv_bytes_replicated"] / per_rank,
        capacity_multiplier_with_scratch=r0["kv_bytes_replicated"] / (per_rank + scratch),
        prefill_rows=_add_rows([r["prefill_rows"] for r in results]),
        decode_rows=_add_rows([r["decode_rows"] for r in results]),
        decode_comm_bytes_per_step=r0["decode_comm_bytes"] // max(1, args["decode_steps"]),
        seconds_sharded=max(r["seconds"] for r in results),
        generated=r0["outputs"],
    )
    out["direct_rows"] = out["prefill_rows"]["direct"]
    out["handoff_rows"] = out["prefill_rows"]["handed_off"]
    if "seconds_baseline" in r0:
        out["seconds_baseline"] = max(r["seconds_baseline"] for r in results)
    if "pd_seconds" in r0:  # the hand-off, timed apart from seconds_sharded
        out["seconds_pd_send"] = max(r["pd_seconds"] for r in results)
    for k in ("max_abs_logit_diff_full_precision", "tokens_equal_full_precision"):
        if k in r0:
            out[k] = r0[k]
    c = checks.get("prefill_decode")
    if c is not None:  # the transformers verdict's numbers, at the top level as before
        for k in ("tokens_equal", "token_flips", "max_flip_margin", "max_abs_logit_diff", "mean_abs_logit_diff",
                  "within_tolerance", "tolerance", "min_within_tolerance", "rounded_forward_mean",
                  "rounded_forward_max"):  # fmt: skip
            if k in c:  # a FlashMLA run's verdict has no tolerance, but the rounded forward's noise
                out[k] = c[k]
    if "decode" in checks and args["decode"] == "sharded":
        out["decode_logits_max_rel"] = checks["decode"]["worst"]
    if pd is not None:
        out.update(pd)
        out["decode_cp"] = args["decode_cp"]
        out["page_major"] = args.get("page_major") or "none"
    return out


def _prompt_lens(args: dict) -> list[int]:
    n, t = args["requests"], args["tokens"]
    weights = list(range(n, 0, -1))
    lens = [max(1, int(w / sum(weights) * t)) for w in weights]
    lens[0] += t - sum(lens)
    return lens


def _add_rows(per_rank: list[dict]) -> dict:
    """The ranks' rows of a phase added up: every row is one rank's local row, written directly or handed off; the
    rest went through the step's all-gather (owner-filtered or replicated writes)."""
    tokens = per_rank[0]["tokens"]
    if "owner_kept" in per_rank[0]:
        return {"owner_kept": tokens, "tokens": tokens}
    direct = sum(r["direct"] for r in per_rank)
    handoff = sum(r["handed_off"] for r in per_rank)
    return {"direct": direct, "handed_off": handoff, "all_gathered": tokens - direct - handoff, "tokens": tokens}


def _rows_text(rows: dict, what: str) -> str:
    if "owner_kept" in rows:
        return f"{rows['owner_kept']} kept by their page's owner, no collective = {rows['tokens']} {what}"
    return (f"{rows['direct']} direct + {rows['handed_off']} handed off + {rows['all_gathered']} all-gathered = "
            f"{rows['tokens']} {what}")  # fmt: skip


def toy_size_note(s: dict) -> str:
    """One line: why a demo-sized run shows the view's scratch as a cost, and where to see the real effect."""
    from dtkv.capacity import context_capacity

    big = context_capacity("glm5", cp_size=8, context_tokens=1 << 20)
    gib = 1 << 30
    return (
        f"the view's scratch (two layers of one batch's view) and each step's host work are fixed costs that "
        f"dominate {s['tokens']:,} tokens; at GLM-5, cp 8, 1M tokens a rank holds "
        f"{big.sharded_bytes_per_rank / gib:.2f} GiB sharded + {big.scratch_bytes_per_rank / gib:.2f} GiB scratch vs "
        f"{big.replicated_bytes_per_rank / gib:.2f} GiB replicated (dtkv capacity --cp 8 --context 1048576; times: "
        "docs/performance.md)"
    )


def _verdict_rows(checks: dict) -> list[tuple[str, str]]:
    rows = []
    for name, c in checks.items():
        where = f" at {c['where']}" if c["where"] else ""
        rows.append((f"parity: {name}", f"{'OK' if c['ok'] else 'MISMATCH'}: {c['reason']} (worst {c['worst']:.2e}"
                                        f"{where})"))  # fmt: skip
        rows.append(("  rule", c["rule"]))
    return rows


def print_table(s: dict) -> None:
    """The human-readable form of :func:`summary`."""
    kib = 1024
    model = s["model"] if s["model"] == "reference" else f"{s['model']} ({s['model_dtype']})"
    rows = [
        ("model / attention", f"{model} / {s['attention']}"),
        ("split / KV mode / decode", f"{s['split']} / {s['mode']} / {s['decode']}"),
        ("KV dtype, page size, chunk", f"{s['kv_dtype']}, {s['page_size']} tokens, {s['chunk']} tokens"),
    ]
    if "prefix_hit_rate" in s:
        rows += [
            ("requests (turns + shared-prompt)", f"{s['requests']} ({s['turns']} + {s['shared_requests']})"),
            ("prompt tokens / computed: no cache, cache",
             f"{s['prompt_tokens']} / {s['prefill_tokens_no_cache']}, {s['prefill_tokens']}"),
            ("prefix hit rate", f"{s['prefix_hit_rate']:.1%} ({s['prefill_tokens_saved']} prefill tokens saved)"),
            ("shared-prompt pages: distinct / table entries",
             f"{s['shared_pages_distinct']} / {s['shared_pages_referenced']} (no cache: {s['shared_pages_no_cache']})"),
            ("pool pages, evicted", f"{s['num_pages']}, {s['evicted_pages']}"),
            ("time: no cache / cache", f"{s['seconds_no_cache']:.2f} s / {s['seconds_cache']:.2f} s"),
        ]  # fmt: skip
    else:
        rows += [
            ("tokens (requests), chunks", f"{s['tokens']} ({s['requests']}), {s['chunks']} x {s['chunk']}"),
            ("KV bytes per rank: replicated / sharded",
             f"{s['kv_bytes_replicated'] / kib:,.1f} KiB / {s['kv_bytes_per_rank'] / kib:,.1f} KiB"),
            ("capacity multiplier (pool bytes)", f"{s['capacity_multiplier']:.2f}x (cp={s['cp']})"),
            ("  with this batch's view scratch",
             f"{s['capacity_multiplier_with_scratch']:.2f}x ({s['scratch_bytes_per_rank'] / kib:,.1f} KiB per rank)"),
            ("prefill KV rows (per layer)", _rows_text(s["prefill_rows"], "prompt tokens")),
            ("decode KV rows (per layer)", _rows_text(s["decode_rows"], "decode tokens")),
            ("time: sharded prefill + decode", f"{s['seconds_sharded']:.2f} s"
             + (f" (replicated baseline {s['seconds_baseline']:.2f} s)" if "seconds_baseline" in s else "")),
        ]  # fmt: skip
        if "seconds_pd_send" in s:
            rows.append(("time: PD hand-off (not in the above)", f"{s['seconds_pd_send']:.2f} s"))
        if s["scratch_bytes_per_rank"] > 0.1 * s["kv_bytes_per_rank"]:
            rows.append(("toy size", toy_size_note(s)))
        if s["decode"] == "sharded":
            traffic = f"{s['decode_comm_bytes_per_step'] / kib:,.1f} KiB per rank"
            rows.append(("sharded decode traffic per step", traffic))
        if "max_abs_logit_diff_full_precision" in s:
            rows.append(("vs full-precision keys (format cost)",
                         f"max |logit diff| {s['max_abs_logit_diff_full_precision']:.2e}"))  # fmt: skip
    if "pd_parity" in s:
        if "pd_entries" in s:
            rows.append(("PD entries (minimum) / bytes sent",
                         f"{s['pd_entries']} ({s['pd_min_entries']}) / {s['pd_bytes'] / kib:,.1f} KiB"))  # fmt: skip
            rows.append(("PD decode group", f"{s['decode_cp']} rank(s), {s['pd_decode_mode']}, "
                         f"{s['pd_kv_bytes_per_decode_rank'] / kib:,.1f} of {s['pd_kv_bytes_replicated'] / kib:,.1f} "
                         "KiB per rank"))  # fmt: skip
        elif "pd_error" in s:
            rows.append(("PD error", s["pd_error"]))
    rows += _verdict_rows(s["checks"])
    rows.append(("parity", "OK" if s["parity"] else "MISMATCH"))
    width = max(len(k) for k, _ in rows)
    print(f"dtkv demo: cp={s['cp']} on {s['device']}, {s['wall_seconds']:.1f} s wall")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    if "generated" in s:
        print(f"  generated tokens: {s['generated']}")
