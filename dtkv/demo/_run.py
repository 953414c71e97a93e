"""One rank of the demo (collective over the prefill group): serve the prompts, compare, return a JSON-able result.

- :func:`run_rank` -- prefill and decode the prompts on sharded KV (``--decode full|sharded``), hand them to the
  decode group (``--pd``), and check them: the reference model against the replicated-KV baseline (run here too),
  a transformers model against its own forward (rank 0); ``--multi-turn`` runs the chat workload without and with
  the prefix cache instead (:mod:`dtkv.demo.workloads`).

Every rank returns the same checks (rank 0 alone compares a transformers model with its own forward). Progress lines
(``prefill chunk k/n``, ``decode step k/n``, ``multi-turn step k``) go to stderr through :mod:`dtkv._log`.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import torch
import torch.distributed as dist

from dtkv._log import Progress, progress
from dtkv.demo import _verdict as verdict
from dtkv.demo._models import DemoModel, load, prompts
from dtkv.demo.workloads import max_diff
from dtkv.runtime import Runtime, num_pages_for

__all__ = ["run_rank"]


def _stepper(what: str):
    """A ``progress(k, n)`` callback logging ``what k/n`` lines."""
    state: dict[str, Progress] = {}

    def on_step(k: int, n: int) -> None:
        state.setdefault("p", Progress(what, total=n)).step()

    return on_step


def _rows(stats: dict, before: dict, tokens: int) -> dict:
    """This rank's KV rows of a phase: written directly, handed off (the rest of the phase's ``tokens`` rows were
    all-gathered with their steps; the summary adds the ranks up)."""
    direct = stats["direct_rows"] - before.get("direct_rows", 0)
    return {"direct": direct, "handed_off": stats["handoff_rows"] - before.get("handoff_rows", 0), "tokens": tokens}


def _serve(
    model: DemoModel, args: dict, group, ps: list[list[int]], *, mode, decode_mode, label: str, send: bool = False
) -> dict[str, Any]:
    """Prefill then decode ``ps`` on one runtime (collective); logits, tokens, KV bytes, stats, timings.

    ``send``: hand the prefilled requests to ``--pd``'s decode group (timed apart: ``seconds`` is prefill and
    decode only, ``pd_seconds`` the hand-off)."""
    world = 1 if group is None else dist.get_world_size(group)
    pages = num_pages_for([len(p) for p in ps], page_size=args["page_size"], decode_steps=args["decode_steps"],
                          cp_size=world)  # fmt: skip
    rt = Runtime(
        model.adapter(), num_pages=pages, group=group,
        mode=mode, split=args["split"], decode_mode=decode_mode, attention=args["attention"],
        page_major=args.get("page_major") in ("both", "prefill"),
    )  # fmt: skip
    try:
        for p in ps:
            rt.add_request(p)
        if group is not None:
            dist.barrier(group)
        t0 = time.perf_counter()
        done = rt.prefill(args["chunk"], return_logits=True, progress=_stepper(f"{label}: prefill chunk"))
        logits: list[torch.Tensor] = done[1]  # type: ignore[index, assignment]  # (first tokens, logits)
        after_prefill = dict(rt.stats)
        pd_report: dict[str, Any] = {}
        if send and args.get("pd_port"):  # hand the prefilled requests to the decode group
            from dtkv.demo._pd import send_from_rank

            t_send = time.perf_counter()
            pd_report = send_from_rank(rt, args)
            pd_report["pd_seconds"] = time.perf_counter() - t_send
        outputs, decode_logits = rt.decode(
            args["decode_steps"], return_logits=True, progress=_stepper(f"{label}: decode step")
        )
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        seconds = time.perf_counter() - t0 - pd_report.get("pd_seconds", 0.0)
        kv = [rt.kv_bytes(r.rid) for r in rt.requests]
        n_decode = sum(len(o) - 1 for o in outputs)
        return {
            "logits": [x.cpu() for x in logits], "decode_logits": [x.cpu() for x in decode_logits],
            "outputs": outputs, "kv": kv, "seconds": seconds, "mode": rt.mode, "steps": rt.stats["steps"],
            "kv_bytes_per_rank": rt.pool.bytes_per_rank(), "kv_bytes_replicated": rt.pool.replicated_bytes(),
            "scratch_bytes_per_rank": rt.stats["scratch_bytes"],
            "prefill_rows": _rows(after_prefill, {}, sum(len(p) for p in ps)),
            "decode_rows": _rows(rt.stats, after_prefill, n_decode) if decode_mode == "full" else
            {"owner_kept": n_decode, "tokens": n_decode},
            "decode_comm_bytes": rt.stats["decode_comm_bytes"], "layouts": dict(rt.pool.layouts), **pd_report,
        }  # fmt: skip
    finally:
        rt.close()


def _kv_differing_bytes(a: list[dict], b: list[dict]) -> int:
    return sum(int((x[n] != y[n]).sum()) for x, y in zip(a, b) for n in x)


def _reference_checks(base: dict, cand: dict, decode_mode: str) -> dict:
    """The reference model: the sharded run against the replicated-KV baseline (bitwise; sharded decode 1e-9)."""
    n = len(base["outputs"])
    d, _, where = max_diff(cand["logits"], base["logits"], [f"request {i} prompt" for i in range(n)])
    kv_bad = _kv_differing_bytes(cand["kv"], base["kv"])
    prefill = verdict.check(
        d == 0 and kv_bad == 0 and [o[:1] for o in cand["outputs"]] == [o[:1] for o in base["outputs"]],
        "prefill logits, greedy tokens and every stored KV byte bitwise equal to the replicated-KV baseline (the same "
        "split of tokens over ranks, so the same float64 arithmetic)",
        d, where,
        "bitwise equal" if d == 0 and kv_bad == 0 else f"{kv_bad} KV bytes differ; max |logit diff| {d:.2e}",
        kv_bytes_differing=kv_bad,
    )  # fmt: skip
    labels = [f"decode step {s}" for s in range(len(base["decode_logits"]))]
    d_abs, d_rel, where = max_diff(cand["decode_logits"], base["decode_logits"], labels)
    tokens = cand["outputs"] == base["outputs"]
    if decode_mode == "full":
        decode = verdict.check(
            tokens and d_abs == 0, "greedy tokens and decode logits bitwise equal to the baseline's full-view decode",
            d_abs, where, "bitwise equal" if d_abs == 0 else "logits differ",
        )  # fmt: skip
    else:
        rtol = verdict.SHARDED_DECODE_RTOL
        decode = verdict.check(
            tokens and d_rel <= rtol,
            f"greedy tokens equal and decode logits within {rtol:g} relative of the baseline's full-view decode "
            "(sharded decode changes only the float64 summation order: split softmax merged by LSE)",
            d_rel, where, f"{d_rel:.1e} relative: float64 summation order" if tokens else "greedy tokens differ",
        )  # fmt: skip
    return {"prefill": prefill, "decode": decode}


def _rows_of(served: dict, n: int) -> list[torch.Tensor]:
    """Request ``i``'s logits of a served run: its prompt's last position, then each decode step's."""
    return [torch.cat([served["logits"][i]] + [s[i : i + 1] for s in served["decode_logits"]]) for i in range(n)]


