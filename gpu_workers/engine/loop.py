"""The engine's step loop on a background thread, for servers: it steps while there is work and waits on
the engine's condition otherwise; callers of ``stream`` or ``generate`` then only wait for their events."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from gpu_workers.engine.failures import StepFailures

log = logging.getLogger(__name__)


class StepLoop:
    """Runs ``step`` on a thread of its own until stopped or until the engine fails (``failures.failed``).

    ``work`` is the engine's condition (over its lock), notified when work arrives; ``has_work`` is read
    under it. ``crash(error)`` stops the engine when a step raises past its own failure handling."""

    def __init__(
        self,
        work: threading.Condition,
        step: Callable[[], object],
        has_work: Callable[[], bool],
        failures: StepFailures,
        crash: Callable[[BaseException], None],
    ):
        self._work = work
        self._step = step
        self._has_work = has_work
        self._failures = failures
        self._crash = crash
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        with self._work:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._work:
            thread, self._thread = self._thread, None
            self._work.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        me = threading.current_thread()
        while True:
            with self._work:
                while self._thread is me and self._failures.failed is None and not self._has_work():
                    self._work.wait()
                if self._thread is not me or self._failures.failed is not None:
                    return
            try:
                self._step()
            except Exception as exc:  # step() contains its own failures; this is the last line, not the plan
                log.critical("engine loop failed", exc_info=exc)
                self._crash(exc)
                return
