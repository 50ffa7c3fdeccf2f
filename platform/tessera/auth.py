"""API keys: ``tsk_<8-char prefix>_<secret>``, stored as the prefix plus a salted hash, verified in constant time,
cached per process under a key version shared through Redis.

Hashing is one SHA-256 over a per-key random salt and the key. A slow password hash (scrypt, bcrypt) defends
low-entropy secrets against guessing; these secrets are 256 random bits, which no amount of hashing speed
makes guessable, while a slow hash would cost milliseconds of gateway CPU on every cache miss.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
import secrets
import string
import threading
import time
from dataclasses import dataclass

from cachetools import TTLCache
from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from redis.exceptions import RedisError
from sqlalchemy import select
from sqlalchemy.orm import Session, joinedload
from starlette.concurrency import run_in_threadpool

from gpu_workers.protocol import connect_redis
from tessera.models import ApiKey, utcnow
from tessera.settings import Settings, get_settings

log = logging.getLogger(__name__)

KEY_PREFIX = "tsk_"
PREFIX_LEN = 8
PREFIX_ALPHABET = string.ascii_lowercase + string.digits  # no "_": the prefix must split unambiguously
SECRET_BYTES = 32  # token_urlsafe(32) gives 43 characters
MIN_SECRET_LEN = 32
CACHE_TTL_S = 30.0  # how stale a cached key may get when a change could not be announced through Redis
KEY_VERSION_KEY = "tessera:auth:key-version"

_KEY_RE = re.compile(rf"{KEY_PREFIX}([a-z0-9]{{{PREFIX_LEN}}})_([A-Za-z0-9_-]{{{MIN_SECRET_LEN},128}})")
# Hashed when the prefix is unknown, so that answer takes as long as a wrong secret for a known prefix.
_DUMMY_SALT = secrets.token_hex(16)
_DUMMY_HASH = hashlib.sha256(b"tessera-dummy").hexdigest()


@dataclass(frozen=True)
class NewKey:
    """A freshly generated key: ``raw`` goes to the user once; the rest is what the database stores."""

    raw: str
    prefix: str
    salt: str
    hash: str


def generate_key() -> NewKey:
    prefix = "".join(secrets.choice(PREFIX_ALPHABET) for _ in range(PREFIX_LEN))
    raw = f"{KEY_PREFIX}{prefix}_{secrets.token_urlsafe(SECRET_BYTES)}"
    salt = secrets.token_hex(16)
    return NewKey(raw=raw, prefix=prefix, salt=salt, hash=hash_key(raw, salt))


def hash_key(raw: str, salt: str) -> str:
    return hashlib.sha256(bytes.fromhex(salt) + raw.encode()).hexdigest()


def parse_prefix(raw: str) -> str | None:
    """The key's prefix if ``raw`` is shaped like a Tessera key, else None."""
    match = _KEY_RE.fullmatch(raw)  # fullmatch: a regex `$` would accept a trailing newline
    return match.group(1) if match else None


def key_shaped(raw: str | None) -> bool:
    """Whether ``raw`` could be a key at all: a missing or malformed one is refused before any Redis or
    database read."""
    return bool(raw) and parse_prefix(raw) is not None


class KeyVersion:
    """A version in Redis that every API process reads on each request: a change to any key or tenant (revoke,
    disable) sets a new one after its commit, and a process whose cached keys were verified under another
    version drops them. A read per request, rather than a pub/sub message, so no process can miss a change.
    Versions are random tokens, not a counter, so a Redis that restarts empty can't bring back an old one.
    """

    def __init__(self, redis: Redis, name: str = KEY_VERSION_KEY, aredis: AsyncRedis | None = None):
        self.redis = redis
        self.aredis = aredis  # for ``acurrent`` on the loop ``bind`` names: the gateway's event loop
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._unreachable = False  # warn once per outage, not once per request

    def bind(self) -> None:
        """Let ``acurrent`` use the async client on the running loop (the app's, from its lifespan): its
        connections belong to the loop that opened them."""
        self._loop = asyncio.get_running_loop()

    @classmethod
    def from_settings(cls, settings: Settings | None = None) -> KeyVersion | None:
        """The counter in the settings' Redis, or in the embedded one a ``tessera up`` on the data dir runs;
        None when there is neither."""
        url = (settings or get_settings()).running_redis_url
        return cls(connect_redis(url)) if url else None

    def current(self) -> bytes | None:
        """The version now; None when Redis cannot say, so nothing cached can be trusted."""
        try:
            value = self.redis.get(self.name)
        except RedisError as exc:
            return self._lost(exc)
        return self._read(value)

    async def acurrent(self) -> bytes | None:
        """``current`` without blocking the event loop: through the async client on the loop it is bound to,
        else the sync client in a thread (say, a test client running the app on a loop of its own)."""
        if self.aredis is None or self._loop is not asyncio.get_running_loop():
            return await run_in_threadpool(self.current)
        try:
            value = await self.aredis.get(self.name)
        except RedisError as exc:
            return self._lost(exc)
        return self._read(value)

    def _read(self, value: bytes | None) -> bytes:
        self._unreachable = False
        return value or b""

    def _lost(self, exc: RedisError) -> None:
        if not self._unreachable:
            log.warning(
                "cannot read the API key version from Redis (%s): verifying keys in the database", exc
            )
        self._unreachable = True
        return None

    def bump(self) -> None:
        self.redis.set(self.name, secrets.token_hex(16))


