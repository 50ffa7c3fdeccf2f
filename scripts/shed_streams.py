"""Issue 38, finding 4: N concurrent streams from one tenant against a running API (`tessera up`).

Each request is a streamed completion of a few tokens; the script reports, for admitted streams, the time to
first token (TTFT: the first content chunk), and for refused ones their status, Retry-After and how fast the
refusal came.

    python scripts/shed_streams.py --url http://127.0.0.1:8787 --key tsk_... [--model @tessera/pycode-tiny] [-n 512]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import statistics
import time

import httpx


async def one(client: httpx.AsyncClient, key: str, model: str, max_tokens: int, i: int) -> dict:
    body = {"model": model, "prompt": f"def f{i}(x):\n    return", "max_tokens": max_tokens, "stream": True}
    started = time.perf_counter()
    try:
        async with client.stream(
            "POST", "/v1/completions", headers={"Authorization": f"Bearer {key}"}, json=body
        ) as response:
            if response.status_code != 200:
                await response.aread()
                return {
                    "status": response.status_code,
                    "answered_s": time.perf_counter() - started,
                    "retry_after": response.headers.get("retry-after"),
                }
            ttft = None
            async for line in response.aiter_lines():
                if ttft is None and line.startswith("data: {") and '"text":""' not in line:
                    ttft = time.perf_counter() - started
            return {"status": 200, "ttft_s": ttft, "done_s": time.perf_counter() - started}
    except httpx.HTTPError as e:
        return {"status": 0, "error": type(e).__name__, "answered_s": time.perf_counter() - started}


def quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--model", default="@tessera/pycode-tiny")
    parser.add_argument("-n", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    limits = httpx.Limits(max_connections=args.n + 8, max_keepalive_connections=args.n + 8)
    async with httpx.AsyncClient(base_url=args.url, timeout=600, limits=limits) as client:
        await one(client, args.key, args.model, args.max_tokens, -1)  # the key verified and cached first
        results = await asyncio.gather(
            *(one(client, args.key, args.model, args.max_tokens, i) for i in range(args.n))
        )
    admitted = [r for r in results if r["status"] == 200 and r.get("ttft_s") is not None]
    refused = [r for r in results if r["status"] != 200]
    ttfts = [r["ttft_s"] for r in admitted]
    report = {
        "streams": args.n,
        "statuses": dict(collections.Counter(r["status"] for r in results)),
        "admitted_ttft_s": {
            "p50": round(statistics.median(ttfts), 2),
            "p99": round(quantile(ttfts, 0.99), 2),
            "max": round(max(ttfts), 2),
        }
        if ttfts
        else None,
        "refused_answered_s": {
            "p50": round(statistics.median(r["answered_s"] for r in refused), 3),
            "p99": round(quantile([r["answered_s"] for r in refused], 0.99), 3),
        }
        if refused
        else None,
        "refused_retry_after": dict(collections.Counter(r.get("retry_after") for r in refused)),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
