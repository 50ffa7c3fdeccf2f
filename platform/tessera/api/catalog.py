"""The models the gateway serves: enabled deployments, each with its tokenizer and context length.

Deployment rows are re-read after a few seconds so admin changes show up without a restart; a tokenizer
is loaded once per (deployment, checkpoint): as the API starts for the deployments enabled then
(``preload``), on its first request for one enabled later.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from cachetools import TTLCache
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from gpu_workers.checkpoint import ModelConfig, ModelLoadError
from gpu_workers.encoder_checkpoint import EncoderConfig, EncoderTokenizer, is_encoder_checkpoint
from gpu_workers.protocol import DeploymentSpec
from gpu_workers.tokenizer import Tokenizer, load_tokenizer
from tessera.deployments import DEPLOYMENT_NAME_RE, Deployment, DeploymentConfig, deployment_config
from tessera.errors import APIError
from tessera.loading_cache import LoadingCache

T = TypeVar("T")

log = logging.getLogger(__name__)

ROW_TTL_S = 5.0


@dataclass(frozen=True)
class Model:
    spec: DeploymentSpec  # what its workers serve
    config: DeploymentConfig  # the whole deployment: the gateway's own knobs (max_tokens_limit, ...) too
    context: int  # prompt + output tokens one request may hold
    vocab_size: int
    tokenizer: Tokenizer | None
    created: int  # unix time, for /v1/models
    embedding: Encoder | None = None  # set for an embedding model (which serves /v1/embeddings only)
    # The most bytes of prompt text one token can stand for (None: no sound bound, see ``bytes_per_token``):
    # a prompt of more than ``context * bytes_per_token`` bytes cannot fit, and is refused untokenised.
    bytes_per_token: int | None = None

    @property
    def local_prefill_max_tokens(self) -> int:
        """Prompts up to this long go straight to the decode pool (disaggregated); Gateway.serve reads it."""
        return self.config.local_prefill_max_tokens


@dataclass(frozen=True)
class Encoder:
    """What the gateway needs of an embedding model: its vectors' size, its input limit, its tokenizer."""

    dimension: int
    max_seq_length: int
    pooling: str  # mean | cls
    tokenizer: EncoderTokenizer


