"""A cache of values read from the database, each loaded at most once per time-to-live.

The gateway keeps a few such caches (quota scopes per caller, the deployments, the price book). When an
entry expires under load, every request that finds it so would otherwise read the database at once; here
the requests for one key wait for a single load and share its outcome: its value, or its exception (a
database that is down answers each wave of requests with one timeout, not one per request in turn).
Lookups that must not block (the event loop's) ask ``cached``, which never loads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Generic, TypeVar

from cachetools import TTLCache

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LoadingCache(Generic[K, V]):
    """``get(key, load)``: the cached value if fresh, else ``load()``'s, stored for ``ttl_s`` seconds; one
    load per key at a time, whose value or exception every caller that found the key missing meanwhile
    gets (an exception is not stored: the next caller loads again). At most ``max_entries`` values, the
    least recently used evicted first. Thread-safe; ``timer`` is the clock expiry is measured on."""

    def __init__(self, ttl_s: float, max_entries: int, timer: Callable[[], float] = time.monotonic):
        self._values: TTLCache[K, V] = TTLCache(max_entries, ttl_s, timer=timer)
        self._lock = threading.Lock()
        self._loading: dict[K, Future[V]] = {}  # the keys being loaded now, and their outcome to come

    def cached(self, key: K) -> V:
        """The fresh value of ``key``; KeyError if there is none. Never loads."""
        with self._lock:
            return self._values[key]

    def get(self, key: K, load: Callable[[], V]) -> V:
        with self._lock:
            try:
                return self._values[key]
            except KeyError:
                pass
            outcome = self._loading.get(key)
            loads = outcome is None
            if loads:
                outcome = self._loading[key] = Future()
        if not loads:
            return outcome.result()  # the value, or the exception, of the load under way
        try:
            value = load()
        except BaseException as exc:
            with self._lock:
                del self._loading[key]
            outcome.set_exception(exc)
            raise
        with self._lock:
            self._values[key] = value
            del self._loading[key]
        outcome.set_result(value)
        return value
