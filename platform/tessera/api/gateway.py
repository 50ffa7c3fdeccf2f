"""The gateway's request path, shared by the OpenAI routes, the Workers-AI routes and the batch runner.

``Gateway`` (one per app, ``app.state.gateway``): the attempt counted against rpm before the body is read,
the body prepared (``api.prepare``), the quotas and the tenant's in-flight bound admitted in one script, the
request routed to a live worker and queued on Celery, then its stream read into one JSON body or SSE chunks
(``streaming``, ``responses``); the reservation settled once, to the tokens used, however it ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime

from celery import Celery
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from kombu.exceptions import OperationalError
from redis.asyncio import Redis
from redis.exceptions import RedisError
from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from billing import metrics
from gpu_workers.protocol import DeploymentSpec, EmbedTask, GenerateTask, send_task
from tessera import records, responses, routing, streaming
from tessera.api.catalog import Catalog, Model
from tessera.api.deps import Caller
from tessera.api.errors import request_id
from tessera.api.guard import ARRIVED
from tessera.api.prepare import Prepared, prepare
from tessera.api.schemas import GenerationRequest
from tessera.choices import choice_events, choice_seed, collect_choices, combined
from tessera.errors import APIError
from tessera.limits import Decision, Limits, Scope
from tessera.models import utcnow
from tessera.pricing import PriceCache, PriceVersion, charge, max_cost
from tessera.quota_config import QuotaLookup
from tessera.quotas import Held, Quotas, QuotaUnavailable
from tessera.settings import Settings

log = logging.getLogger(__name__)

AFFINITY_HEADER = "x-session-affinity"
REJECT_IF_BUSY_HEADER = "x-reject-if-busy"
# A body this small tokenises on the event loop (~0.3 ms at most: about what a thread hop costs); larger
# ones in a thread, so a long prompt never stalls the other requests' streams.
INLINE_PREPARE_BYTES = 1024
REFUSAL_PAUSE_S = 1.0  # an rpm refusal waits this long (or until the window has room) before it is sent
# Set in a request's state once ``Gateway.attempt`` has counted it against rpm.
RPM_COUNTED = "rpm_counted"
DEADLINE_GRACE_S = 2.0  # the gateway outwaits the worker's own deadline, so the worker's error arrives first


@dataclass
class Gateway:
    """What the inference routes share; one per app (``app.state.gateway``)."""

    settings: Settings
    catalog: Catalog
    redis: Redis
    celery: Celery
    recorder: records.Recorder
    quotas: Quotas
    quota_lookup: QuotaLookup
    prices: PriceCache | None = None  # default: over the quota lookup's database
    # The in-flight bound of each model this gateway has served: together, the bound ``attempt`` holds a
    # tenant to across models before it reads a body.
    in_flight_bounds: dict[str, int] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if self.prices is None:
            self.prices = PriceCache(self.quota_lookup.sessions)

    def prepare(self, body: GenerationRequest, model: Model | None = None) -> Prepared:
        """``prepare.prepare`` against ``model``, or the body's model from the catalog."""
        return prepare(body, model or self.catalog.get(body.model))

    async def prepare_for(self, request: Request, body: GenerationRequest) -> Prepared:
        """``prepare``, on the event loop for a request body of at most ``INLINE_PREPARE_BYTES`` whose model
        the catalog holds (no database read), else in a thread."""
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) <= INLINE_PREPARE_BYTES:
            model = self.catalog.cached(body.model)
            if model is not None:
                return self.prepare(body, model)
        return await run_in_threadpool(self.prepare, body)

    async def serve(
        self,
        request: Request,
        caller: Caller,
        prepared: Prepared,
        kind: str,
        shape: responses.Shape | None = None,
        reject_if_busy: bool = False,
    ) -> Response:
        """Admit the request against its tenant's (and key's) quotas, route and queue it, then answer with its
        result or its stream; the quota reservation is settled once, to the tokens used, however it ends.
        ``shape`` writes the answer (default: OpenAI's objects for ``kind``, ``chat`` or ``text``).
        A worker queue over ``max_queue_depth`` refuses the request (503, its reservation released);
        ``reject_if_busy`` (or the ``x-reject-if-busy: true`` header) makes that an immediate 429 with the
        capacity code instead."""
        reject_if_busy = reject_if_busy or request.headers.get(REJECT_IF_BUSY_HEADER, "").lower() == "true"
        rid = request_id(request)
        spec = prepared.model.spec
        started_at = utcnow()
        prompt_tokens = len(prepared.prompt_ids)
        in_flight_limit = self.in_flight_bounds[spec.name] = self.in_flight_limit(spec)
        await self._check_waited(request, caller, spec.name)

        decision, held, price = await self.admit(
            caller,
            rid,
            spec.name,
            started_at,
            prompt_tokens,
            prepared.n * prepared.sampling.max_tokens,
            rpm_counted=rpm_counted(request),
            in_flight_limit=in_flight_limit,
        )
        streamed = False  # a stream settles when it ends; everything else settles here
        try:
            salt = routing.affinity_salt(self.settings.derive_key("affinity"), caller.tenant_id)
            key = routing.affinity_key(
                salt, request.headers.get(AFFINITY_HEADER), prepared.prompt_ids, spec.page_size
            )
            try:
                route = await routing.route(
                    self.redis,
                    spec,
                    key,
                    self.settings.worker_heartbeat_ttl_s,
                    prefill_locally=0 < prompt_tokens <= prepared.model.local_prefill_max_tokens,
                )
            except routing.NoLiveWorker as e:
                raise APIError(503, str(e), "no_live_worker", headers={"Retry-After": "5"}) from None
            except RedisError as e:
                log.error("could not read worker heartbeats for request %s: %s", rid, e)
                raise APIError(503, "Redis is unreachable; retry shortly", "queue_unavailable") from None
            await self.check_capacity(route, reject_if_busy, caller, spec.name)
            deadline = time.time() + self.settings.request_timeout_s
            tasks = [
                GenerateTask(
                    request_id=rid if i == 0 else f"{rid}-{i}",
                    deployment=spec.name,
                    tenant=caller.tenant_id,
                    prompt_ids=prepared.prompt_ids,
                    sampling=dataclasses.replace(
                        prepared.sampling, seed=choice_seed(prepared.sampling.seed, i)
                    ),
                    deadline=deadline,
                    decode_queue=route.decode_queue,
                )
                for i in range(prepared.n)
            ]
            await self.enqueue(route, tasks[0])
            readers = [
                records.TimedReader(
                    self.redis,
                    task.request_id,
                    spec.name,
                    deadline + DEADLINE_GRACE_S,
                    route.workers,
                    self.settings.worker_heartbeat_ttl_s,
                    client_gone=None if prepared.stream else request.is_disconnected,
                    started_at=started_at,
                )
                for task in tasks
            ]

            async def start_others() -> None:
                for task in tasks[1:]:
                    await self.enqueue(route, task)

            if shape is None:
                shape = responses.OpenAIShape(
                    kind,
                    ("chatcmpl-" if kind == "chat" else "cmpl-") + rid,
                    spec.name,
                    int(time.time()),
                    tool_names=prepared.tool_names,
                    token_bytes=prepared.model.tokenizer.token_bytes
                    if prepared.sampling.logprobs is not None and prepared.model.tokenizer is not None
                    else None,
                )
            # One copy per choice: each holds its own stream's state (tool-call parser, logprobs offsets).
            shapes = [
                dataclasses.replace(shape, cost=lambda usage: charge(price, usage).usage_fields())
                for _ in tasks
            ]

            def usage_of(results: list[responses.Result]) -> dict[str, int]:
                return combined(results, prompt_tokens).usage_or_count(prompt_tokens)

            def settle(results: list[responses.Result]) -> None:
                result = combined(results, prompt_tokens)
                if result.usage is not None or result.token_ids:  # else it failed before producing tokens
                    usage = result.usage_or_count(prompt_tokens)
                    held.used_tokens = usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)
                    held.used_cost = charge(price, usage).total
                outcome = records.outcome_of(
                    result,
                    readers[0],
                    tenant_id=caller.tenant_id,
                    key_id=caller.key_id,
                    model=spec.name,
                    prompt_tokens=prompt_tokens,
                )
                self.recorder.submit(outcome)

            if prepared.stream:
                events = (
                    streaming.tagged(readers[0])
                    if len(readers) == 1
                    else choice_events(readers, start_others)
                )
                chunks = responses.sse(
                    events, shapes, prompt_tokens, prepared.include_usage, settle, usage_of=usage_of
                )
                body = held.guard(chunks)
                streamed = True
                return EventSourceResponse(
                    body, ping=15, headers=decision.headers(), background=BackgroundTask(held.close, body)
                )
            if len(readers) == 1:  # one choice: its reader directly, no merging task
                results = [await streaming.collect(readers[0])]
            else:
                results = await collect_choices(readers, start_others)
            settle(results)
            result = combined(results, prompt_tokens)
            if result.error is not None:
                raise responses.event_error(result.error)
            answer = shapes[0].response(result, prompt_tokens)
            if len(results) > 1:
                answer["choices"] = [
                    {**one.response(r, prompt_tokens)["choices"][0], "index": i}
                    for i, (one, r) in enumerate(zip(shapes, results, strict=True))
                ]
            return JSONResponse(answer, headers=decision.headers())
        finally:
            if not streamed:
                await held.settle()

    async def attempt(self, request: Request, caller: Caller, generation: bool = True) -> None:
        """Count the request against its tenant's (and key's) rpm before its body is read or tokenised, so
        every request a tenant sends, refused later or not, takes its place in the window; over the limit, a
        429 (recorded as a rejection) that costs the gateway no parsing. ``admit`` then skips rpm.
        ``generation``: the body can only be a generation, so a tenant at its in-flight bound is refused
        here too (``_check_in_flight``); a route whose body may poll or queue a batch passes False."""
        if generation:
            await self._check_in_flight(request_id(request), caller)
        scopes = self.quota_lookup.cached(caller.tenant_id, caller.key_id)
        if scopes is None:
            scopes = await run_in_threadpool(self.quota_lookup.scopes, caller.tenant_id, caller.key_id)
        try:
            decision = await self.quotas.attempt(request_id(request), scopes)
        except QuotaUnavailable as e:
            raise _quota_unavailable(request_id(request), e) from None
        if not decision.admitted:
            # A client that retries at once, ignoring Retry-After, is answered after a pause: that bounds
            # what one connection can make the gateway do to about one refusal a second, at the cost of a
            # sleeping coroutine (the connection limit bounds those).
            await asyncio.sleep(min(REFUSAL_PAUSE_S, decision.retry_after_ms / 1000))
            metrics.RATE_LIMITED.labels(limit="rpm").inc()
            # Refused before its body was read: the request names no model yet.
            await self.recorder.reject(caller.tenant_id, caller.key_id, "", "rpm")
            raise APIError(429, decision.message(), decision.code, headers=decision.headers())
        request.scope["state"][RPM_COUNTED] = True

    async def _check_waited(self, request: Request, caller: Caller, model: str) -> None:
        """Refuse a request that arrived more than ``admission_wait_s`` ago and is not admitted yet: the
        API is busier than it can serve in time, and admitting it late would only add to every stream's
        latency (503 overloaded, Retry-After 1, recorded as a rejection; nothing was reserved)."""
        arrived = request.scope.get("state", {}).get(ARRIVED)
        if arrived is None:
            return  # not an HTTP request (a batch item)
        waited = asyncio.get_running_loop().time() - arrived
        if waited <= self.settings.admission_wait_s:
            return
        metrics.RATE_LIMITED.labels(limit="overload").inc()
        await self.recorder.reject(caller.tenant_id, caller.key_id, model, "overload")
        raise APIError(
            503,
            f"the API is overloaded: this request waited {waited:.1f}s to be admitted, more than its bound of "
            f"{self.settings.admission_wait_s:g}s; retry shortly",
            "overloaded",
            headers={"Retry-After": "1"},
        )

    async def _check_in_flight(self, rid: str, caller: Caller) -> None:
        """Refuse at once, before the body is read (so at the cost of one Redis read), a tenant that has as
        many requests in flight, on all models together, as the in-flight bounds of the models served here
        add up to: whatever its body names, that model's bound is reached. ``admit`` then holds the exact
        per-model bound."""
        bound = sum(self.in_flight_bounds.values())
        if bound == 0:
            return
        try:
            held = await self.quotas.in_flight(Scope(in_flight_scope(ANY_MODEL, caller.tenant_id), Limits()))
        except RedisError as e:
            raise _quota_unavailable(rid, QuotaUnavailable(f"quota store unreachable: {e}")) from None
        if held >= bound:
            metrics.RATE_LIMITED.labels(limit="capacity").inc()
            await self.recorder.reject(caller.tenant_id, caller.key_id, "", "capacity")
            raise APIError(
                429,
                f"this tenant already has {held} requests in flight (queued or running), every model's bound "
                "together; retry when one has ended",
                "out_of_capacity",
                headers={"Retry-After": "1"},
            )

    async def admit(
        self,
        caller: Caller,
        rid: str,
        model: str,
        at: datetime,
        prompt_tokens: int,
        max_output: int,
        rpm_counted: bool = False,
        in_flight_limit: int | None = None,
    ) -> tuple[Decision, Held, PriceVersion | None]:
        """Admit a request of ``prompt_tokens`` and at most ``max_output`` output tokens against its tenant's
        (and key's) quotas: the decision (its rate-limit headers), the held reservation and the price version
        it is billed at; ``rpm_counted``: ``attempt`` counted it against rpm already; ``in_flight_limit``: the
        requests the tenant may have in flight on ``model`` (a lease held until the request ends, checked in
        the same script as the quotas). Raises APIError: 429 over a limit (recorded as a rejection), 503 when
        the quota store cannot be read (fail closed)."""
        # The caller's quota scopes and the price version billing prices the request with, both cached: most
        # requests read no database and stay on the event loop; a miss reads it in a thread.
        looked_up = self._cached_lookup(caller, model, at)
        if looked_up is None:
            looked_up = await run_in_threadpool(self._lookup, caller, model, at)
        scopes, price = looked_up
        if in_flight_limit is not None:
            scopes = [
                *scopes,
                Scope(in_flight_scope(model, caller.tenant_id), Limits(concurrency=in_flight_limit)),
                # Its leases count the tenant's requests on every model (``_check_in_flight``); its limit,
                # the per-model bounds together, never binds before theirs.
                Scope(
                    in_flight_scope(ANY_MODEL, caller.tenant_id),
                    Limits(concurrency=sum(self.in_flight_bounds.values())),
                ),
            ]
        try:
            decision, reservation = await self.quotas.admit(
                rid,
                scopes,
                prompt_tokens + max_output,
                max_cost(price, prompt_tokens, max_output),
                rpm_counted=rpm_counted,
            )
        except QuotaUnavailable as e:
            raise _quota_unavailable(rid, e) from None
        if reservation is None and decision.scope is not None and decision.scope.startswith(IN_FLIGHT):
            metrics.RATE_LIMITED.labels(limit="capacity").inc()
            await self.recorder.reject(caller.tenant_id, caller.key_id, model, "capacity")
            raise APIError(
                429,
                f"this tenant already has {in_flight_limit} requests in flight on the model '{model}' (queued or "
                "running), its bound; retry when one has ended",
                "out_of_capacity",
                headers={"Retry-After": str(max(1, -(-decision.retry_after_ms // 1000)))},
            )
        if reservation is None:
            metrics.RATE_LIMITED.labels(limit=decision.limit or "unknown").inc()
            await self.recorder.reject(caller.tenant_id, caller.key_id, model, decision.limit or "unknown")
            raise APIError(429, decision.message(), decision.code, headers=decision.headers())
        return decision, Held(self.quotas, reservation), price

    def in_flight_limit(self, spec: DeploymentSpec) -> int:
        """Requests one tenant may have in flight on ``spec``: ``tenant_in_flight_batches`` engine batches."""
        return max(1, int(spec.max_num_seqs * self.settings.tenant_in_flight_batches))

    async def check_capacity(
        self, route: routing.Route, reject_if_busy: bool, caller: Caller, model: str
    ) -> None:
        """``_check_capacity``, with a busy refusal the request asked for (429) recorded as a rejection."""
        try:
            await self._check_capacity(route, reject_if_busy)
        except APIError as e:
            if e.status == 429:  # busy, and the request asked to be rejected when busy
                await self.recorder.reject(caller.tenant_id, caller.key_id, model, "capacity")
            raise

    def _cached_lookup(
        self, caller: Caller, model: str, at: datetime
    ) -> tuple[list[Scope], PriceVersion | None] | None:
        scopes = self.quota_lookup.cached(caller.tenant_id, caller.key_id)
        priced = self.prices.cached_at(model, at)
        return None if scopes is None or priced is None else (scopes, priced[0])

    def _lookup(self, caller: Caller, model: str, at: datetime) -> tuple[list[Scope], PriceVersion | None]:
        return self.quota_lookup.scopes(caller.tenant_id, caller.key_id), self.prices.at(model, at)

    async def _check_capacity(self, route: routing.Route, reject_if_busy: bool) -> None:
        """Refuse a request whose worker queue already holds ``max_queue_depth`` waiting tasks."""
        try:
            depth = await self.redis.llen(route.queue)
        except RedisError as e:
            raise APIError(503, "Redis is unreachable; retry shortly", "queue_unavailable") from e
        if depth < self.settings.max_queue_depth:
            return
        if reject_if_busy:
            raise APIError(
                429,
                f"the model is busy ({depth} requests waiting) and the request asked to be rejected when busy; "
                "retry shortly",
                "out_of_capacity",
                headers={"Retry-After": "1"},
            )
        raise APIError(
            503,
            f"the model's queue is full ({depth} requests waiting, the bound is {self.settings.max_queue_depth}); "
            "retry shortly",
            "queue_full",
            headers={"Retry-After": "2"},
        )

    async def enqueue(self, route: routing.Route, task: GenerateTask | EmbedTask) -> None:
        expires = max(1.0, task.deadline - time.time())
        try:
            await run_in_threadpool(
                send_task, self.celery, route.task_name, task.to_json(), route.queue, expires=expires
            )
        except OperationalError as e:
            log.error("could not queue request %s: %s", task.request_id, e)
            raise APIError(503, "the task queue is unreachable; retry shortly", "queue_unavailable") from None


IN_FLIGHT = "in-flight:"
ANY_MODEL = "*"  # the in-flight scope of a tenant's requests on all models together


def in_flight_scope(model: str, tenant_id: str) -> str:
    """The quota scope whose concurrency leases count a tenant's requests in flight on ``model``."""
    return f"{IN_FLIGHT}{model}:{tenant_id}"


def rpm_counted(request: Request) -> bool:
    """Whether ``Gateway.attempt`` counted this request against rpm already."""
    return bool(request.scope.get("state", {}).get(RPM_COUNTED))


def _quota_unavailable(rid: str, error: QuotaUnavailable) -> APIError:
    # Fail closed: never admit a request whose quota cannot be checked.
    log.error("could not check the quotas of request %s: %s", rid, error)
    return APIError(
        503,
        "the quota store (Redis) is unreachable, so no request can be admitted; retry shortly",
        "quota_unavailable",
        headers={"Retry-After": "5"},
    )


def gateway(request: Request) -> Gateway:
    return request.app.state.gateway
