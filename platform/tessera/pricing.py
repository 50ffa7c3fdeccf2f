"""Prices on the gateway's hot path: ``PriceCache`` (the price book cached a few seconds, so a request prices
without a database query), ``max_cost`` (what spend budgets reserve), ``charge`` (what a request cost, priced
and rounded exactly as the ledger prices it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from billing.prices import DEFAULT_MODEL, amount, list_prices
from tessera.loading_cache import LoadingCache

PRICE_TTL_S = 5.0  # a new price version reaches every API process's budgets and responses within this long


@dataclass(frozen=True)
class PriceVersion:
    """One version of a model's price (``billing.Price``), detached from the database."""

    id: int
    version: int
    effective_from: datetime
    fresh_input: int  # micro-USD per million tokens
    cached_input: int
    output: int


@dataclass(frozen=True)
class Charge:
    """A request's cost in micro-USD per token kind, priced and rounded exactly as the ledger prices it."""

    price: PriceVersion | None
    cached_input: int
    fresh_input: int
    output: int
    cached_discount: int  # what the cached tokens would have cost at the fresh price, less what they cost

    @property
    def total(self) -> int:
        return self.cached_input + self.fresh_input + self.output

    def usage_fields(self) -> dict[str, Any]:
        """``usage.cost`` (USD, a number, as OpenAI-compatible providers report it) and its breakdown."""
        return {
            "cost": self.total / 1e6,
            "cost_details": {
                "currency": "USD",
                "micro_usd": self.total,
                "cached_input": self.cached_input / 1e6,
                "fresh_input": self.fresh_input / 1e6,
                "output": self.output / 1e6,
                "cached_input_discount": self.cached_discount / 1e6,
                "price_version": self.price.version if self.price else None,
            },
        }


def max_cost(price: PriceVersion | None, prompt_tokens: int, max_tokens: int) -> int:
    """The most a request can cost at ``price``: every prompt token fresh, every allowed output token produced."""
    if price is None:
        return 0
    return amount(prompt_tokens, price.fresh_input) + amount(max_tokens, price.output)


def charge(price: PriceVersion | None, usage: dict[str, int]) -> Charge:
    """What the ledger records at ``price`` for a request with ``usage`` (prompt, cached, completion tokens)."""
    if price is None:
        return Charge(None, 0, 0, 0, 0)
    prompt = usage.get("prompt_tokens", 0)
    cached = min(usage.get("cached_tokens", 0), prompt)  # as the outcome clamps a worker's overcount
    cached_cost = amount(cached, price.cached_input)
    return Charge(
        price,
        cached_cost,
        amount(prompt - cached, price.fresh_input),
        amount(usage.get("completion_tokens", 0), price.output),
        amount(cached, price.fresh_input) - cached_cost,
    )


class PriceCache:
    """The price book as the gateway reads it: each model's versions (and the default's) loaded at most once
    per ``ttl_s``, so a request prices without a database query. Prices as ``billing`` does a request of the
    same model started at the same time. Sync: the gateway calls it from a thread."""

    def __init__(self, sessions: sessionmaker[Session], ttl_s: float = PRICE_TTL_S, max_models: int = 1024):
        self.sessions = sessions
        self._cache: LoadingCache[str, tuple[PriceVersion, ...]] = LoadingCache(ttl_s, max_models)

    def at(self, model: str, when: datetime) -> PriceVersion | None:
        """The version in effect at ``when`` for ``model``, else for the default row (as ``billing.PriceBook``)."""
        return self._in_effect(model, when, self._versions)

    def cached_at(self, model: str, when: datetime) -> tuple[PriceVersion | None] | None:
        """``(at(model, when),)`` when the versions it reads are cached, else None: no database query."""
        try:
            return (self._in_effect(model, when, self._cache.cached),)
        except KeyError:
            return None

    @staticmethod
    def _in_effect(
        model: str, when: datetime, versions_of: Callable[[str], tuple[PriceVersion, ...]]
    ) -> PriceVersion | None:
        for name in (model, DEFAULT_MODEL):
            for price in versions_of(name):
                if price.effective_from <= when:
                    return price
        return None

    def _versions(self, model: str) -> tuple[PriceVersion, ...]:
        return self._cache.get(model, lambda: self._load(model))

    def _load(self, model: str) -> tuple[PriceVersion, ...]:
        with self.sessions() as session:
            rows = list_prices(session, model)
            versions = tuple(
                PriceVersion(
                    p.id,
                    p.version,
                    p.effective_from,
                    p.fresh_input_per_mtok,
                    p.cached_input_per_mtok,
                    p.output_per_mtok,
                )
                for p in rows
            )
        # Newest first, as billing.PriceBook orders them: the first one in effect wins.
        return tuple(sorted(versions, key=lambda p: (p.effective_from, p.version), reverse=True))
