"""What a quota is: the limits a scope (a tenant or a key) holds, and the decision an admission returns, with
the message (spend in dollars: ``usd``), error code and rate-limit headers it answers a caller with.
``tessera.quotas`` enforces them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import datetime

PREFIX = "tessera:quota"
LIMITS = ("rpm", "tpm", "concurrency", "daily_tokens", "monthly_tokens", "monthly_spend")
BUDGETS = ("daily_tokens", "monthly_tokens", "monthly_spend")  # limits that reset with the UTC day or month


@dataclass(frozen=True)
class Limits:
    rpm: int | None = None
    tpm: int | None = None
    concurrency: int | None = None
    daily_tokens: int | None = None
    monthly_tokens: int | None = None
    monthly_spend: int | None = None  # micro-USD per UTC month

    def merged(self, override: Limits | None) -> Limits:
        """These limits with every limit ``override`` sets replacing ours."""
        if override is None:
            return self
        return Limits(
            **{f.name: _pick(getattr(override, f.name), getattr(self, f.name)) for f in fields(self)}
        )

    @property
    def unlimited(self) -> bool:
        return all(getattr(self, name) is None for name in LIMITS)


def _pick(override: int | None, base: int | None) -> int | None:
    return base if override is None else override


@dataclass(frozen=True)
class Scope:
    """One holder of limits: ``tenant:<id>`` or ``key:<id>``. Keys of a scope share its Redis hash slot."""

    name: str
    limits: Limits
    # Micro-USD the ledger already holds for this scope's current month: where the spend counter restarts
    # from if Redis lost it (restarted empty, failed over), so a lost counter never hands out the budget again.
    month_spent: int = 0

    def key(self, part: str) -> str:
        return f"{PREFIX}:{{{self.name}}}:{part}"


@dataclass(frozen=True)
class Window:
    """Where a limit stands for the caller: what the x-ratelimit-* headers report."""

    limit: int
    remaining: int
    reset_ms: int  # until the window frees room (the oldest entry leaves it)


@dataclass(frozen=True)
class Decision:
    admitted: bool
    limit: str | None = None  # the limit that rejected the request
    scope: str | None = None
    retry_after_ms: int = 0
    requests: Window | None = None  # the tightest rpm window over the scopes
    tokens: Window | None = None  # the tightest tpm window over the scopes
    limit_value: int | None = None  # the value of the limit that rejected the request
    resets_at: datetime | None = None  # when a rejecting budget resets (the start of the next UTC day/month)

    def message(self) -> str:
        """Why the request was rejected and when to retry, for the error body."""
        value = self.limit_value
        what = _DESCRIBE.get(self.limit or "", "{} quota").format(
            usd(value) if self.limit == "monthly_spend" and value is not None else value
        )
        who = (self.scope or "").split(":", 1)[0] or "tenant"
        when = f"in {duration(self.retry_after_ms)}"
        if self.resets_at is not None:
            when = f"on {self.resets_at:%Y-%m-%d %H:%M} UTC ({when})"
        return (
            f"{what} for this {'API key' if who == 'key' else who} exceeded; "
            f"it resets {when}: retry then, or ask for a higher limit"
        )

    @property
    def code(self) -> str:
        """``rate_limit_exceeded`` for the per-minute and concurrency limits, ``quota_exceeded`` for token
        budgets, ``spend_budget_exceeded`` for the spend budget."""
        if self.limit == "monthly_spend":
            return "spend_budget_exceeded"
        return "quota_exceeded" if self.limit in BUDGETS else "rate_limit_exceeded"

    def headers(self) -> dict[str, str]:
        """OpenAI's rate-limit headers (durations spelled as OpenAI does: ``1s``, ``6m0s``)."""
        out: dict[str, str] = {}
        for kind, window in (("requests", self.requests), ("tokens", self.tokens)):
            if window is None:
                continue
            out[f"x-ratelimit-limit-{kind}"] = str(window.limit)
            out[f"x-ratelimit-remaining-{kind}"] = str(max(window.remaining, 0))
            out[f"x-ratelimit-reset-{kind}"] = duration(window.reset_ms)
        if not self.admitted:
            out["retry-after"] = str(max(1, -(-self.retry_after_ms // 1000)))
        return out


_DESCRIBE = {
    "rpm": "rate limit of {} requests per minute",
    "tpm": "rate limit of {} tokens per minute (prompt + max_tokens)",
    "concurrency": "limit of {} requests in flight",
    "daily_tokens": "daily budget of {} tokens",
    "monthly_tokens": "monthly budget of {} tokens",
    "monthly_spend": "monthly spend budget of {} (this request may cost up to its prompt at the fresh price "
    "plus max_tokens at the output price)",
}


def duration(ms: int) -> str:
    """``1s``, ``250ms``, ``6m0s``, ``1h2m3s``: how OpenAI's x-ratelimit-reset-* headers spell durations."""
    if ms < 1000:
        return f"{max(ms, 0)}ms"
    seconds = -(-ms // 1000)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


# KEYS per scope (7 each): rpm log, tpm log, tpm amounts, leases, day counter, month counter, month spend.
# ARGV: request id, tokens, window ms, lease ttl ms, day ttl s, month ttl s, cost (micro-USD), count rpm (1/0:
# 0 when ``attempt`` counted the request already), then per scope its 6 limits and the spend its month already
# has in the ledger (the counter's starting point if missing).
# Returns {admitted, failing scope index (1-based, 0 = none), failing limit index, retry ms,
#          per scope: rpm used, rpm reset ms, tpm used, tpm reset ms}.


def usd(micro_usd: int) -> str:
    """``$12.50``, ``$0.000125``: micro-USD as dollars, cents always shown, no digit lost."""
    dollars, micros = divmod(micro_usd, 1_000_000)
    cents = f"{micros:06d}".rstrip("0").ljust(2, "0")
    return f"${dollars:,}.{cents}"