def _own_forward_check(model: DemoModel, ps, outputs, logit_rows, args, one_process=False) -> tuple[dict, dict]:
    """A transformers model's produced logits against its own forward: the verdict and the full-precision cost.

    ``logit_rows[i]`` holds request ``i``'s logits for its positions ``len(ps[i]) - len(logit_rows[i]) + j`` ...,
    ending at the last generated token's input. ``one_process``: ``(outputs, logit_rows)`` of the same prompts
    served by one process, compared with the same reference (:func:`dtkv.demo._verdict.one_process_note`);
    ``None`` when this run is one process; ``False``: not measured.
    """
    from dtkv.integrations.transformers import geometry_of, kv_layouts, reference_logits, uses_fp8_indexer

    kv_dtype: Any = model.kv_dtype
    layouts = kv_layouts(geometry_of(model.lm), kv_dtype, 1)  # rounding ignores the page size
    fp8 = uses_fp8_indexer(args.get("attention") or "torch", layouts["index"])  # the run's own indexer formula
    rounded = args.get("attention") == "flashmla"  # FlashMLA rounds the probabilities to bf16
    out = {}
    one: dict | None = None
    same_tokens = bool(one_process) and one_process[0] == outputs
    for key, lay in (("", layouts), ("_full_precision", None)):
        diffs, base, labels, margins, tokens_equal = [], [], [], [], True
        one_diffs, vs_sharded = [], []
        for i, (p, got) in enumerate(zip(ps, logit_rows)):
            seq = p + outputs[i][:-1]
            ref = reference_logits(model.lm, seq, layouts=lay, fp8_indexer=fp8 and lay is not None)[-got.shape[0] :]
            diffs.append((ref - got.to(ref.device)).abs().amax(-1).cpu())
            if key == "" and same_tokens:
                mine = one_process[1][i].to(ref.device)
                one_diffs.append((ref - mine).abs().amax(-1).cpu())
                vs_sharded.append(float((mine - got.to(ref.device)).abs().max()))
            if rounded:
                own = reference_logits(
                    model.lm, seq, layouts=lay, rounded_probabilities=True, fp8_indexer=fp8 and lay is not None
                )[-got.shape[0] :]
                base.append((ref - own).abs().amax(-1).cpu())
            first = len(p) + len(outputs[i]) - 1 - got.shape[0]
            labels += [f"request {i} position {first + j}" for j in range(got.shape[0])]
            gen = ref[-len(outputs[i]) :]
            for row, want, chosen in zip(gen, gen.argmax(-1).tolist(), outputs[i]):
                if want != chosen:  # teacher-forced on dtkv's tokens, so later positions still compare
                    margins.append(float(row[want] - row[chosen]))
            tokens_equal &= not margins
        d = torch.cat(diffs)
        if key == "" and one_process is not False:
            if one_process is None:
                one = None
            elif same_tokens:
                od = torch.cat(one_diffs)
                one = {"worst": float(od.max()), "where": labels[int(od.argmax())], "vs_sharded": max(vs_sharded)}
            else:  # one process chose other tokens: its later positions read other sequences
                one = {"worst": float("nan"), "where": "", "vs_sharded": float("inf")}
        if rounded:
            out[key] = verdict.rounded_attention_check(d, torch.cat(base), labels, tokens_equal, margins)
        else:
            measured: dict | None | Literal[False] = one if key == "" and one_process is not False else False
            out[key] = verdict.transformers_check(
                model.dtype, model.kv_dtype, d, labels, tokens_equal, margins, one_process=measured
            )
    return out[""], {
        "max_abs_logit_diff_full_precision": out["_full_precision"]["worst"],
        "tokens_equal_full_precision": out["_full_precision"]["tokens_equal"],
    }


