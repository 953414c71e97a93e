"""``dtkv capacity`` (``python -m dtkv.capacity``): GiB per rank, replicated vs sharded, for a model, cp and context.

Three questions, one per mode (:mod:`dtkv.capacity` computes each):

- ``--context T`` (the default, 1048576 tokens): KV bytes per rank of a ``T``-token context, replicated and sharded
  over ``--cp`` ranks, and the view's scratch;
- ``--tokens B``: a fixed per-rank budget (the bytes of a replicated pool of ``B`` tokens): the logical tokens the
  sharded pools hold in it after the scratch, and the capacity multiplier;
- ``--shared-prefix-tokens P --suffix-tokens S`` (budget ``--tokens``, default 1048576): concurrent requests that
  share a prefix, with and without a prefix cache.

The model is ``--model NAME`` (a preset; ``glm-5``, ``GLM5``, ``deepseek-v3.2`` name presets too) or ``--config
PATH`` (a DSA ``config.json``, or the checkpoint directory holding it; ``--kv-dtype``, ``--page-size``). A flag
out of range, a name that is no preset or a config that is not a DSA model's is a usage error: one ``error:`` line
on stderr, exit code 2. ``--json`` prints one object, one key per quantity, sizes in bytes.
"""

from __future__ import annotations

import argparse
import json
import sys

from dtkv.capacity import (
    PRESETS,
    CapacityReport,
    ContextReport,
    ModelGeometry,
    SharedPrefixReport,
    capacity,
    context_capacity,
    geometry_from_config,
    preset_name,
    shared_prefix_capacity,
)

__all__ = ["main", "parser"]

GIB = 1 << 30
DEFAULT_TOKENS = 1 << 20


def parser(prog: str = "python -m dtkv.capacity") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="GiB of KV per rank, replicated vs sharded, and the full view's scratch, for a model, a CP "
        "size and a context; or what a fixed per-rank budget holds. Computed on plain ints: nothing is allocated.",
        epilog="Output: GiB per rank, or --json (one object, sizes in bytes). Exit code 2 on a usage error.",
    )
    a = p.add_argument
    names = ", ".join(sorted(PRESETS))
    a("--model", "--preset", dest="model", default=None, metavar="NAME",
      help=f"model preset: {names}; spelled as you like (glm-5, deepseek-v3.2) "
      "(default: glm5)")  # fmt: skip
    a("--config", default=None, metavar="PATH",
      help="a DSA model's config.json, or the checkpoint directory holding it, instead of --model "
      "(default: none)")  # fmt: skip
    a("--kv-dtype", choices=("fp8", "bf16"), default=None,
      help="with --config: fp8 MLA rows, or bf16 ones; the indexer page is fp8 in both (default: fp8)")  # fmt: skip
    a("--page-size", type=int, default=None, help="with --config: tokens per KV page (default: 64)")
    a("--cp", type=int, default=8, metavar="N", help="CP group size, ranks (default: 8)")
    a("--context", type=int, default=None, metavar="TOKENS",
      help="tokens of KV the group holds: GiB per rank replicated vs sharded, the question asked unless --tokens "
      f"or --shared-prefix-tokens is given (default: {DEFAULT_TOKENS})")  # fmt: skip
    a("--tokens", type=int, default=None, metavar="TOKENS",
      help="instead of --context, a per-rank budget: each rank gets the bytes a replicated pool of this many "
      f"tokens needs; prints the tokens the sharded pools hold in it (default: none; {DEFAULT_TOKENS} with "
      "--shared-prefix-tokens)")  # fmt: skip
    a("--max-request-tokens", type=int, default=None, metavar="TOKENS",
      help="longest request the view's scratch is sized for (default: the context, or --tokens)")  # fmt: skip
    a("--shared-prefix-tokens", type=int, default=None, metavar="TOKENS",
      help="shared-prefix scenario: tokens every request shares (default: off)")  # fmt: skip
    a("--suffix-tokens", type=int, default=4096, metavar="TOKENS",
      help="shared-prefix scenario: tokens each request adds (default: 4096)")  # fmt: skip
    a("--json", action="store_true", help="print one JSON object on stdout (sizes in bytes)")
    return p


