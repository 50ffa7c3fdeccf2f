"""What a worker's task spends in Redis to start and end an attempt at a request, outside the engine.

    python scripts/bench_task_attempt.py [REDIS_URL]            # this tree
    PYTHONPATH=/tmp/base python scripts/bench_task_attempt.py   # another (git archive <rev> | tar -x -C ...)

An attempt as ``pools.tasks`` makes it: look at the request's stream, take its lease, record it in the
worker's in-flight hash, read its cancel key; at the end drop the record and release the lease. Trees with
``RequestStream.begin`` do the start in one script and the end in another; older trees make the calls one by
one (the same calls their ``TaskRunner.run`` made). Prints the client's CPU and the wall time per attempt
(median of 5 rounds of 2,000) and the commands Redis ran for one (scripts' inner calls included). Uses
database 7 of the given Redis and flushes it.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import uuid

import redis

from gpu_workers.pools.inflight import Inflight
from gpu_workers.pools.stream import RequestStream
from gpu_workers.protocol import cancel_key

PAYLOAD = json.dumps({"request_id": "r", "prompt_ids": list(range(64))})


def attempt(client: redis.Redis, inflight: Inflight) -> None:
    request_id = f"req_{uuid.uuid4().hex}"
    stream = RequestStream(client, request_id, "bench-worker")
    if hasattr(stream, "begin"):
        begun = stream.begin(
            handed_over=False, inflight=inflight.entry(request_id, "tessera.prefill", PAYLOAD)
        )
        assert begun.status == "claimed" and not begun.cancelled
        inflight.track(request_id)
        inflight.untrack(request_id)
        stream.end(inflight.key)
    else:
        assert not stream.state().finished and stream.claim() and not stream.state().finished
        inflight.add(request_id, "tessera.prefill", PAYLOAD)
        assert not client.exists(cancel_key(request_id))
        inflight.remove(request_id)
        stream.release()


def main() -> None:
    url = sys.argv[1] if len(sys.argv) > 1 else "redis://127.0.0.1:6379/7"
    client = redis.Redis.from_url(url)
    inflight = Inflight(client, "bench-worker")
    client.flushdb()
    for _ in range(200):
        attempt(client, inflight)
    n, cpu, wall = 2000, [], []
    commands = client.info("stats")["total_commands_processed"]
    for _ in range(5):
        c, w = time.process_time(), time.perf_counter()
        for _ in range(n):
            attempt(client, inflight)
        cpu.append((time.process_time() - c) / n * 1e6)
        wall.append((time.perf_counter() - w) / n * 1e6)
    per_attempt = (client.info("stats")["total_commands_processed"] - commands - 1) / (5 * n)
    kind = "begin/end scripts" if hasattr(RequestStream, "begin") else "one call at a time"
    print(
        f"{kind}: {statistics.median(cpu):.0f} us CPU [{min(cpu):.0f}, {max(cpu):.0f}], "
        f"{statistics.median(wall):.0f} us wall per attempt; {per_attempt:.1f} Redis commands"
    )
    client.flushdb()


if __name__ == "__main__":
    main()
