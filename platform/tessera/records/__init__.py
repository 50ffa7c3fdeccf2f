"""Request outcomes, kept durably: the gateway appends each finished request's outcome to a Redis Stream
(``Recorder``), a writer in every API process drains the stream into ``request_records``
(``RecordWriter``) through ``settle_records``, and billing reads the same stream (``RequestOutcome`` is its
schema)."""

from tessera.records.outcome import RequestOutcome, TimedReader, outcome_of
from tessera.records.recorder import OUTCOME_FIELD, Recorder
from tessera.records.store import record_request, settle_records
from tessera.records.writer import GROUP, RecordWriter, dead_letters

__all__ = [
    "GROUP",
    "OUTCOME_FIELD",
    "RecordWriter",
    "Recorder",
    "RequestOutcome",
    "TimedReader",
    "dead_letters",
    "outcome_of",
    "record_request",
    "settle_records",
]
