"""Grammar-constrained decoding with llguidance: a request's grammar (``gpu_workers.grammars``) becomes a
matcher over this engine's vocabulary; before sampling, the rows that have one
get every token the grammar forbids at -inf, and each sampled token advances its row's matcher.

llguidance rather than xgrammar (measured on this CPU: BENCHMARKS.md, "Grammar masks"): it imports neither
torch nor CUDA, so the gateway refuses a bad schema with the same library; a new schema is ready 10x sooner
(13 ms against 134 ms over 20 schemas), and a 32-row step's mask has a 5x lower p95 (0.6 ms against 2.8 ms).
xgrammar's one-row mask is faster (4 us against 25 us), which is noise beside a decode step. Compiled
grammars are cached here by (kind, source), since llguidance keeps no cache of its own; the mask is applied
where the logits are: on the CPU with numpy's bit unpacking (~0.2 ms a row), not llguidance's torch.compile'd
helper (~13 ms a call on a CPU); on a GPU the packed bits are copied over and unpacked there.
"""

from __future__ import annotations

import os
import threading
from functools import cached_property

import numpy as np
import torch
from cachetools import LRUCache

from gpu_workers.engine.params import InvalidRequest
from gpu_workers.grammars import InvalidGrammar, check_grammar
from gpu_workers.protocol import Grammar


class Grammars:
    """One engine's grammars: its vocabulary as llguidance reads it (built on first use, ~1 s for 49k
    tokens), compiled grammars cached by (kind, source), and the masks of a step's constrained rows."""

    def __init__(self, tokenizer, eos_token_ids: list[int], vocab_size: int, cache_size: int = 256):
        self._tokenizer = tokenizer
        self._eos = list(eos_token_ids)
        self._vocab_size = vocab_size
        self._compiled: LRUCache[tuple[str, str], str] = LRUCache(cache_size)
        self._lock = threading.Lock()

    @cached_property
    def _executor(self):
        import llguidance

        return llguidance.LLExecutor(num_threads=max(1, min(4, os.cpu_count() or 1)))

    @cached_property
    def _lltokenizer(self):
        import llguidance

        backend = self._tokenizer.backend.to_str()
        return llguidance.LLTokenizer(backend, n_vocab=self._vocab_size, eos_token=self._eos or None)

    def matcher(self, grammar: Grammar, replay: list[int] = ()):
        """A fresh matcher for ``grammar``, advanced over ``replay`` (output an earlier phase generated);
        raises InvalidRequest naming what is wrong with the grammar or the replayed tokens."""
        import llguidance

        key = (grammar.kind, grammar.source)
        with self._lock:
            source = self._compiled.get(key)
        if source is None:
            try:
                source = check_grammar(grammar, self._lltokenizer)
            except InvalidGrammar as e:
                raise InvalidRequest("invalid_grammar", str(e)) from None
            with self._lock:
                self._compiled[key] = source
        matcher = llguidance.LLMatcher(self._lltokenizer, source, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(
                "invalid_grammar", f"the {grammar.kind} grammar cannot be used: {matcher.get_error()}"
            )
        if replay and not matcher.consume_tokens(list(replay)):
            raise InvalidRequest(
                "invalid_grammar_state",
                f"the output generated so far does not match the grammar: {matcher.get_error()}",
            )
        return matcher

    def mask(self, logits: torch.Tensor, matchers: list) -> torch.Tensor:
        """``logits`` with the tokens each row's grammar forbids at -inf, on the logits' device (the same
        tensor when no row has a matcher: unconstrained batches pay nothing)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return logits
        words = (self._vocab_size + 31) // 32
        # A row without a grammar allows every token (every bit set): the batch is masked in one op.
        bitmask = np.full((len(matchers), words), -1, dtype=np.int32)
        if len(rows) == 1:
            matchers[rows[0]].unsafe_compute_mask_ptr(bitmask[rows[0]].ctypes.data, words * 4)
        else:  # the rows' masks on llguidance's threads, in one call
            pairs = [(matchers[i], i) for i in rows]
            self._executor.unsafe_compute_mask_ptr(pairs, bitmask.ctypes.data, words * 4, len(matchers))
        return logits.masked_fill(_forbidden(bitmask, logits.shape[1], logits.device), float("-inf"))


def _forbidden(bitmask: np.ndarray, vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] bool on ``device``: the tokens ``bitmask`` rules out. Bit t of word w allows token
    32 * w + t (little-endian bit order, as llguidance writes them). On the CPU numpy unpacks the bits;
    to another device they go packed (vocab / 8 bytes a row, pinned and not waited for on CUDA) and are
    unpacked there."""
    if device.type == "cpu":
        allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        return torch.from_numpy(allowed) == 0
    packed = torch.from_numpy(bitmask)
    if device.type == "cuda":
        packed = packed.pin_memory()
    packed = packed.to(device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    return ((packed[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab] == 0
