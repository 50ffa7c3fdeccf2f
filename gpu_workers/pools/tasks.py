"""The Celery tasks of a worker: run one request on the worker's engine and stream it to Redis.

Each task takes one ``GenerateTask`` JSON string and blocks its thread until the request is done, while the
engine batches it with every other running task. ``serve`` does the whole request; ``prefill`` computes the
prompt, streams the first token and hands the KV off to ``decode``, which continues the stream.

The worker's ``StepWriter`` streams every running request's tokens, one pipelined round trip per engine
step for all of them, and in the same round trip reads their ``cancel_key`` (the gateway sets it when the
client goes away); a set key or a passed deadline aborts the request in the engine, which frees its pages
at once. A task's thread only waits for its request's final event.

Redelivery and dead workers (acks_late): an attempt begins with one atomic script (``RequestStream.begin``:
one round trip) that looks at the stream, takes the request's lease, so two live attempts never run at once
(decode takes it over from the prefill worker that sent it), records the request in flight and reads its
cancel key. Already finished: skip. Holding more than this phase started with (decode starts after
prefill's one token event): an earlier attempt died mid-stream, and replaying would duplicate tokens the
client has seen, so publish an ``error`` event with code ``worker_lost`` for the client to retry. Nothing
yet: run; a clean retry. When a worker's heartbeat goes stale, a live peer of its pool recovers its
in-flight requests by the same rule (re-queue or fail) and re-queues the tasks waiting in its worker
queue; so a reader never waits past a worker's death by more than ``HEARTBEAT_TTL_S`` plus one heartbeat,
as long as one worker of the pool lives. Usage is counted once: only the terminal event carries it, and the
lease lets exactly one attempt write a terminal event.

A worker whose engine failed for good (``Engine.failed``) ends its running requests with ``worker_lost`` and
hands every task it has not started back to the pool queue, for a live peer (``worker.py`` then exits).
The KV hand-off blob carries a checksum; decode fails the request with ``kv_handoff_corrupt`` when it does
not match, and recomputes the prompt when the blob is gone.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import redis
from celery import Celery

from gpu_workers.engine import Engine, SamplingParams, StreamEvent
from gpu_workers.engine.params import ENGINE_FAILED
from gpu_workers.kv.transfer import InvalidKVBlock, KVBlock
from gpu_workers.pools.handoff import HandoffCorrupt, HandoffMissing, HandoffStore, colocated_decode
from gpu_workers.pools.inflight import Inflight, take_orphans
from gpu_workers.pools.messages import updated
from gpu_workers.pools.stream import LeaseLost, RequestStream, StepWriter
from gpu_workers.protocol import (
    TASK_DECODE,
    TASK_PREFILL,
    TASK_SERVE,
    Event,
    GenerateTask,
    KVHandoff,
    Sampling,
    Usage,
    pool_queue,
    send_task,
    worker_queue,
)

log = logging.getLogger(__name__)

TASK_OF_POOL = {"serve": TASK_SERVE, "prefill": TASK_PREFILL, "decode": TASK_DECODE}


@dataclass
class Outcome:
    final: StreamEvent  # the engine's last event for the request
    completion_tokens: int
    deadline_exceeded: bool


def sampling_params(sampling: Sampling, max_tokens: int | None = None) -> SamplingParams:
    return SamplingParams(
        max_tokens=sampling.max_tokens if max_tokens is None else max_tokens,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        seed=sampling.seed,
        stop=list(sampling.stop),
        stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        frequency_penalty=sampling.frequency_penalty,
        presence_penalty=sampling.presence_penalty,
        repetition_penalty=sampling.repetition_penalty,
        grammar=sampling.grammar,
        logprobs=sampling.logprobs,
    )


def as_dict(usage: Usage) -> dict[str, int]:
    return json.loads(usage.to_json())


def error_event(code: str, message: str, usage: Usage | None = None) -> Event:
    return Event(
        kind="error",
        error={"code": code, "message": message},
        usage=None if usage is None else as_dict(usage),
    )


def worker_lost(usage: Usage | None = None) -> Event:
    return error_event(
        "worker_lost",
        "the worker serving this request stopped after streaming part of the output; retry the request",
        usage,
    )


class TaskRunner:
    """Runs this worker's tasks on its engine. ``export_kv`` (prefill) is the decode pool's KV format."""

    def __init__(
        self,
        engine: Engine,
        client: redis.Redis,
        app: Celery,
        *,
        worker_id: str,
        pool: str,
        host: str,
        handoff: HandoffStore | None = None,
        handoff_transport: str = "auto",
        export_kv: str | None = None,
    ):
        if pool == "prefill" and export_kv is None:
            raise ValueError("a prefill worker needs export_kv: the decode pool's KV format")
        self.engine = engine
        self.client = client
        self.app = app
        self.worker_id = worker_id
        self.pool = pool
        self.host = host
        self.handoff = handoff or HandoffStore(client)
        self.handoff_transport = handoff_transport
        self.export_kv = export_kv
        self.inflight = Inflight(client, worker_id)
        self.writer = StepWriter(client, engine.abort)

    def register(self) -> None:
        """Register this pool's tasks on the app, by their protocol names: a decode worker also serves
        whole requests (prompts short enough that the gateway skips the prefill pool for them)."""
        names = [TASK_OF_POOL[self.pool]] + ([TASK_SERVE] if self.pool == "decode" else [])
        for name in names:
            self.app.task(name=name, ignore_result=True)(self._task(name))

    def _task(self, name: str):
        def run(payload: str) -> None:
            self.run(name, payload)

        return run

    # -- one attempt ---------------------------------------------------------------------------------

    def run(self, name: str, payload: str) -> None:
        task = GenerateTask.from_json(payload)
        if self.engine.failed is not None:
            # This worker is on its way out (worker.py); a task it has not started belongs to a live peer.
            log.warning("engine failed; handing %s of request %s back to its pool", name, task.request_id)
            send_task(self.app, name, payload, pool_queue(task.deployment, self.pool))
            return
        stream = RequestStream(self.client, task.request_id, self.worker_id)
        # Decode may take the lease over from the prefill worker that wrote the first (and only) token:
        # prefill holds it until the decode task is sent, so a failed send can still be reported.
        begun = stream.begin(
            handed_over=name == TASK_DECODE, inflight=self.inflight.entry(task.request_id, name, payload)
        )
        if begun.status == "finished":
            log.info("request %s already finished; dropping a redelivered %s", task.request_id, name)
            return
        if begun.status == "busy":
            log.info("request %s is being served by another attempt; dropping this %s", task.request_id, name)
            return
        try:
            if begun.status == "cut":
                log.warning("request %s was cut off mid-stream by a dead worker; failing it", task.request_id)
                stream.publish(worker_lost())
                return
            self.inflight.track(task.request_id)
            try:
                {TASK_SERVE: self._serve, TASK_PREFILL: self._prefill, TASK_DECODE: self._decode}[name](
                    task, stream, begun.cancelled
                )
            finally:
                self.inflight.untrack(task.request_id)
        except LeaseLost:
            log.warning("request %s was taken over by another attempt; stopped this one", task.request_id)
        except Exception as exc:
            log.exception("%s of request %s failed", name, task.request_id)
            try:
                stream.publish(
                    error_event("internal_error", f"the worker failed serving this request: {exc}")
                )
            except Exception:
                log.exception("could not report the failure of request %s", task.request_id)
        finally:
            stream.end(self.inflight.key)

    def _serve(self, task: GenerateTask, stream: RequestStream, cancelled: bool) -> None:
        usage = Usage(prompt_tokens=len(task.prompt_ids))
        if not self._admit(task, stream, usage, cancelled):
            return
        outcome = self._generate(task, stream, task.prompt_ids, sampling_params(task.sampling))
        usage.cached_tokens = outcome.final.cached_tokens
        usage.completion_tokens = outcome.completion_tokens
        stream.publish(self._terminal(outcome, usage))

    def _prefill(self, task: GenerateTask, stream: RequestStream, cancelled: bool) -> None:
        usage = Usage(prompt_tokens=len(task.prompt_ids))
        if not self._admit(task, stream, usage, cancelled):
            return
        hand_off = task.sampling.max_tokens > 1
        params = sampling_params(task.sampling, max_tokens=1)
        export = self.export_kv if hand_off else None
        outcome = self._generate(task, stream, task.prompt_ids, params, export_kv=export)
        final = outcome.final
        usage.cached_tokens = final.cached_tokens
        usage.completion_tokens = outcome.completion_tokens
        if not hand_off or final.finish_reason != "length":
            stream.publish(self._terminal(outcome, usage))  # done in one token (EOS, stop), or failed
            return
        block: KVBlock = final.kv
        decode_queue = task.decode_queue or pool_queue(task.deployment, "decode")
        header = KVHandoff(
            request_id=task.request_id,
            kv_format=block.kv_format,
            num_tokens=block.num_tokens,
            num_layers=block.k.shape[0],
            num_kv_heads=block.k.shape[2],
            head_dim=block.k.shape[3],
            first_token=final.token_ids[-1],
            cached_tokens=usage.cached_tokens,
        )
        header = self.handoff.put(header, block, self._transport(task.deployment, decode_queue))
        log.info(
            "request %s: handing KV of %d tokens to %s via %s %s (%d bytes)",
            task.request_id,
            header.num_tokens,
            decode_queue,
            header.transport,
            header.location,
            header.nbytes,
        )
        decode = updated(task, decode_queue=decode_queue, handoff=header)
        try:
            send_task(self.app, TASK_DECODE, decode.to_json(), decode_queue)
        except Exception:
            self.handoff.discard(header)
            raise

    def _decode(self, task: GenerateTask, stream: RequestStream, cancelled: bool) -> None:
        header = task.handoff
        if header is None:
            stream.publish(
                error_event("invalid_task", "a decode task needs the KV hand-off header from prefill")
            )
            return
        usage = Usage(
            prompt_tokens=len(task.prompt_ids), cached_tokens=header.cached_tokens, completion_tokens=1
        )
        if not self._admit(task, stream, usage, cancelled):
            self.handoff.discard(header)
            return
        try:
            block = self._take_kv(header)
        except HandoffCorrupt as exc:
            log.error("request %s: %s", task.request_id, exc)
            stream.publish(error_event("kv_handoff_corrupt", f"{exc}; retry the request", usage))
            return
        params = sampling_params(task.sampling, max_tokens=task.sampling.max_tokens - 1)
        prompt = task.prompt_ids + [header.first_token]
        # The first token was prefill's output: replaying it lets a stop string that began there end here.
        outcome = self._generate(task, stream, prompt, params, kv_import=block, streamed_output=1)
        usage.completion_tokens += outcome.completion_tokens
        stream.publish(self._terminal(outcome, usage))

    def _take_kv(self, header: KVHandoff) -> KVBlock | None:
        """The prompt's KV from prefill; None (the engine recomputes the prompt) if it cannot be used.
        Raises HandoffCorrupt for a blob whose checksum does not match."""
        try:
            block = self.handoff.take(header)
        except HandoffMissing as exc:
            log.warning("request %s: %s; recomputing its prompt", header.request_id, exc)
            return None
        except InvalidKVBlock as exc:
            log.error("request %s: unusable KV hand-off (%s); recomputing its prompt", header.request_id, exc)
            return None
        spec = self.engine.model.kv_spec
        expected = (spec.num_layers, header.num_tokens, spec.num_kv_heads, spec.head_dim)
        # An FP8 entry with a bf16 tail stores more bytes than it has values: compare values per entry.
        got = (*block.k.shape[:3], block.head_dim)
        if got != expected:
            log.error(
                "request %s: KV hand-off of shape %s, expected %s (layers, tokens, KV heads, head dim); "
                "do prefill and decode serve the same checkpoint? recomputing the prompt",
                header.request_id,
                got,
                expected,
            )
            return None
        log.info(
            "request %s: imported KV of %d tokens (%s) via %s %s",
            header.request_id,
            header.num_tokens,
            header.kv_format,
            header.transport,
            header.location,
        )
        return block

    def _transport(self, deployment: str, decode_queue: str) -> str:
        if self.handoff_transport != "auto":
            return self.handoff_transport
        return "shm" if colocated_decode(self.client, deployment, decode_queue, self.host) else "redis"

    # -- the engine side -----------------------------------------------------------------------------

    def _admit(self, task: GenerateTask, stream: RequestStream, usage: Usage, cancelled: bool) -> bool:
        """False (after publishing why) if the request was cancelled (its cancel key was set when the attempt
        began) or is past its deadline already."""
        if cancelled:
            stream.publish(Event(kind="final", finish_reason="abort", usage=as_dict(usage)))
            return False
        if time.time() >= task.deadline:
            stream.publish(self._deadline_error(task, usage))
            return False
        return True

    def _generate(
        self, task: GenerateTask, stream: RequestStream, prompt: list[int], params: SamplingParams, **kv
    ) -> Outcome:
        """Run the request on the engine until it finishes, is cancelled or expires; ``writer`` streams its
        tokens (and watches its cancel key and deadline) while this thread waits."""
        self.writer.start()
        request = self.writer.open(stream, task.deadline)
        request_id = task.request_id
        try:
            self.engine.add_request(
                prompt, params, request_id=request_id, tenant=task.tenant, on_event=request.put, **kv
            )
            request.wait(alive=self.writer.alive)
        except BaseException:
            self.engine.abort(request_id)  # whatever stopped us, the pages go back now
            raise
        finally:
            self.writer.close(request)
        if request.error is not None:
            raise request.error
        return Outcome(request.final, request.completion_tokens, request.deadline_exceeded)

    def _terminal(self, outcome: Outcome, usage: Usage) -> Event:
        final = outcome.final
        if final.finish_reason == "error":
            error = final.error
            if error.code == ENGINE_FAILED:  # the worker exits and is restarted: to the client, a lost worker
                return error_event("worker_lost", error.message, usage)
            return error_event(error.code, error.message, usage)
        if final.finish_reason == "abort" and outcome.deadline_exceeded:
            return self._deadline_error(None, usage)
        return Event(kind="final", finish_reason=final.finish_reason, usage=as_dict(usage))

    @staticmethod
    def _deadline_error(task: GenerateTask | None, usage: Usage) -> Event:
        where = "before a worker could start it" if task is not None else "while it was running"
        return error_event(
            "deadline_exceeded",
            f"the request passed its deadline {where}; retry with a longer timeout",
            usage,
        )

    # -- recovering a dead peer ----------------------------------------------------------------------

    def recover(self, dead_worker_id: str) -> None:
        """Finish what a dead worker of this pool left: its in-flight requests and its queued tasks."""
        for name, payload in take_orphans(self.client, dead_worker_id):
            task = GenerateTask.from_json(payload)
            stream = RequestStream(self.client, task.request_id, self.worker_id)
            if not stream.claim(previous_owner=dead_worker_id):
                continue  # a live attempt serves it (say, decode after the dead prefill handed over)
            try:
                state = stream.state()
                if state.finished:
                    continue
                if state.events <= (1 if name == TASK_DECODE else 0) and time.time() < task.deadline:
                    log.warning("re-queueing request %s of dead worker %s", task.request_id, dead_worker_id)
                    stream.release()
                    send_task(self.app, name, payload, pool_queue(task.deployment, self.pool))
                else:
                    log.warning("failing request %s of dead worker %s", task.request_id, dead_worker_id)
                    stream.publish(worker_lost())
            finally:
                stream.release()
        self.requeue_worker_queue(dead_worker_id)

    def requeue_worker_queue(self, worker_id: str) -> None:
        """Move the tasks waiting in a (dead or departing) worker's own queue to its pool's queue."""
        pool_q = None
        with self.app.connection_for_write() as conn:
            channel = conn.default_channel
            while (message := channel.basic_get(worker_queue(worker_id), no_ack=True)) is not None:
                try:
                    name = message.headers["task"]
                    (payload,), _, _ = message.decode()
                    pool_q = pool_q or pool_queue(GenerateTask.from_json(payload).deployment, self.pool)
                except Exception:  # not a task of ours: drop it, and move the rest
                    log.exception("dropping an unreadable message from the queue of worker %s", worker_id)
                    continue
                send_task(self.app, name, payload, pool_q)