class Catalog:
    """Thread-safe lookups of enabled deployments by model id (the gateway calls it from a thread pool)."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        ttl_s: float = ROW_TTL_S,
        max_models: int = 10_000,
        max_absent: int = 1_000,
    ):
        self._sessions = sessions
        self._lock = threading.Lock()
        self._models: LoadingCache[str, Model] = LoadingCache(ttl_s, max_models)
        # Names read and found not enabled (answered 404 without a database read while fresh), apart from
        # the deployments, so that made-up names cannot push real ones out of the cache.
        self._absent: TTLCache[str, bool] = TTLCache(max_absent, ttl_s)
        self._checkpoints: dict[tuple[str, str], tuple[ModelConfig, Tokenizer | None]] = {}
        self._encoders: dict[tuple[str, str], tuple[EncoderConfig, EncoderTokenizer]] = {}

    def get(self, name: str) -> Model:
        """The enabled deployment ``name``, or a 404 that says how to find the valid ids."""
        return self.cached(name) or self._models.get(name, lambda: self._load(name))

    def cached(self, name: str) -> Model | None:
        """``get(name)`` if it needs no database read (a fresh entry: the model, or a 404 for one known not to
        be enabled), else None."""
        if not DEPLOYMENT_NAME_RE.fullmatch(name):
            # Never a deployment: no database round trip, no negative-cache entry, and no text (a NUL,
            # say) that one database or another refuses to compare.
            raise _not_found(name)
        try:
            return self._models.cached(name)
        except KeyError:
            pass
        with self._lock:
            absent = self._absent.get(name, False)
        if absent:
            raise _not_found(name)
        return None

    def _load(self, name: str) -> Model:
        with self._sessions() as session:
            row = session.get(Deployment, name)
            if row is not None and row.enabled:
                return self._model(row)
        with self._lock:
            self._absent[name] = True
        raise _not_found(name)  # every request waiting for this read gets it

    def preload(self) -> list[str]:
        """Load every enabled deployment's config and tokenizer now, so that no model's first request pays
        it inside its admission wait (a GGUF vocabulary, a tokenizer's warm-up: a second or more on a busy
        machine). The API runs it in a thread when it starts. A deployment that cannot be loaded is logged
        and left to ``get``, which answers its requests with the same error. Returns the ids loaded."""
        try:
            names = [name for name, _ in self.enabled()]
        except SQLAlchemyError as e:
            log.warning("models not preloaded: the deployments cannot be read (%s)", type(e).__name__)
            return []
        loaded = []
        for name in names:
            try:
                self.get(name)
            except APIError as e:
                log.warning("model %s not preloaded: %s", name, e.message)
            except SQLAlchemyError as e:
                log.warning(
                    "model %s not preloaded: its deployment cannot be read (%s)", name, type(e).__name__
                )
            else:
                loaded.append(name)
        log.info(
            "preloaded %d of %d enabled models: %s", len(loaded), len(names), ", ".join(loaded) or "none"
        )
        return loaded

    def enabled(self) -> list[tuple[str, int]]:
        """(model id, created unix time) of every enabled deployment, by name."""
        with self._sessions() as session:
            rows = session.execute(
                select(Deployment.name, Deployment.created_at)
                .where(Deployment.enabled)
                .order_by(Deployment.name)
            ).all()
        return [(name, int(created.timestamp())) for name, created in rows]

    def _model(self, row: Deployment) -> Model:
        spec = row.to_spec()
        if is_encoder_checkpoint(spec.checkpoint):
            return self._embedding_model(row, spec)
        config, tokenizer = self._checkpoint(spec)
        context = min(spec.max_model_len or config.max_position_embeddings, config.max_position_embeddings)
        return Model(
            spec=spec,
            config=deployment_config(row),
            context=context,
            vocab_size=config.vocab_size,
            tokenizer=tokenizer,
            created=int(row.created_at.timestamp()),
            bytes_per_token=bytes_per_token(tokenizer) if tokenizer is not None else None,
        )

    def _embedding_model(self, row: Deployment, spec: DeploymentSpec) -> Model:
        def load() -> tuple[EncoderConfig, EncoderTokenizer]:
            config = EncoderConfig.from_pretrained(Path(spec.checkpoint))
            return config, EncoderTokenizer(spec.checkpoint, config.max_seq_length)

        config, tokenizer = self._loaded(self._encoders, spec, load)
        return Model(
            spec=spec,
            config=deployment_config(row),
            context=config.max_seq_length,
            vocab_size=config.vocab_size,
            tokenizer=None,
            created=int(row.created_at.timestamp()),
            embedding=Encoder(config.dimension, config.max_seq_length, config.pooling, tokenizer),
        )

    def _checkpoint(self, spec: DeploymentSpec) -> tuple[ModelConfig, Tokenizer | None]:
        def load() -> tuple[ModelConfig, Tokenizer | None]:
            config, tokenizer = (
                ModelConfig.from_pretrained(Path(spec.checkpoint)),
                load_tokenizer(spec.checkpoint),
            )
            if tokenizer is not None:
                tokenizer.warm()  # here, in a thread: a small request may tokenise on the event loop
            return config, tokenizer

        return self._loaded(self._checkpoints, spec, load)

    def _loaded(self, cache: dict[tuple[str, str], T], spec: DeploymentSpec, load: Callable[[], T]) -> T:
        """What ``load`` reads from ``spec``'s checkpoint, read once per (deployment, checkpoint); a checkpoint
        the gateway cannot read is a 503 naming the model."""
        key = (spec.name, spec.checkpoint)
        with self._lock:
            loaded = cache.get(key)
        if loaded is None:
            try:
                loaded = load()
            except (ModelLoadError, OSError, ValueError) as e:
                raise APIError(
                    503,
                    f"the model '{spec.name}' is misconfigured: its checkpoint can't be read on the gateway ({e})",
                    "model_unavailable",
                ) from None
            with self._lock:
                cache[key] = loaded
        return loaded


def bytes_per_token(tokenizer: Tokenizer) -> int | None:
    """The most bytes of input text one token of ``tokenizer`` can cover: its longest vocabulary entry, in
    bytes (a byte-level token's bytes, a piece's UTF-8 text, a control token's text, whichever is longest).
    Every token the tokenizer emits covers a piece of the text no longer than that, so text of ``n`` bytes is
    at least ``n / bytes_per_token`` tokens. None when the tokenizer normalises its input first: a normaliser
    may shrink text without bound (stripping accents deletes every combining mark), so no byte count bounds
    its tokens."""
    backend = tokenizer.backend
    if backend.normalizer is not None:
        return None
    longest = 0
    for piece, token_id in backend.get_vocab(with_added_tokens=True).items():
        longest = max(longest, len(piece.encode("utf-8")), len(tokenizer.token_bytes(token_id)))
    return max(longest, 1)


def _not_found(name: str) -> APIError:
    return APIError(
        404,
        f"the model {name!r} does not exist or is not enabled; GET /v1/models lists the models you can use",
        "model_not_found",
        param="model",
    )