def run_rank(rank: int, world: int, args: dict, group, device: torch.device) -> dict:
    """One rank's demo run (collective over ``group``); see the module docstring."""
    model = load(args, device)
    if args["multi_turn"]:
        return _multi_turn(rank, world, args, group, model)
    ps = prompts(args["tokens"], args["requests"], model.vocab_size, args["seed"])
    base = None
    if model.reference:
        base = _serve(model, args, group, ps, mode="replicated", decode_mode="full", label="baseline")
    cand = _serve(model, args, group, ps, mode=None, decode_mode=args["decode"], label="sharded", send=True)
    out = {k: v for k, v in cand.items() if k not in ("logits", "decode_logits", "kv", "layouts")}
    out.update(rank=rank, model_dtype=model.dtype, vocab_size=model.vocab_size)
    if base is not None:
        out["checks"] = _reference_checks(base, cand, args["decode"])
        out["seconds_baseline"] = base["seconds"]
        out["kv_bytes_replicated"] = base["kv_bytes_per_rank"]
    elif rank == 0:
        one_process: Any = None  # this run is one process; else serve the same prompts in one (cp=1) to compare
        if args.get("attention") == "flashmla":
            one_process = False  # held to the rounded forward's noise instead
        elif world > 1:
            alone = _serve(model, args, None, ps, mode=None, decode_mode=args["decode"], label="one process")
            one_process = (alone["outputs"], _rows_of(alone, len(ps)))
        check, extra = _own_forward_check(model, ps, cand["outputs"], _rows_of(cand, len(ps)), args, one_process)
        out["checks"] = {"prefill_decode": check}
        out.update(extra)
    progress("rank %d done", rank, all_ranks=True)
    return out


