"""Pick a backend: an explicit name never falls back; ``"auto"`` takes the fastest available one that fits."""

from __future__ import annotations

import logging

import torch

from dtkv.attention._base import AttentionBackend
from dtkv.attention._fit import availability, check_fit, fit_errors
from dtkv.attention._spec import AUTO_ORDER, BACKENDS, AttentionSpec

__all__ = ["available_backends", "resolve_attention"]

logger = logging.getLogger(__name__)
_warned: set[str] = set()  # one WARNING per distinct report (every runtime of a process resolves again)


def _cls(name: str) -> type[AttentionBackend]:
    if name == "torch":
        from dtkv.attention._torch import TorchAttention

        return TorchAttention
    if name == "triton":
        from dtkv.attention._triton import TritonAttention

        return TritonAttention
    from dtkv.attention._flashmla import FlashMLAAttention

    return FlashMLAAttention


def available_backends(device: torch.device | str) -> dict[str, str]:
    """Backend name -> why it cannot run on ``device`` (empty string: it can), for every backend."""
    return {name: availability(name, device) for name in BACKENDS}


def resolve_attention(
    name: str = "auto",
    *,
    spec: AttentionSpec,
    device: torch.device | str,
    capability: tuple[int, int] | None = None,
) -> AttentionBackend:
    """The attention backend for ``spec`` on ``device`` (plan phase, once per model).

    ``"torch"``, ``"triton"`` or ``"flashmla"`` give that backend or raise: a name is never replaced by another.
    ``"auto"`` takes, in :data:`dtkv.attention.AUTO_ORDER` (FlashMLA, Triton, torch), the first backend that is
    available on the device *and* fits ``spec``; on a CPU that is torch (Triton's CPU interpreter is slower). A faster
    backend that is available but does not fit is reported with its rules (a ``WARNING`` of the ``dtkv.attention``
    logger, once per process and report) and in the backend's ``reason``; the choice is logged at ``INFO``.

    Args:
        name: ``"auto"`` | ``"torch"`` | ``"triton"`` | ``"flashmla"``.
        spec: heads per rank, KV layout and top-k of the layers.
        device: where attention runs.
        capability: CUDA compute capability to check instead of the device's (tests).

    Raises:
        ValueError: ``name`` is not one of the four.
        NotImplementedError: the named backend cannot run here (its package is missing or the device is wrong), with
            what is missing.
        AttentionFitError: the named backend does not fit ``spec``, naming every broken rule.
    """
    dev = torch.device(device)
    if name not in ("auto", *BACKENDS):
        raise ValueError(f"attention must be one of {('auto', *BACKENDS)}, got attention={name!r}")
    if name != "auto":
        why = availability(name, dev)
        if why:
            raise NotImplementedError(f"attention={name!r} is unavailable: {why}")
        check_fit(name, spec, device=dev, capability=capability)
        backend = _cls(name)(spec, dev, reason=f"attention={name!r} asked for")
        logger.info("dtkv attention backend: %s (%s)", backend.name, backend.reason)
        return backend
    notes = []
    for cand in AUTO_ORDER:
        if cand != "torch" and dev.type != "cuda":
            continue  # off CUDA, torch is the fastest
        why = availability(cand, dev)
        if why:
            notes.append(f"{cand}: unavailable ({why})")
            continue
        errors = fit_errors(cand, spec, device=dev, capability=capability)
        if errors:
            notes.append(f"{cand}: does not fit ({'; '.join(errors)})")
            msg = f"dtkv attention: {cand} is available but does not fit: {'; '.join(errors)}"
            if msg not in _warned:
                _warned.add(msg)
                logger.warning(msg)
            continue
        reason = f"auto on {dev.type}: fastest available that fits" + (f"; {'; '.join(notes)}" if notes else "")
        backend = _cls(cand)(spec, dev, reason=reason)
        logger.info("dtkv attention backend: %s (%s)", backend.name, backend.reason)
        return backend
    raise AssertionError("torch always fits")  # pragma: no cover