def _check(args: argparse.Namespace) -> str | None:
    """The first usage error of ``args`` (a flag out of range, flags that do not go together), or ``None``."""
    for flag, value, least in (
        ("--cp", args.cp, 1), ("--context", args.context, 1), ("--tokens", args.tokens, 1),
        ("--max-request-tokens", args.max_request_tokens, 1), ("--shared-prefix-tokens", args.shared_prefix_tokens, 0),
        ("--suffix-tokens", args.suffix_tokens, 1), ("--page-size", args.page_size, 1),
    ):  # fmt: skip
        if value is not None and value < least:
            return f"{flag} must be >= {least}, got {flag} {value}"
    if args.context is not None and (args.tokens is not None or args.shared_prefix_tokens is not None):
        return "--context sizes one context; --tokens (and --shared-prefix-tokens) a per-rank budget: give one of them"
    if args.config is not None and args.model is not None:
        return f"--model and --config both name the model: give one, got --model {args.model} --config {args.config}"
    if args.config is None and (args.kv_dtype is not None or args.page_size is not None):
        return ("--kv-dtype and --page-size go with --config (a preset fixes both: deepseek-v32 is fp8, "
                "deepseek-v32-bf16 bf16, pages of 64 tokens)")  # fmt: skip
    if args.model is not None and preset_name(args.model) is None:
        return f"--model must name one of {sorted(PRESETS)} (or give --config PATH), got --model {args.model}"
    return None


def _model(args: argparse.Namespace) -> ModelGeometry:
    if args.config is not None:
        return geometry_from_config(args.config, kv_dtype=args.kv_dtype or "fp8", page_size=args.page_size or 64)
    name = preset_name(args.model or "glm5")
    assert name is not None, "checked by _check"
    return PRESETS[name]


def main(argv: list[str] | None = None, *, prog: str = "python -m dtkv.capacity") -> int:
    """Parse, check, compute and print; returns the exit code (0, or 2 on a usage error)."""
    from dtkv._log import setup_cli_logging

    setup_cli_logging()
    args = parser(prog).parse_args(argv)
    error = _check(args)
    if error is None:
        try:
            geo = _model(args)
        except ValueError as e:  # a config.json that is not a DSA model's
            error = str(e)
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.shared_prefix_tokens is not None:
        rep_s = shared_prefix_capacity(
            geo, cp_size=args.cp, tokens=args.tokens or DEFAULT_TOKENS, prefix_tokens=args.shared_prefix_tokens,
            suffix_tokens=args.suffix_tokens,
        )  # fmt: skip
        print(json.dumps(rep_s.to_json()) if args.json else _shared_text(rep_s))
    elif args.tokens is not None:
        rep_b = capacity(geo, cp_size=args.cp, tokens=args.tokens, max_request_tokens=args.max_request_tokens)
        print(json.dumps(rep_b.to_json()) if args.json else _budget_text(rep_b))
    else:
        rep_c = context_capacity(geo, cp_size=args.cp, context_tokens=args.context or DEFAULT_TOKENS,
                                 max_request_tokens=args.max_request_tokens)  # fmt: skip
        print(json.dumps(rep_c.to_json()) if args.json else _context_text(rep_c, geo))
    return 0


def _table(rows: list[tuple[str, str]], head: tuple[str, str] | None = None) -> list[str]:
    """Rows of (label, value) with the labels padded to one width and the values right-aligned."""
    every = ([head] if head else []) + rows
    left = max(len(k) for k, _ in every)
    right = max(len(v) for _, v in every)
    return [f"  {k:<{left}}  {v:>{right}}" for k, v in every]


def _gib(n: int) -> str:
    return f"{n / GIB:,.2f}"


def _layouts_text(geo: ModelGeometry) -> str:
    return ", ".join(f"{name} {type(lay).__name__} {lay.page_bytes:,} B/page" for name, lay in geo.layouts)


