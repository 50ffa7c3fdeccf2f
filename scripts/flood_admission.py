"""Issue 38, finding 2: does a tenant flooding the API with requests it will be refused slow another tenant?

Starts a real API server (``tessera.server``, the app of ``create_app`` with test_gateway's faked worker
pools: the gateway is measured, not a model) on the local Redis, then measures another tenant's median latency
for a small completion, quiet and under a flood of four clients looping on 1 MiB prompts and two on ~10 MB
Workers-AI batches of such prompts, and the server's resident memory before, at its peak and after.

    python scripts/flood_admission.py [--seconds 20] [--redis redis://127.0.0.1:6379/0]

Run it from the tree to measure (its ``platform`` and ``tests`` go on the server's path).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx

TREE = Path(__file__).resolve().parents[1]
PROMPT = "word " * 200_000  # 1 MB of text: a body just under the 1 MiB limit, a prompt far over the context
CODES = (0, 200, 400, 408, 413, 429, 500, 503)  # 0: a transport error (the server closed the connection)
FLOOD_RPM = (
    60  # the flooding tenant's rate limit: its attempts beyond it are refused before their bodies are read
)
BATCH = {"requests": [{"prompt": PROMPT[:990_000]} for _ in range(10)]}  # ~9.9 MB, under the 10 MB limit


def serve(data: Path, port: int, redis_url: str) -> None:
    sys.path[:0] = [str(TREE / "platform"), str(TREE / "tests")]
    from tessera import db, deployments, quota_config, tenancy
    from tessera.app import create_app
    from tessera.limits import Limits
    from tessera.server import server
    from tessera.settings import Settings
    from test_gateway import FakePools, reply, sync_redis

    settings = Settings(
        data_dir=data,
        redis_url=redis_url,
        port=port,
        secret_key="flood-admission-" * 3,
        records_stream=f"tessera:flood:{uuid.uuid4().hex}",
    )
    db.upgrade(settings.database_url)
    sessions = db.session_factory(db.make_engine(settings.database_url))
    model = f"@flood/demo-{uuid.uuid4().hex[:8]}"
    with sessions() as session:
        config = {
            "name": model,
            "checkpoint": str(data / "model"),
            "mode": "colocated",
            "max_model_len": 2048,
            "max_tokens_limit": 256,
        }
        deployments.create_deployment(session, config, actor="flood")
        keys = {}
        for name in ("flood", "quiet"):
            tenant = tenancy.create_tenant(session, name)
            _, keys[name] = tenancy.create_key(session, name)
            keys[name + "_id"] = tenant.id
        quota_config.set_limits(session, "flood", Limits(rpm=FLOOD_RPM))
    pools = FakePools(sync_redis(redis_url), reply())

    def heartbeat() -> None:
        while True:
            pools.heartbeat(model, "serve", f"serve-{model[-8:]}")
            time.sleep(1)

    threading.Thread(target=heartbeat, daemon=True).start()
    app = create_app(settings)
    app.state.gateway.celery = pools
    (data / "keys.json").write_text(json.dumps({**keys, "model": model}))
    server(app, settings).run()


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def flood(url: str, path: str, key: str, body: bytes, stop, counts) -> None:
    # The attackers would be elsewhere; on one small machine, their own CPU must not be what slows the API.
    os.nice(19)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    with httpx.Client(base_url=url, timeout=120) as client:
        while not stop.is_set():
            try:
                status = client.post(path, headers=headers, content=body).status_code
            except httpx.TransportError:
                status = 0
            with counts.get_lock():
                counts[CODES.index(status) if status in CODES else 0] += 1


def latencies(url: str, key: str, model: str, n: int) -> list[float]:
    body = {"model": model, "prompt": [1, 2, 3, 4], "max_tokens": 4}
    out = []
    with httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {key}"}) as client:
        for _ in range(n):
            t = time.perf_counter()
            response = client.post("/v1/completions", json=body)
            out.append(time.perf_counter() - t)
            if response.status_code != 200:  # counted as answered; a stall can starve the worker's heartbeat
                print("quiet request:", response.status_code, response.text[:200], file=sys.stderr)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--serve", nargs=2, metavar=("DATA", "PORT"))
    args = parser.parse_args()
    if args.serve:
        serve(Path(args.serve[0]), int(args.serve[1]), args.redis)
        return
    with tempfile.TemporaryDirectory() as tmp:
        from gpu_workers.tools.demo_checkpoint import write_demo_checkpoint  # here: the API stays torch-free

        write_demo_checkpoint(Path(tmp) / "model", seed=0)
        port = 18000 + os.getpid() % 1000
        proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", tmp, str(port), "--redis", args.redis],
            stdout=subprocess.DEVNULL,
            stderr=open(Path(tmp) / "api.log", "wb"),  # noqa: SIM115
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while not (Path(tmp) / "keys.json").exists() or not _up(url):
                assert proc.poll() is None and time.monotonic() < deadline, (
                    Path(tmp) / "api.log"
                ).read_text()
                time.sleep(0.2)
            keys = json.loads((Path(tmp) / "keys.json").read_text())
            latencies(url, keys["quiet"], keys["model"], 20)  # warm up
            start_rss = rss_mb(proc.pid)
            quiet = statistics.median(latencies(url, keys["quiet"], keys["model"], 60))
            stop, counts = multiprocessing.Event(), multiprocessing.Array("i", len(CODES))
            completion = json.dumps({"model": keys["model"], "prompt": PROMPT, "max_tokens": 4}).encode()
            batch_path = f"/accounts/{keys['flood_id']}/ai/run/{keys['model']}?queueRequest=true"
            clients = [
                multiprocessing.Process(
                    target=flood, args=(url, "/v1/completions", keys["flood"], completion, stop, counts)
                )
                for _ in range(4)
            ] + [
                multiprocessing.Process(
                    target=flood,
                    args=(url, batch_path, keys["flood"], json.dumps(BATCH).encode(), stop, counts),
                )
                for _ in range(2)
            ]
            for c in clients:
                c.start()
            # Open loop: a quiet request every 100 ms whatever the earlier ones are doing, so a stall is
            # sampled as often as a quiet spell (a closed loop would sample it once).
            peak, futures = start_rss, []
            with concurrent.futures.ThreadPoolExecutor(64) as pool:
                ends = time.monotonic() + args.seconds
                while time.monotonic() < ends:
                    futures.append(pool.submit(latencies, url, keys["quiet"], keys["model"], 1))
                    peak = max(peak, rss_mb(proc.pid))
                    time.sleep(0.1)
                loaded = [f.result()[0] for f in futures]
            stop.set()
            for c in clients:
                c.join()
            time.sleep(3)
            after = rss_mb(proc.pid)
            report = {
                "quiet_median_ms": round(quiet * 1000, 1),
                "flood_median_ms": round(statistics.median(loaded) * 1000, 1),
                "flood_p90_ms": round(statistics.quantiles(loaded, n=10)[-1] * 1000, 1),
                "flood_samples": len(loaded),
                "flood_answers": {str(code): counts[i] for i, code in enumerate(CODES) if counts[i]},
                "rss_start_mb": round(start_rss),
                "rss_peak_mb": round(peak),
                "rss_after_mb": round(after),
            }
            print(json.dumps(report, indent=1))
        finally:
            proc.terminate()
            proc.wait(30)


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


if __name__ == "__main__":
    main()
