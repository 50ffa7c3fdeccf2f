"""Incremental detokenisation: turn a growing list of token ids into text chunks that are safe to stream.

A chunk never ends inside a UTF-8 character, and never contains text that could still become a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the output: tokenizers that strip a leading space (SentencePiece/Metaspace)
# only render the first output token correctly when it is not at the start of the decoded window.
PROMPT_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Feed generated ids with ``push``; each call returns only the text that became final.

    Uses a prefix/read-offset window: the text of ``ids[prefix:read]`` was already emitted, so the new text is
    ``decode(ids[prefix:]) - decode(ids[prefix:read])``, taken only once it no longer ends in U+FFFD (a
    character whose bytes have not all arrived yet).
    """

    def __init__(
        self,
        tokenizer: Decoder,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] = (),
    ):
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._tokenizer = tokenizer
        self._stop = list(stop)
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._pending = ""  # decoded, but held back because it may begin a stop string
        self._emitted: list[str] = []
        self.stopped = False
        self.stop_string: str | None = None

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._emitted)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add generated ids; return the newly safe text ("" while a character or stop string is incomplete)."""
        if self.stopped:
            return ""
        self._ids.extend(token_ids)
        self._pending += self._decode_new(final=False)
        return self._release(final=False)

    def finish(self) -> str:
        """Flush everything held back: the request ended, so partial stop strings and characters are text."""
        if self.stopped:
            return ""
        self._pending += self._decode_new(final=True)
        return self._release(final=True)

    def _decode_new(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or (full_text.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full_text[len(prefix_text) :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _release(self, final: bool) -> str:
        """Emit pending text up to the first stop string, or up to the tail that may still start one."""
        match = self._first_stop()
        if match is not None:
            index, stop = match
            out, self._pending = self._pending[:index], ""
            self.stopped, self.stop_string = True, stop
        else:
            # Text emitted earlier never ends with a stop-string prefix, so a stop can only begin in pending.
            keep = 0 if final else self._partial_stop_len()
            cut = len(self._pending) - keep
            out, self._pending = self._pending[:cut], self._pending[cut:]
        if out:
            self._emitted.append(out)
        return out

    def _first_stop(self) -> tuple[int, str] | None:
        found = [(i, s) for s in self._stop if (i := self._pending.find(s)) >= 0]
        return min(found, default=None)

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of pending that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(self._pending)), longest, -1):
                if self._pending.endswith(stop[:k]):
                    longest = k
                    break
        return longest
