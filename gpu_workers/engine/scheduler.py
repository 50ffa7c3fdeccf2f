"""Which sequences run in the next step, and how many tokens each: plain Python over queues.

Running sequences go first, oldest first (FCFS), so a request admitted earlier is never starved by a
later one. Each running sequence needs one token (decode) or the next chunk of its prompt (chunked
prefill) within the per-step token budget. When a running sequence needs a page and none is free, the
newest running sequence is preempted: its pages are freed and it is recomputed later from its tokens.
Waiting sequences are admitted in arrival order while their whole prompt fits in free pages. With
``chunk`` set (batch-invariant execution), a prompt is cut only at multiples of ``chunk`` tokens, one chunk
a step, and a prefix-cache hit is taken only up to one of them: the same prompt is computed in the same
pieces whatever else is running.
"""

from __future__ import annotations

from bisect import insort
from collections import deque
from dataclasses import dataclass

from gpu_workers.engine.sequence import Sequence, Status
from gpu_workers.kv.manager import PageManager


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens computed this step for each sequence

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(
        self, pages: PageManager, max_num_seqs: int, max_num_batched_tokens: int, chunk: int | None = None
    ):
        self.pages = pages
        self.chunk = chunk
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # ordered by arrival
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        batch = ScheduledBatch([], [])
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._next(seq, budget)
            if n == 0:
                i += 1  # its next fixed chunk does not fit this step's budget
                continue
            if not self._make_room(seq, seq.num_computed + n):
                break  # seq itself was preempted; everyone after it already was
            self.pages.grow(seq.table, seq.num_computed + n)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.chunk is not None and budget < min(seq.num_tokens, self.chunk):
                break
            # Room for the whole known sequence plus its next token, so a new prompt does not preempt
            # older requests as soon as it starts decoding.
            tokens = seq.tokens(0, seq.num_tokens)
            if seq.kv_import is not None:
                seq.num_computed = seq.imported_tokens  # the engine writes them before the step runs
            else:
                seq.num_computed = self.pages.match_prefix(
                    seq.table, tokens, seq.num_tokens + 1, self.chunk or self.pages.page_size
                )
            if not self.pages.can_grow(seq.table, seq.num_tokens + 1):
                break
            self.waiting.popleft()
            self.pages.grow(seq.table, seq.num_tokens)
            if not seq.admitted:
                seq.admitted = True
                seq.cached_tokens = seq.num_computed
                self.pages.count_query(seq.num_tokens, seq.num_computed)
            seq.status = Status.RUNNING
            insort(self.running, seq, key=lambda s: s.arrival)
            n = self._next(seq, budget)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch

    def _next(self, seq: Sequence, budget: int) -> int:
        """How many of ``seq``'s tokens to compute this step: all that are left up to the budget, or with
        ``chunk`` set, up to the next chunk boundary and only if that fits (else 0)."""
        left = seq.num_tokens - seq.num_computed
        if self.chunk is None:
            return min(left, budget)
        n = min(left, self.chunk - seq.num_computed % self.chunk)
        return n if n <= budget else 0

    def _make_room(self, seq: Sequence, num_tokens: int) -> bool:
        """Preempt the newest running sequences until ``seq`` can hold ``num_tokens``; False if seq went."""
        while not self.pages.can_grow(seq.table, num_tokens):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pages.release(seq.table)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence from whichever queue holds it and free its pages at once."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.pages.release(seq.table)
        seq.status = Status.FINISHED
