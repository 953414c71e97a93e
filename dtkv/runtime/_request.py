"""A request of the runtime: its prompt, generated tokens and logical pages (identical on every rank)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Request"]


@dataclass
class Request:
    """One sequence: prompt, generated tokens and the logical pages holding its KV (the same on every rank).

    ``pages[i]`` holds positions ``[i * page_size, (i + 1) * page_size)`` (:mod:`dtkv.page_table`).
    """

    rid: int
    """Index of the request in :attr:`dtkv.runtime.Runtime.requests`."""
    prompt: list[int]
    """Prompt token ids."""
    pages: list[int] = field(default_factory=list)
    """Logical pages, in token order; they cover the computed tokens."""
    num_computed: int = 0
    """Tokens whose KV is stored."""
    output: list[int] = field(default_factory=list)
    """Generated tokens (the first one comes from the prefill's last logits)."""
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (not computed)."""
    finished: bool = False
    """Its pages were released (:meth:`dtkv.runtime.Runtime.finish_request`); it is never stepped again."""

    @property
    def tokens(self) -> list[int]:
        """Prompt then generated tokens (a new list: :meth:`token`, :meth:`token_range` and :attr:`num_tokens` read
        them without copying the prompt)."""
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        """``len(tokens)``."""
        return len(self.prompt) + len(self.output)

    def token(self, i: int) -> int:
        """``tokens[i]`` for ``0 <= i < num_tokens``."""
        n = len(self.prompt)
        return self.prompt[i] if i < n else self.output[i - n]

    def token_range(self, lo: int, hi: int) -> list[int]:
        """``tokens[lo:hi]`` for ``0 <= lo <= hi <= num_tokens``."""
        n = len(self.prompt)
        if hi <= n:
            return self.prompt[lo:hi]
        if lo >= n:
            return self.output[lo - n : hi - n]
        return self.prompt[lo:] + self.output[: hi - n]
