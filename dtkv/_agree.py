"""Fail together: a collective step either succeeds on every rank of a group or raises the same error on all.

A collective constructor (or plan) that validates its arguments locally and then calls a collective hangs the
other ranks when one rank raises before the collective: they wait for the process-group timeout (30 minutes by
default). :func:`agree` puts the local verdict *inside* the agreement collective instead. Every rank calls it,
with its own local error (or None) and, optionally, a value the ranks must agree on (a config dict, or a digest
of a plan), and then every rank either returns or raises the same exception, within one or two small
collectives::

    err = None
    try:
        validate(args)                      # local checks that may differ between ranks
    except Exception as e:                  # noqa: BLE001
        err = e
    agree(err, group, what="ShardedKVPool", value=config)

or, equivalently, the :func:`agreement` context manager::

    with agreement(group, what="ShardedKVPool") as a:
        validate(args)
        a.value = config

Wire format (no pickle; every size is bounded and known to the receiver before it receives):

1. one fixed-size all-gather of a 48-byte header per rank: ``[status u8, pad x7, payload length i64,
   sha256(value) x32]``; on success with equal digests that is the only collective;
2. only when some rank failed, or the digests differ: one all-gather of every rank's UTF-8 payload (the error
   as ``"<type>\\n<message>"``, or the value as canonical JSON), padded to the largest announced length, at most
   :data:`MAX_PAYLOAD_BYTES` per rank (longer texts are cut, with a marker).

Errors raised:

- a local failure on any rank: every rank raises an exception of the first failing rank's type when that type is a
  standard one (``ValueError``, ``TypeError``, ``IndexError``, ``KeyError``, ``RuntimeError``,
  ``NotImplementedError``, ``OverflowError``) or one registered with :func:`register_error`, else
  ``RuntimeError``; the message names ``what``, the failing ranks and their messages. On a failing rank the
  original exception is chained as ``__cause__``.
- values that differ: every rank raises ``mismatch_error`` (default :class:`ConfigMismatchError`) naming the
  first differing field and each rank's value (dict values), or each rank's digest (other values).

With ``group=None`` or a group of one rank nothing is exchanged: a local error is re-raised unchanged.

:func:`agree_async` is the same agreement with its header all-gather started and waited for later
(:meth:`PendingAgreement.wait`), so that it overlaps other work (the runtime's decode loop votes on a step while the
GPU runs it): the same collectives in the same order, the same verdicts on every rank.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import json
from collections.abc import Iterator

import torch
import torch.distributed as dist

from dtkv._collectives import all_gather_into

__all__ = [
    "MAX_PAYLOAD_BYTES",
    "Agreement",
    "ConfigMismatchError",
    "PendingAgreement",
    "agree",
    "agree_async",
    "agreement",
    "digest_of",
    "register_error",
]

MAX_PAYLOAD_BYTES = 16384
"""Largest error text or JSON value one rank sends when the ranks disagree (longer ones are cut)."""

_HEADER_BYTES = 48
_TRUNCATED = "... [cut]"


class ConfigMismatchError(RuntimeError):
    """Ranks of one CP group disagree on a configuration they must share."""


_ERROR_TYPES: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        builtins.ValueError,
        builtins.TypeError,
        builtins.IndexError,
        builtins.KeyError,
        builtins.RuntimeError,
        builtins.NotImplementedError,
        builtins.OverflowError,
        ConfigMismatchError,
    )
}


def register_error(cls: type[Exception]) -> type[Exception]:
    """Let :func:`agree` re-raise ``cls`` (by class name) on every rank; usable as a class decorator.

    ``cls`` must be constructible from one message string.
    """
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        raise TypeError(f"cls must be an Exception subclass, got {cls!r}")
    _ERROR_TYPES[cls.__name__] = cls
    return cls


def _canonical(value: object) -> bytes:
    if isinstance(value, bytes):
        return value
    return json.dumps(value, sort_keys=True, default=str).encode()


def digest_of(value: object) -> bytes:
    """The 32-byte sha256 :func:`agree` compares: of ``value`` itself if bytes, else of its canonical JSON."""
    return hashlib.sha256(_canonical(value)).digest()


def _device(group: dist.ProcessGroup) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather_bytes(data: bytes, size: int, group: dist.ProcessGroup, world: int) -> list[bytes]:
    """All-gather ``data`` (at most ``size`` bytes) from every rank, zero-padded to ``size``: per-rank bytes."""
    dev = _device(group)
    mine = torch.zeros(size, dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = torch.empty(world * size, dtype=torch.uint8, device=dev)
    all_gather_into(out, mine.to(dev), group)
    rows = out.view(world, size).cpu().numpy()
    return [bytes(rows[r]) for r in range(world)]


def _cut(text: bytes) -> bytes:
    if len(text) <= MAX_PAYLOAD_BYTES:
        return text
    marker = _TRUNCATED.encode()
    return text[: MAX_PAYLOAD_BYTES - len(marker)] + marker


def _error_payload(error: BaseException) -> bytes:
    msg = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    return _cut(f"{type(error).__name__}\n{msg}".encode())


def agree(
    error: BaseException | None,
    group: dist.ProcessGroup | None,
    *,
    what: str,
    value: object = None,
    mismatch_error: type[Exception] = ConfigMismatchError,
    keep_common: bool = False,
) -> None:
    """Return on every rank, or raise the same exception on every rank of ``group`` (see the module docstring).

    Collective: every rank of ``group`` must call it, whatever its local outcome.

    Args:
        error: this rank's local failure, or None.
        group: the process group; ``None`` for a single process.
        what: the step, for messages (``"ShardedKVPool"``, ``"materialization plan"``).
        value: what every rank must hold equally (JSON-able, e.g. a config dict, or ``bytes`` such as a plan
            digest); ``None`` compares nothing.
        mismatch_error: raised on every rank when the values differ.
        keep_common: when every rank failed with the same type and message (an error that was raised on every rank
            together already, e.g. by an agreement inside the step), each rank raises its own error unchanged.

    Raises:
        The first failing rank's exception type (see the module docstring), or ``mismatch_error``.
    """
    agree_async(error, group, what=what, value=value, mismatch_error=mismatch_error, keep_common=keep_common).wait()


class PendingAgreement:
    """An agreement whose header all-gather is under way (:func:`agree_async`): :meth:`wait` finishes it."""

    def __init__(self, *, error, group, world: int, payload: bytes, work, out, what: str, value, mismatch_error,
                 keep_common: bool) -> None:  # fmt: skip
        self._error, self._group, self._world, self._payload = error, group, world, payload
        self._work, self._out, self._what, self._value = work, out, what, value
        self._mismatch, self._keep_common = mismatch_error, keep_common
        self._done = False

    def wait(self) -> None:
        """Return on every rank, or raise on every rank (as :func:`agree`); collective when a rank failed or the
        values differ (the payloads' all-gather). Idempotent once it returned."""
        if self._done:
            return
        self._done = True
        error = self._error
        if self._group is None:
            if error is not None:
                raise error
            return
        self._work.wait()  # the group's timeout bounds it
        world = self._world
        rows = self._out.view(world, _HEADER_BYTES).cpu().numpy()
        headers = [bytes(rows[r]) for r in range(world)]
        failed = [r for r in range(world) if headers[r][0]]
        digests = [headers[r][16:] for r in range(world)]
        if not failed and all(d == digests[0] for d in digests):
            return
        size = max(int.from_bytes(h[8:16], "little") for h in headers)  # announced lengths: bounded below
        payloads = _all_gather_bytes(self._payload, max(1, min(size, MAX_PAYLOAD_BYTES)), self._group, world)
        lengths = [min(int.from_bytes(h[8:16], "little"), MAX_PAYLOAD_BYTES) for h in headers]
        raw = [payloads[r][: lengths[r]] for r in range(world)]
        if failed:
            texts = [b.decode("utf-8", errors="replace").rstrip("\x00") for b in raw]
            if self._keep_common and error is not None and len(failed) == world and len(set(texts)) == 1:
                raise error
            raise _failure(self._what, failed, texts, world) from error
        raise _mismatch(self._what, raw, digests, isinstance(self._value, bytes), self._mismatch)


def agree_async(
    error: BaseException | None,
    group: dist.ProcessGroup | None,
    *,
    what: str,
    value: object = None,
    mismatch_error: type[Exception] = ConfigMismatchError,
    keep_common: bool = False,
) -> PendingAgreement:
    """:func:`agree`, with its header all-gather started and not waited for: the caller overlaps it with other work
    and calls :meth:`PendingAgreement.wait` (which returns or raises on every rank, as :func:`agree` does).

    Collective like :func:`agree`: every rank starts it, in the same order as its other collectives on ``group``,
    and every rank waits for it before its next collective on ``group``.
    """
    if error is not None and not isinstance(error, Exception):
        raise error  # KeyboardInterrupt and friends are never swallowed into a message
    if group is None or dist.get_world_size(group) == 1:
        return PendingAgreement(error=error, group=None, world=1, payload=b"", work=None, out=None, what=what,
                                value=value, mismatch_error=mismatch_error, keep_common=keep_common)  # fmt: skip
    world = dist.get_world_size(group)
    if error is None:
        try:  # a value that cannot be serialized is this rank's failure, not a reason to skip the collective
            canonical = _canonical(value) if value is not None else b""
        except Exception as e:  # noqa: BLE001
            error = e
    if error is not None:
        payload, digest = _error_payload(error), bytes(32)
    else:
        payload, digest = _cut(canonical), hashlib.sha256(canonical).digest()
    header = bytes([0 if error is None else 1]) + bytes(7) + len(payload).to_bytes(8, "little") + digest
    assert len(header) == _HEADER_BYTES, "agreement header size"
    dev = _device(group)
    # a tensor that owns its bytes: the collective runs on the backend's thread and may drop the last reference
    # there, so its input must not be a view of a Python object (whose release would need the GIL on that thread)
    mine = torch.frombuffer(bytearray(header), dtype=torch.uint8).clone()
    out = torch.empty(world * _HEADER_BYTES, dtype=torch.uint8, device=dev)
    work = all_gather_into(out, mine.to(dev), group, async_op=True)
    return PendingAgreement(error=error, group=group, world=world, payload=payload, work=work, out=out, what=what,
                            value=value, mismatch_error=mismatch_error, keep_common=keep_common)  # fmt: skip


def _failure(what: str, failed: list[int], texts: list[str], world: int) -> Exception:
    kinds, messages = {}, {}
    for r in failed:
        kind, _, message = texts[r].partition("\n")
        kinds[r], messages[r] = kind, message
    by_text: dict[tuple[str, str], list[int]] = {}
    for r in failed:
        by_text.setdefault((kinds[r], messages[r]), []).append(r)
    if len(failed) == world and len(by_text) == 1:
        (kind, message), _ = next(iter(by_text.items()))
        text = f"{what} failed on every rank: {message}"
    else:
        parts = []
        for (kind, message), ranks in by_text.items():
            who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
            parts.append(f"{who}: {kind}: {message}")
        text = f"{what} failed on {len(failed)} of {world} ranks; " + "; ".join(parts)
    cls = _ERROR_TYPES.get(kinds[failed[0]], RuntimeError)  # a name looked up, never evaluated
    try:
        return cls(text)
    except Exception:  # noqa: BLE001 - a registered type that needs more than a message
        return RuntimeError(text)


def _flatten(prefix: str, value: object, out: dict[str, object]) -> None:
    if isinstance(value, dict):
        for k in sorted(value):
            _flatten(f"{prefix}.{k}" if prefix else str(k), value[k], out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _flatten(f"{prefix}[{i}]", v, out)
        out[f"{prefix}.len"] = len(value)
    else:
        out[prefix] = value


def _mismatch(what: str, raw: list[bytes], digests: list[bytes], is_bytes: bool, cls: type[Exception]) -> Exception:
    values = None
    if not is_bytes:
        try:
            values = [json.loads(b.decode("utf-8")) for b in raw]
        except ValueError:  # cut: compare digests only
            values = None
    if values is not None and all(isinstance(v, dict) for v in values):
        flat = []
        for v in values:
            f: dict[str, object] = {}
            _flatten("", v, f)
            flat.append(f)
        for key in sorted(set().union(*flat)):
            per = [f.get(key, "<missing>") for f in flat]
            if any(v != per[0] for v in per):
                per_rank = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(per))
                return cls(f"CP ranks disagree on the {what} configuration: field {key!r} differs ({per_rank})")
    shown = raw if is_bytes else digests  # bytes values (digests) as themselves, others by their sha256
    per_rank = ", ".join(f"rank {r}: {d.hex()[:16]}" for r, d in enumerate(shown))
    return cls(f"CP ranks disagree on the {what}: digests differ ({per_rank})")


class Agreement:
    """The handle :func:`agreement` yields: set :attr:`value` to what every rank must hold equally."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: object = None


@contextlib.contextmanager
def agreement(
    group: dist.ProcessGroup | None, *, what: str, mismatch_error: type[Exception] = ConfigMismatchError
) -> Iterator[Agreement]:
    """Run the block's local work, then :func:`agree` on its outcome and on ``handle.value`` (collective).

    An ``Exception`` raised inside the block is exchanged instead of propagating alone; every rank then raises
    the same error on leaving the block.
    """
    handle = Agreement()
    try:
        yield handle
    except Exception as e:  # noqa: BLE001 - exchanged with the other ranks, then raised on every rank
        agree(e, group, what=what, mismatch_error=mismatch_error)
        raise  # agree always raises for a local error; this is only reached if it did not
    agree(None, group, what=what, value=handle.value, mismatch_error=mismatch_error)
