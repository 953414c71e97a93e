"""What a failed subprocess said, for an assertion message: every rank's error, not the last rank's alone.

A multi-rank run prints its progress lines and then each failed rank's traceback in rank order; when one rank fails
and takes the others down (a peer that left a collective: "Connection reset by peer"), the cause is the first
traceback and the tail of stderr shows only the consequence. :func:`failure_text` keeps stdout's last lines and
stderr without the progress lines, its head and its tail.
"""

from __future__ import annotations

import subprocess

__all__ = ["failure_text"]


def failure_text(out: subprocess.CompletedProcess, *, head: int = 6000, tail: int = 3000) -> str:
    """``out``'s exit code, stdout's last 1000 characters and stderr's non-progress lines (first ``head`` and last
    ``tail`` characters when longer)."""
    err = "\n".join(line for line in (out.stderr or "").splitlines() if not line.startswith("[dtkv "))
    if len(err) > head + tail:
        err = f"{err[:head]}\n[... {len(err) - head - tail} characters ...]\n{err[-tail:]}"
    return f"exit code {out.returncode}\nstdout: {(out.stdout or '')[-1000:]}\nstderr:\n{err}"