def _context_text(rep: ContextReport, geo: ModelGeometry) -> str:
    head = (f"{rep.model}: {rep.num_layers} layers, pages of {rep.page_size} tokens ({_layouts_text(geo)}); "
            f"cp {rep.cp_size}, context {rep.context_tokens:,} tokens")  # fmt: skip
    ratio = rep.sharded_total_bytes_per_rank / rep.replicated_bytes_per_rank
    rows = [
        ("replicated KV (every page on every rank)", _gib(rep.replicated_bytes_per_rank)),
        (f"sharded KV (the pages one rank owns, 1/{rep.cp_size})", _gib(rep.sharded_bytes_per_rank)),
        (f"view scratch (2 layers of a {rep.max_request_tokens:,}-token view)", _gib(rep.scratch_bytes_per_rank)),
        ("sharded KV + view scratch", _gib(rep.sharded_total_bytes_per_rank)),
    ]
    lines = [head, *_table(rows, ("per rank", "GiB")), f"  sharded + scratch = {ratio:.3f} of replicated "
             f"({rep.replicated_bytes_per_rank / rep.sharded_total_bytes_per_rank:.2f}x less per rank)"]  # fmt: skip
    return "\n".join(lines)


def _budget_text(rep: CapacityReport) -> str:
    head = (f"{rep.preset}: {rep.num_layers} layers, pages of {rep.page_size} tokens; cp {rep.cp_size}; per-rank "
            f"budget = the bytes of a replicated pool of {rep.tokens:,} tokens")  # fmt: skip
    rows = [
        ("per-rank budget", _gib(rep.kv_bytes_replicated)),
        (f"view scratch (requests <= {rep.max_request_tokens:,} tokens)", _gib(rep.scratch_bytes_per_rank)),
        ("sharded pool per rank (the rest)", _gib(rep.kv_bytes_per_rank)),
    ]
    lines = [head, *_table(rows, ("per rank", "GiB"))]
    if rep.scratch_takes_the_budget:
        lines.append("  the view's scratch takes the whole budget: no page fits beside it (capacity multiplier 0); "
                     "give a larger --tokens or a smaller --max-request-tokens")  # fmt: skip
    else:
        lines.append(f"  logical tokens held: {rep.sharded_tokens:,} = {rep.capacity_multiplier:.3f}x the replicated "
                     "pool's (capacity multiplier)")  # fmt: skip
    return "\n".join(lines)


def _shared_text(rep: SharedPrefixReport) -> str:
    p = rep.pools
    head = (f"{p.preset}: {p.num_layers} layers, pages of {p.page_size} tokens; cp {p.cp_size}; per-rank budget = "
            f"a replicated pool of {p.tokens:,} tokens")  # fmt: skip
    lines = [
        head,
        f"  requests of {rep.prefix_tokens:,} shared + {rep.suffix_tokens:,} own tokens; pages per request: "
        f"{rep.pages_per_request} alone, {rep.private_pages} + {rep.shared_pages} shared once with a prefix cache",
    ]
    rows = [
        ("replicated pool", f"{rep.requests_replicated:,}", f"{rep.requests_replicated_shared:,}"),
        ("sharded pools", f"{rep.requests_sharded:,}", f"{rep.requests_sharded_shared:,}"),
    ]
    head_row = ("concurrent requests", "no prefix cache", "prefix cache")
    w = [max(len(r[i]) for r in [head_row, *rows]) for i in range(3)]
    for r in [head_row, *rows]:
        lines.append(f"  {r[0]:<{w[0]}}  {r[1]:>{w[1]}}  {r[2]:>{w[2]}}")
    if p.scratch_takes_the_budget:
        lines.append("  the view's scratch takes the whole budget: no page fits beside it; give a larger --tokens")
    lines.append(f"  sharded + prefix cache vs replicated without: {rep.multiplier:.2f}x the concurrent requests")
    return "\n".join(lines)