def _multi_turn(rank: int, world: int, args: dict, group, model: DemoModel) -> dict:
    """The chat workload without and with the prefix cache (and, for the reference model, the replicated baseline)."""
    from dtkv.demo.workloads import chat_workload, compare_runs, pool_pages, run_workload, worst_logit_diff

    tokens = args["tokens"]
    wl = chat_workload(
        system_tokens=max(1, tokens // 4), turn_tokens=max(1, tokens // 16), turns=args["turns"],
        questions=args["shared_requests"], question_tokens=max(1, tokens // 32), vocab=model.vocab_size,
        seed=args["seed"],
    )  # fmt: skip
    room = pool_pages(wl, page_size=args["page_size"], decode_steps=args["decode_steps"], cp_size=world)
    cached_pages = args.get("pool_pages") or room
    runs, seconds, mode = {}, {}, None
    cases: list[tuple[str, Any, bool]] = [("baseline", "replicated", False)] if model.reference else []
    cases += [("no cache", None, False), ("prefix cache", None, True)]
    for label, run_mode, cache in cases:
        rt = Runtime(
            model.adapter(), num_pages=cached_pages if cache else room, group=group, mode=run_mode,
            split=args["split"], decode_mode=args["decode"] if run_mode != "replicated" else "full",
            prefix_cache=cache, batch_invariant=not model.reference, attention=args["attention"],
            page_major=args.get("page_major") in ("both", "prefill"),
        )  # fmt: skip
        if run_mode is None:
            mode = rt.mode
        steps = Progress(f"multi-turn, {label}: step")

        def after_step(_rt, _p: Progress = steps) -> None:
            _p.step()

        if group is not None:
            dist.barrier(group)
        t0 = time.perf_counter()
        runs[label] = run_workload(
            rt, wl, chunk=args["chunk"], decode_steps=args["decode_steps"], after_step=after_step
        )
        seconds[label] = time.perf_counter() - t0
        rt.close()
    base, cached = runs["no cache"], runs["prefix cache"]
    same = compare_runs(base, cached)
    d_abs, d_rel, where = worst_logit_diff(cached, base)
    sharded = args["decode"] == "sharded"
    if not sharded:
        ok, tol_text = same["parity"], "tokens, logits and every stored KV byte bitwise equal"
    elif model.reference:  # the cache moves pages, so the sharded merge sums in another order (float64: absorbed)
        tol = verdict.SHARDED_DECODE_RTOL
        ok = same["tokens_equal"] and same["kv_equal"] and d_rel <= tol
        tol_text = f"tokens and every stored KV byte bitwise equal, logits within {tol:g} relative (sharded decode)"
    else:  # float32: a decoded token's KV row comes from the shards in one run, from a prefill step in the other
        tol = verdict.SHARDED_DECODE_ATOL
        ok = same["tokens_equal"] and d_abs <= tol
        tol_text = (
            f"tokens equal and logits within {tol:g} absolute (sharded decode: the cache moves pages, so the "
            "merge sums in another order, and the rows of decoded tokens may differ in their last bit)"
        )
    how = " (batch-invariant products in both runs)" if not model.reference else ""
    checks = {
        "prefix_cache": verdict.check(
            ok, f"{tol_text} to the same workload without the prefix cache{how}", d_abs, where,
            "bitwise equal" if same["parity"] else ("within the bound" if ok else f"differs: {same}"), **same,
        )
    }  # fmt: skip
    if model.reference:
        ref_same = compare_runs(runs["baseline"], base)
        b_abs, b_rel, b_where = worst_logit_diff(base, runs["baseline"])
        b_ok = (
            ref_same["parity"]
            if not sharded
            else (ref_same["tokens_equal"] and ref_same["kv_equal"] and b_rel <= verdict.SHARDED_DECODE_RTOL)
        )
        checks["prefill_decode"] = verdict.check(
            b_ok, "the sharded run without the cache against the replicated-KV baseline: tokens and KV bytes bitwise, "
            f"logits bitwise (sharded decode: within {verdict.SHARDED_DECODE_RTOL:g} relative)", b_abs, b_where,
            "bitwise equal" if ref_same["parity"] else f"{b_rel:.1e} relative",
        )  # fmt: skip
    elif rank == 0:
        rids = sorted(base.logits)
        rows = [torch.stack(base.logits[k]) for k in rids]
        check, extra = _own_forward_check(
            model, [base.prompts[k] for k in rids], [base.outputs[k] for k in rids], rows, args
        )
        checks["prefill_decode"] = check
    return {
        "rank": rank, "checks": checks, "mode": mode, "num_pages": cached_pages, "requests": len(base.outputs),
        "prompt_tokens": cached.prompt_tokens, "prefill_tokens": cached.prefill_tokens,
        "prefill_tokens_no_cache": base.prefill_tokens, "hit_tokens": cached.hit_tokens,
        "prefix_hit_rate": cached.hit_rate, "evicted_pages": cached.evicted_pages,
        "shared_pages_distinct": cached.shared_pages_distinct,
        "shared_pages_referenced": cached.shared_pages_referenced,
        "shared_pages_no_cache": base.shared_pages_distinct, "peak_pages_allocated": cached.peak_pages_allocated,
        "peak_pages_allocated_no_cache": base.peak_pages_allocated, "seconds_cache": seconds["prefix cache"],
        "seconds_no_cache": seconds["no cache"], "outputs": {str(k): v for k, v in cached.outputs.items()},
        "tokens_equal": same["tokens_equal"], "logits_equal": same["logits_equal"], "kv_equal": same["kv_equal"],
        "model_dtype": model.dtype,
    }  # fmt: skip
