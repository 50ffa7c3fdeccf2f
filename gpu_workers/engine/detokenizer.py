"""Incremental detokenisation: turn a growing list of token ids into text chunks that are safe to stream.

A chunk never ends inside a UTF-8 character, and never contains text that could still become a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence

import tokenizers
from tokenizers.decoders import DecodeStream

from gpu_workers.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the output: tokenizers that strip a leading space (SentencePiece/Metaspace)
# only render the first output token correctly when it is not at the start of the decoded window.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Feed generated ids with ``push``; each call returns only the text that became final.

    ``tokenizers``' DecodeStream turns ids into text, holding back the bytes of a character until all of
    them arrived; this class holds back text that may still begin a stop string, and cuts at the first one.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | tokenizers.Tokenizer,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] = (),
    ):
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._tokenizer = tokenizer.backend if isinstance(tokenizer, Tokenizer) else tokenizer
        self._stop = list(stop)
        self._skip_special_tokens = skip_special_tokens
        self._start_stream(list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]))
        self._pending = ""  # decoded, but held back because it may begin a stop string
        self._emitted: list[str] = []
        self.stopped = False
        self.stop_string: str | None = None

    def _start_stream(self, context: list[int]) -> None:
        # A context that ends inside a character makes DecodeStream emit the whole context as output. So
        # the stream starts at the context's last character boundary and is fed the rest silently: the
        # character appears once, in the output, when the output's ids complete it.
        boundary = len(context)
        while boundary and self._decode(context[:boundary]).endswith(REPLACEMENT_CHAR):
            boundary -= 1
        self._prefix = context[:boundary]  # what the stream's text is measured from
        self._stream = DecodeStream(ids=self._prefix, skip_special_tokens=self._skip_special_tokens)
        self._ids: list[int] = context[boundary:]  # ids fed to the stream after the prefix
        if self._ids:
            self._stream.step(self._tokenizer, self._ids)  # text ending in U+FFFD: the stream holds it
        self._decoded = 0  # characters the stream has produced

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._emitted)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add generated ids; return the newly safe text ("" while a character or stop string is incomplete)."""
        if self.stopped or not token_ids:
            return ""
        self._ids.extend(token_ids)
        chunk = self._stream.step(self._tokenizer, list(token_ids)) or ""
        self._decoded += len(chunk)
        self._pending += chunk
        return self._release(final=False)

    def finish(self) -> str:
        """Flush everything held back: the request ended, so partial stop strings and characters are text
        (a character whose bytes never all arrived becomes U+FFFD, as in a full decode)."""
        if self.stopped:
            return ""
        # The stream keeps an incomplete character's bytes to itself: take them from one full decode.
        full = self._decode(self._prefix + self._ids)
        self._pending += full[len(self._decode(self._prefix)) + self._decoded :]
        return self._release(final=True)

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
