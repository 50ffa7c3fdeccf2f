"""A request's ``n`` choices: each one a generation of its own on the same worker, the first queued at once and
the others once its first token has come (its prompt's full KV pages are in that worker's prefix cache then,
so the others compute only the prompt's last partial page); their events merged as they come, tagged with
the choice's index, and their usage metered as the prompt once plus every choice's output."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing

from gpu_workers.protocol import Event
from tessera.responses import Result
from tessera.streaming import StreamReader


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice ``index``'s seed: a seeded request's choices differ from each other and repeat as a whole."""
    return None if seed is None else (seed + index) % 2**63


async def choice_events(
    readers: list[StreamReader], start_others: Callable[[], Awaitable[None]]
) -> AsyncIterator[tuple[int, Event]]:
    """Each choice's events, as (index, event) in the order they come. ``start_others`` (it queues choices
    1..n-1) is awaited when choice 0's first event has come, or choice 0 ended without one; closing this
    iterator closes every reader (each cancels its generation if it is still running)."""
    queue: asyncio.Queue[tuple[int, Event | None]] = asyncio.Queue()

    async def pump(index: int, reader: StreamReader) -> None:
        try:
            async with aclosing(reader.events()) as events:
                async for event in events:
                    await queue.put((index, event))
        finally:
            queue.put_nowait((index, None))

    pumps = [asyncio.create_task(pump(0, readers[0]))]
    ended = 0
    try:
        while ended < len(readers):
            index, event = await queue.get()
            if index == 0 and len(pumps) == 1 and len(readers) > 1:
                await start_others()
                pumps += [asyncio.create_task(pump(i, r)) for i, r in enumerate(readers[1:], start=1)]
            if event is None:
                ended += 1
            else:
                yield index, event
    finally:
        for task in pumps:
            task.cancel()
        for task in pumps:
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def collect_choices(
    readers: list[StreamReader], start_others: Callable[[], Awaitable[None]]
) -> list[Result]:
    results = [Result() for _ in readers]
    async with aclosing(choice_events(readers, start_others)) as events:
        async for index, event in events:
            results[index].add(event)
    return results


def combined(results: list[Result], prompt_tokens: int) -> Result:
    """The choices as one result for metering and records: the prompt once (as the first choice's prefill
    computed it), the outputs summed, the first error, the first choice's finish reason."""
    if len(results) == 1:
        return results[0]
    first = results[0]
    usage = None
    if any(r.usage is not None for r in results):
        usage = {
            **first.usage_or_count(prompt_tokens),
            "completion_tokens": sum(r.usage_or_count(prompt_tokens)["completion_tokens"] for r in results),
        }
    return Result(
        text=first.text,
        token_ids=[t for r in results for t in r.token_ids],
        finish_reason=first.finish_reason,
        usage=usage,
        error=next((r.error for r in results if r.error is not None), None),
    )