def announce_key_change(version: KeyVersion | None) -> None:
    """Tell every API process to drop its cached keys (call after the change is committed)."""
    owned = version is None
    version = version or KeyVersion.from_settings()
    consequence = (
        f"the change is saved, but running API processes may act on the old state for up to {CACHE_TTL_S:.0f} s; "
        "run the command again with TESSERA_REDIS_URL set to the API's Redis to tell them at once"
    )
    if version is None:
        log.warning("TESSERA_REDIS_URL is not set: %s", consequence)
        return
    try:
        version.bump()
    except RedisError as exc:
        log.warning("could not reach Redis to tell the API processes (%s): %s", exc, consequence)
    finally:
        if owned:
            version.redis.close()


class KeyCache:
    """Verified keys for ``ttl_s`` seconds, keyed by the SHA-256 of the raw key, so the gateway's hot path
    skips the database. Entries belong to one key version (see ``KeyVersion``): a new version empties the
    cache, so a key revoked or disabled anywhere stops working here on the next request. ``invalidate``
    drops entries in this process at once (for callers without Redis). Only valid keys are cached, so
    garbage keys cannot grow it; the TTL bounds staleness when a change could not be announced."""

    def __init__(self, ttl_s: float = CACHE_TTL_S, max_entries: int = 10_000):
        self._entries: TTLCache[str, ApiKey] = TTLCache(max_entries, ttl_s, timer=time.monotonic)
        self._version = b""
        self._lock = threading.Lock()  # TTLCache is not thread-safe; the gateway verifies on many threads

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def get(self, digest: str, version: bytes = b"") -> ApiKey | None:
        with self._lock:
            if version != self._version:
                self._entries.clear()
                self._version = version
            return self._entries.get(digest)

    def put(self, digest: str, key: ApiKey, version: bytes = b"") -> None:
        with self._lock:
            # A key read under an older version may already be revoked: caching it would outlive the change.
            if version == self._version:
                self._entries[digest] = key

    def invalidate(self, *, prefix: str | None = None, tenant_id: str | None = None) -> None:
        """Drop the entries of one key (by prefix) or of all a tenant's keys."""
        with self._lock:
            for digest, key in list(self._entries.items()):
                if key.prefix == prefix or key.tenant_id == tenant_id:
                    del self._entries[digest]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


key_cache = KeyCache()  # this process's cache; tests call key_cache.clear()


def verify_key(
    session: Session, raw: str | None, cache: KeyCache | None = None, version: KeyVersion | None = None
) -> ApiKey | None:
    """The key ``raw`` names if it is valid; None alike for missing, malformed, unknown, revoked and expired
    keys and for keys of disabled tenants, so a caller can't tell which.

    ``version``: the shared key version (API processes pass one); without it the cache serves this process
    alone. The key comes back detached from ``session``, with its tenant loaded, and may be shared with later
    calls through the cache: read it, never modify it (use ``tessera.tenancy`` to change keys).
    """
    if not key_shaped(raw):
        return None
    # Read before the database: a change committed after this read bumps the version past it, so what
    # this call caches is dropped by the next one.
    current = b"" if version is None else version.current()
    known = cached_key(raw, current, cache)
    return verify_in_database(session, raw, current, cache) if known is MISS else known


MISS = object()  # cached_key's answer when only the database can tell


def cached_key(
    raw: str | None, current: bytes | None, cache: KeyCache | None = None
) -> ApiKey | None | object:
    """``verify_key``'s answer where it needs no database: None for a missing or malformed key, the key (or
    None once it expired) when it was verified under ``current``, the version read before this call; else
    ``MISS``, and ``verify_in_database`` with the same ``current`` answers. ``current`` None: Redis could
    not say, so the cache is not trusted."""
    if not key_shaped(raw):
        return None
    if current is None:
        return MISS
    cache = key_cache if cache is None else cache
    cached = cache.get(_digest(raw), current)
    if cached is None:
        return MISS
    return cached if not _expired(cached) else None


def verify_in_database(
    session: Session, raw: str, current: bytes | None, cache: KeyCache | None = None
) -> ApiKey | None:
    """``verify_key`` past the cache: the key row, checked, and cached under ``current`` if it is valid."""
    prefix = parse_prefix(raw)
    if prefix is None:
        return None
    cache = key_cache if cache is None else cache
    key = session.scalars(
        select(ApiKey).options(joinedload(ApiKey.tenant)).where(ApiKey.prefix == prefix)
    ).one_or_none()
    if key is None:
        hmac.compare_digest(hash_key(raw, _DUMMY_SALT), _DUMMY_HASH)
        return None
    if not hmac.compare_digest(hash_key(raw, key.salt), key.hash):
        return None
    if key.revoked_at is not None or key.tenant.disabled or _expired(key):
        return None
    session.expunge(key.tenant)
    session.expunge(key)
    if current is not None:
        cache.put(_digest(raw), key, current)
    return key


def _digest(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


def _expired(key: ApiKey) -> bool:
    return key.expires_at is not None and key.expires_at <= utcnow()
