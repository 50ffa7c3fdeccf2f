"""A cache of values read from the database, each loaded at most once per time-to-live.

The gateway keeps a few such caches (quota scopes per caller, the deployments, the price book). When an
entry expires under load, every request that finds it so would otherwise read the database at once; here
the requests for one key wait for a single load and take its value. Lookups that must not block (the event
loop's) ask ``cached``, which never loads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from cachetools import TTLCache

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LoadingCache(Generic[K, V]):
    """``get(key, load)``: the cached value if fresh, else ``load()``'s, stored for ``ttl_s`` seconds; one
    load per key at a time (callers that find the same key missing wait for it). At most ``max_entries``
    values, the least recently used evicted first. Thread-safe."""

    def __init__(self, ttl_s: float, max_entries: int):
        self._values: TTLCache[K, V] = TTLCache(max_entries, ttl_s)
        self._lock = threading.Lock()
        self._loading: dict[K, threading.Lock] = {}  # the keys being loaded now

    def cached(self, key: K) -> V:
        """The fresh value of ``key``; KeyError if there is none. Never loads."""
        with self._lock:
            return self._values[key]

    def get(self, key: K, load: Callable[[], V]) -> V:
        try:
            return self.cached(key)
        except KeyError:
            pass
        with self._lock:
            loading = self._loading.setdefault(key, threading.Lock())
        with loading:
            try:
                return self.cached(key)  # loaded by the caller this one waited for
            except KeyError:
                pass
            try:
                value = load()
                with self._lock:
                    self._values[key] = value
            finally:
                with self._lock:
                    # Callers already waiting hold this lock and find the value (or, after a failed load,
                    # load again themselves); later ones find the value, or start afresh.
                    if self._loading.get(key) is loading:
                        del self._loading[key]
        return value
