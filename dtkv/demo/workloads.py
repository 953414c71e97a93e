"""Multi-turn chat and shared-system-prompt workloads for any runtime, run with or without a prefix cache.

- :func:`chat_workload` -> :class:`ChatWorkload`: seeded token ids of a system prompt, the user turns of one
  conversation and the questions of several requests that share the system prompt.
- :func:`run_workload` -> :class:`WorkloadRun`: drives a :class:`dtkv.runtime.Runtime` (any model) through it
  (SPMD, every rank the same calls) and records every produced token's logits, every request's tokens and the
  stored KV bytes of each request just before it finishes (or at the end, for the one left live).
- :func:`compare_runs`: whether two runs agree bit for bit (tokens, logits, KV bytes);
  :func:`worst_logit_diff`: where their logits differ most.

The schedule: turn 0 (system prompt + first user turn) is prefilled, decoded and finished; then the shared-prompt
requests arrive together, are prefilled and decoded, and all but the last finish; then each later turn's prompt
is the previous prompt, its answer and a new user turn. The last shared-prompt request stays live (it keeps
decoding with every turn) until the end, so a cache under pressure has a live request whose pages it must not
touch. Without a cache each prompt is computed from scratch; with one, the system prompt and each previous turn
are served from cached pages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from dtkv.runtime import num_pages_for

__all__ = [
    "ChatWorkload",
    "WorkloadRun",
    "chat_workload",
    "compare_runs",
    "max_diff",
    "pool_pages",
    "prompt_lens",
    "run_workload",
    "worst_logit_diff",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class ChatWorkload:
    """Token ids of one conversation and of the requests sharing its system prompt."""

    system: tuple[int, ...]
    """The system prompt every request starts with."""
    user_turns: tuple[tuple[int, ...], ...]
    """Turn ``t`` of the conversation appends ``user_turns[t]`` to the previous prompt and its answer."""
    questions: tuple[tuple[int, ...], ...]
    """Shared-prompt request ``i`` is ``system + questions[i]``."""


@dataclass(kw_only=True)
class WorkloadRun:
    """What :func:`run_workload` recorded (identical on every rank)."""

    prompts: dict[int, list[int]] = field(default_factory=dict)
    """Request id -> prompt token ids."""
    outputs: dict[int, list[int]] = field(default_factory=dict)
    """Request id -> generated tokens."""
    logits: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    """Request id -> float64 logits ``[V]`` of each generated token, in order."""
    kv: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    """Request id -> ``runtime.kv_bytes(rid)`` just before it finished (or at the end, if live)."""
    prompt_tokens: int = 0
    """Prompt tokens of every request."""
    prefill_tokens: int = 0
    """Prompt tokens actually computed (the rest came from the cache)."""
    hit_tokens: int = 0
    """Prompt tokens served from cached pages."""
    evicted_pages: int = 0
    """Cached pages evicted to make room."""
    shared_pages_distinct: int = 0
    """Distinct pages the live shared-prompt requests held after their prefill (a shared page counts once)."""
    shared_pages_referenced: int = 0
    """The same requests' page-table entries (a shared page counts once per request)."""
    peak_pages_allocated: int = 0
    """Most distinct pages allocated at once (live requests and cache entries)."""

    @property
    def hit_rate(self) -> float:
        """Fraction of prompt tokens served from the cache."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def chat_workload(
    *, system_tokens: int, turn_tokens: int, turns: int, questions: int, question_tokens: int, vocab: int, seed: int
) -> ChatWorkload:
    """A seeded :class:`ChatWorkload` (uneven lengths: user turn ``t`` has ``turn_tokens + t`` tokens)."""
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(0, vocab, (n,), generator=g).tolist())

    return ChatWorkload(
        system=ids(system_tokens),
        user_turns=tuple(ids(turn_tokens + t) for t in range(turns)),
        questions=tuple(ids(question_tokens + i) for i in range(questions)),
    )


def run_workload(
    runtime,
    workload: ChatWorkload,
    *,
    chunk: int,
    decode_steps: int,
    after_step: Callable[[object], None] | None = None,
) -> WorkloadRun:
    """Run ``workload`` on ``runtime`` (a fresh :class:`dtkv.runtime.Runtime`; collective in CP modes).

    Prefill runs ``chunk`` tokens per request per step; every request then decodes ``decode_steps`` tokens
    (requests live at the time decode along). See the module docstring for the schedule. ``after_step(runtime)``
    is called after every step and every finished request (e.g. to check invariants).
    """
    run = WorkloadRun()
    system = list(workload.system)

    def note() -> None:
        run.peak_pages_allocated = max(run.peak_pages_allocated, runtime.allocator.num_allocated())
        if after_step is not None:
            after_step(runtime)

    def add(prompt: list[int]):
        req = runtime.add_request(prompt)
        run.prompts[req.rid] = list(prompt)
        run.outputs[req.rid], run.logits[req.rid] = req.output, []
        run.prompt_tokens += len(prompt)
        run.hit_tokens += req.cached_tokens
        return req

    def produce(req, row: torch.Tensor) -> None:
        run.logits[req.rid].append(row.clone())
        req.output.append(int(row.argmax()))

    def prefill() -> None:
        while True:
            todo = [r for r in runtime.requests if not r.finished and r.num_computed < len(r.prompt)]
            if not todo:
                return
            lens = [min(chunk, len(r.prompt) - r.num_computed) for r in todo]
            run.prefill_tokens += sum(lens)
            for r, row in zip(todo, runtime.step(todo, lens)):
                if r.num_computed == len(r.prompt):
                    produce(r, row)
            note()

    def decode() -> None:
        for _ in range(decode_steps):
            reqs = [r for r in runtime.requests if r.output and not r.finished]
            for r, row in zip(reqs, runtime.decode_step(reqs)):  # in the runtime's decode_mode
                produce(r, row)
            note()

    def finish(req) -> None:
        run.kv[req.rid] = runtime.kv_bytes(req.rid)
        runtime.finish_request(req.rid)
        note()

    prompt = system + list(workload.user_turns[0])
    turn = add(prompt)
    prefill()
    decode()
    finish(turn)
    shared = [add(system + list(q)) for q in workload.questions]
    prefill()
    live = list(shared)
    run.shared_pages_distinct = len({p for r in live for p in r.pages})
    run.shared_pages_referenced = sum(len(r.pages) for r in live)
    decode()
    for r in shared[:-1]:
        finish(r)
    for user in workload.user_turns[1:]:
        prompt = prompt + turn.output + list(user)
        turn = add(prompt)
        prefill()
        decode()
        finish(turn)
    for r in shared[-1:]:
        run.kv[r.rid] = runtime.kv_bytes(r.rid)
    if runtime.prefix_cache is not None:
        run.evicted_pages = runtime.prefix_cache.stats["evicted_pages"]
    return run


def compare_runs(a: WorkloadRun, b: WorkloadRun) -> dict[str, bool]:
    """``tokens_equal``, ``logits_equal``, ``kv_equal`` (all bitwise) and ``parity`` (all three)."""
    tokens = a.outputs == b.outputs
    logits = a.logits.keys() == b.logits.keys() and all(
        len(a.logits[k]) == len(b.logits[k]) and all(torch.equal(x, y) for x, y in zip(a.logits[k], b.logits[k]))
        for k in a.logits
    )
    kv = a.kv.keys() == b.kv.keys() and all(
        a.kv[k].keys() == b.kv[k].keys() and all(torch.equal(a.kv[k][n], b.kv[k][n]) for n in a.kv[k]) for k in a.kv
    )
    return {"tokens_equal": tokens, "logits_equal": logits, "kv_equal": kv, "parity": tokens and logits and kv}


def max_diff(xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor], labels: Sequence[str]) -> tuple[float, float, str]:
    """The largest ``|x - y|`` over the pairs (in float64): ``(absolute, relative to that y's largest |y|, where)``,
    ``(0.0, 0.0, "")`` when every pair agrees (or holds nothing)."""
    worst = (0.0, 0.0, "")
    for x, y, where in zip(xs, ys, labels):
        d = float((x.double() - y.double()).abs().max()) if x.numel() else 0.0
        if d > worst[0]:
            worst = (d, d / max(float(y.double().abs().max()), 1e-300), where)
    return worst


def worst_logit_diff(a: WorkloadRun, b: WorkloadRun) -> tuple[float, float, str]:
    """:func:`max_diff` over every token both runs produced: ``(absolute, relative to b's max, where)``."""
    pairs = [(x, y, f"request {k}, token {j}") for k in sorted(a.logits.keys() & b.logits.keys())
             for j, (x, y) in enumerate(zip(a.logits[k], b.logits[k]))]  # fmt: skip
    return max_diff([p[0] for p in pairs], [p[1] for p in pairs], [p[2] for p in pairs])


def prompt_lens(workload: ChatWorkload, *, decode_steps: int) -> list[int]:
    """The prompt length of every request :func:`run_workload` adds (each answer is ``decode_steps + 1`` tokens)."""
    answer = decode_steps + 1
    turns, system = workload.user_turns, len(workload.system)
    lens = [system + sum(len(u) for u in turns[: t + 1]) + t * answer for t in range(len(turns))]
    return lens + [system + len(q) + answer * len(turns) for q in workload.questions]


def pool_pages(workload: ChatWorkload, *, page_size: int, decode_steps: int, cp_size: int) -> int:
    """Logical pages that hold every request of ``workload`` at once, so nothing is ever evicted
    (:func:`dtkv.runtime.num_pages_for` of its requests)."""
    return num_pages_for(prompt_lens(workload, decode_steps=decode_steps), page_size=page_size,
                         decode_steps=decode_steps, cp_size=cp_size)  # fmt: skip
