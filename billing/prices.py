"""The price book: per model, versioned, each version effective from a date on; money in integer micro-USD.

Rounding rule (the only one): each token kind of each request is priced on its own and rounded half up to
a whole micro-USD, ``cost = (tokens * price_per_mtok + 500_000) // 1_000_000``; a request's cost is the sum
of its three kinds, and every total (rollups, reports) is a sum of those integers, never re-rounded.

A request is priced with the version in effect when it started (the latest ``effective_from`` at or before
``started_at``) for its model, else for the ``*`` default row; the ledger keeps the version's id, so later
price changes never reprice a recorded event.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from billing.schema import Price, utcnow

DEFAULT_MODEL = "*"
EPOCH = datetime(2026, 1, 1, tzinfo=timezone.utc)


@dataclass(frozen=True)
class PriceSpec:
    """Micro-USD per million tokens."""

    fresh_input: int
    cached_input: int
    output: int

    def __post_init__(self) -> None:
        for name in ("fresh_input", "cached_input", "output"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} price must be a non-negative integer (micro-USD per 1M tokens)")


# Shipped defaults (the migration seeds the same rows as version 1, effective from EPOCH).
DEFAULT_PRICES: dict[str, PriceSpec] = {
    "@tessera/pycode-tiny": PriceSpec(fresh_input=100_000, cached_input=20_000, output=400_000),
    DEFAULT_MODEL: PriceSpec(fresh_input=100_000, cached_input=20_000, output=400_000),
}


def amount(tokens: int, per_mtok: int) -> int:
    """Micro-USD for ``tokens`` at ``per_mtok`` micro-USD per million, rounded half up."""
    return (tokens * per_mtok + 500_000) // 1_000_000


def usd(micro: int) -> str:
    """Micro-USD as an exact decimal string of USD (no floats): 1_500_000 -> "1.500000"."""
    sign = "-" if micro < 0 else ""
    whole, frac = divmod(abs(micro), 1_000_000)
    return f"{sign}{whole}.{frac:06d}"


def set_price(
    session: Session, model: str, spec: PriceSpec, *, effective_from: datetime | None = None
) -> Price:
    """Add the next version of ``model``'s price, effective from ``effective_from`` (default: now)."""
    if not model or len(model) > 200:
        raise ValueError("model must be 1 to 200 characters")
    effective_from = effective_from or utcnow()
    if effective_from.tzinfo is None:
        raise ValueError("effective_from must carry a time zone")
    version = (session.scalar(select(func.max(Price.version)).where(Price.model == model)) or 0) + 1
    price = Price(
        model=model,
        version=version,
        effective_from=effective_from,
        fresh_input_per_mtok=spec.fresh_input,
        cached_input_per_mtok=spec.cached_input,
        output_per_mtok=spec.output,
    )
    session.add(price)
    session.commit()
    return price


def list_prices(session: Session, model: str | None = None) -> list[Price]:
    query = select(Price).order_by(Price.model, Price.version)
    if model is not None:
        query = query.where(Price.model == model)
    return list(session.scalars(query))


def seed_defaults(session: Session) -> None:
    """Add the default prices for models with no price yet (the migration does this on a new database)."""
    for model, spec in DEFAULT_PRICES.items():
        if session.scalar(select(Price.id).where(Price.model == model).limit(1)) is None:
            set_price(session, model, spec, effective_from=EPOCH)


class PriceBook:
    """Price lookups for one transaction: every version of the models asked about, loaded once."""

    def __init__(self, session: Session):
        self.session = session
        self._versions: dict[str, list[Price]] = {}

    def load(self, models: Iterable[str]) -> None:
        """Load every version of ``models`` and of the default in one query (a batch's models, at once)."""
        wanted = {*models, DEFAULT_MODEL} - self._versions.keys()
        if not wanted:
            return
        query = (
            select(Price)
            .where(Price.model.in_(wanted))
            .order_by(Price.effective_from.desc(), Price.version.desc())
        )
        for model in wanted:
            self._versions[model] = []
        for price in self.session.scalars(query):
            self._versions[price.model].append(price)

    def _of(self, model: str) -> list[Price]:
        if model not in self._versions:
            query = (
                select(Price)
                .where(Price.model == model)
                .order_by(Price.effective_from.desc(), Price.version.desc())
            )
            self._versions[model] = list(self.session.scalars(query))
        return self._versions[model]

    def at(self, model: str, when: datetime) -> Price | None:
        """The version of ``model``'s price (else the default's) in effect at ``when``; None if neither."""
        for name in (model, DEFAULT_MODEL):
            for price in self._of(name):
                if price.effective_from <= when:
                    return price
        return None

    def cost(
        self, model: str, when: datetime, cached_input: int, fresh_input: int, output: int
    ) -> tuple[Price | None, int, int, int]:
        """(the price version applied, cached input, fresh input and output cost in micro-USD) of a request
        of ``model`` started at ``when``; no price at all costs 0."""
        price = self.at(model, when)
        if price is None:
            return None, 0, 0, 0
        return (
            price,
            amount(cached_input, price.cached_input_per_mtok),
            amount(fresh_input, price.fresh_input_per_mtok),
            amount(output, price.output_per_mtok),
        )
