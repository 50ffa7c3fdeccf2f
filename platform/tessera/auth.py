"""API keys: ``tsk_<8-char prefix>_<secret>``, stored as the prefix plus a salted hash, verified in constant time.

Hashing is one SHA-256 over a per-key random salt and the key. A slow password hash (scrypt, bcrypt) defends
low-entropy secrets against guessing; these secrets are 256 random bits, which no amount of hashing speed
makes guessable, while a slow hash would cost milliseconds of gateway CPU on every cache miss.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import string
import threading
import time
from dataclasses import dataclass, field

from sqlalchemy import select
from sqlalchemy.orm import Session, joinedload

from tessera.models import ApiKey

KEY_PREFIX = "tsk_"
PREFIX_LEN = 8
PREFIX_ALPHABET = string.ascii_lowercase + string.digits  # no "_": the prefix must split unambiguously
SECRET_BYTES = 32  # token_urlsafe(32) gives 43 characters
MIN_SECRET_LEN = 32
CACHE_TTL_S = 30.0

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


@dataclass
class KeyCache:
    """Verified keys for ``ttl_s`` seconds, keyed by the SHA-256 of the raw key, so the gateway's hot path
    skips the database. Revoking or disabling invalidates entries in this process at once; other processes
    (API replicas) stop accepting the key within ``ttl_s``. Only valid keys are cached, so garbage keys
    cannot grow it."""

    ttl_s: float = CACHE_TTL_S
    max_entries: int = 10_000
    _entries: dict[str, tuple[float, ApiKey]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def get(self, digest: str) -> ApiKey | None:
        with self._lock:
            entry = self._entries.get(digest)
            if entry is None:
                return None
            if entry[0] <= time.monotonic():
                del self._entries[digest]
                return None
            return entry[1]

    def put(self, digest: str, key: ApiKey) -> None:
        with self._lock:
            if len(self._entries) >= self.max_entries:
                now = time.monotonic()
                self._entries = {d: e for d, e in self._entries.items() if e[0] > now}
                if len(self._entries) >= self.max_entries:
                    self._entries.pop(next(iter(self._entries)))  # the oldest insertion
            self._entries[digest] = (time.monotonic() + self.ttl_s, key)

    def invalidate(self, *, prefix: str | None = None, tenant_id: str | None = None) -> None:
        """Drop the entries of one key (by prefix) or of all a tenant's keys."""
        with self._lock:
            self._entries = {
                d: (expiry, key)
                for d, (expiry, key) in self._entries.items()
                if key.prefix != prefix and key.tenant_id != tenant_id
            }

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


key_cache = KeyCache()  # this process's cache; tests call key_cache.clear()


def verify_key(session: Session, raw: str | None, cache: KeyCache | None = None) -> ApiKey | None:
    """The key ``raw`` names if it is valid; None alike for missing, malformed, unknown and revoked keys and
    for keys of disabled tenants, so a caller can't tell which.

    The key comes back detached from ``session``, with its tenant loaded, and may be shared with later
    calls through the cache: read it, never modify it (use ``tessera.tenancy`` to change keys).
    """
    cache = key_cache if cache is None else cache
    if not raw:
        return None
    prefix = parse_prefix(raw)
    if prefix is None:
        return None
    digest = hashlib.sha256(raw.encode()).hexdigest()
    cached = cache.get(digest)
    if cached is not None:
        return cached
    key = session.scalars(
        select(ApiKey).options(joinedload(ApiKey.tenant)).where(ApiKey.prefix == prefix)
    ).one_or_none()
    if key is None:
        hmac.compare_digest(hash_key(raw, _DUMMY_SALT), _DUMMY_HASH)
        return None
    if not hmac.compare_digest(hash_key(raw, key.salt), key.hash):
        return None
    if key.revoked_at is not None or key.tenant.disabled:
        return None
    session.expunge(key.tenant)
    session.expunge(key)
    cache.put(digest, key)
    return key
