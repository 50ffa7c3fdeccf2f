"""The prefill -> decode hand-off as one engine sees it. A request that imports a KV block has it converted
to this engine's cache format when it is added and copied into its pages when first scheduled. A request
that exports its KV gets a copy of its pages as stored when it finishes (under the engine's lock); the
copy is converted to the export format and the final event delivered after the lock is released."""

from __future__ import annotations

import logging

from gpu_workers.engine.failures import EndRequests
from gpu_workers.engine.params import InvalidRequest, RequestError, StreamEvent
from gpu_workers.engine.scheduler import ScheduledBatch
from gpu_workers.engine.sequence import Sequence
from gpu_workers.kv import KVCache, transfer
from gpu_workers.kv.transfer import KVBlock

log = logging.getLogger(__name__)


class HandOff:
    """KV blocks in and out of one engine's cache, and the exporting requests whose final event waits for
    their KV's conversion."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self._exports: list[tuple[Sequence, StreamEvent]] = []  # final events waiting for their KV

    def prepare_import(self, block: KVBlock) -> KVBlock:
        """``block`` in this cache's format (outside the lock: conversion is the costly part)."""
        try:
            return transfer.for_cache(block, self.cache)
        except transfer.InvalidKVBlock as exc:
            raise InvalidRequest("invalid_kv_import", f"could not import KV: {exc}") from None

    def copy_imports(self, batch: ScheduledBatch, end: EndRequests) -> list[StreamEvent]:
        """Copy handed-off KV into newly admitted sequences' pages; a block that cannot be copied fails only
        its request (taken out of the batch)."""
        events = []
        for row in range(len(batch.seqs) - 1, -1, -1):
            seq = batch.seqs[row]
            if seq.kv_import is None:
                continue
            block, seq.kv_import = seq.kv_import, None
            try:
                transfer.write_pages(self.cache, seq.table.pages, block)
            except Exception as exc:
                log.exception("request %s: could not import its KV block", seq.request_id)
                del batch.seqs[row], batch.num_new_tokens[row]
                error = RequestError("internal_error", f"could not import KV ({type(exc).__name__}: {exc})")
                events += end([seq], error)
        return events

    @staticmethod
    def exports(seq: Sequence, reason: str) -> bool:
        """Whether a request finishing for ``reason`` hands its KV on."""
        return seq.export_kv is not None and reason in ("stop", "length")

    def copy_export(self, seq: Sequence) -> None:
        """A copy of a finishing request's pages as stored (they are freed next); converted by ``deliver``."""
        seq.kv = transfer.read_pages(self.cache, seq.table.pages, seq.num_computed)

    def hold(self, seq: Sequence, event: StreamEvent) -> None:
        """Keep an exporting request's final event until its KV is converted, after the lock."""
        self._exports.append((seq, event))

    def take_held(self) -> list[tuple[Sequence, StreamEvent]]:
        """The held requests and their final events (under the lock), each for ``deliver`` after it."""
        held, self._exports = self._exports, []
        return held

    @staticmethod
    def deliver(seq: Sequence, event: StreamEvent) -> StreamEvent:
        """Convert a finished request's KV copy to its export format, then deliver its final event."""
        try:
            seq.kv = event.kv = transfer.convert(seq.kv, seq.export_kv)
        except Exception as exc:
            log.exception("request %s: could not convert its KV to %s", seq.request_id, seq.export_kv)
            seq.finish_reason, seq.kv = "error", None
            seq.error = RequestError(
                "internal_error", f"could not convert the KV to {seq.export_kv} ({type(exc).__name__}: {exc})"
            )
            event = seq.event(event.token_ids, event.text)
        return seq.deliver(event)
