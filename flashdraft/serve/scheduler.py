"""Admission and the single decode worker: a bounded number of admitted requests, one generation at a time
(the model is not thread-safe and a generation already uses the CPU), draining on shutdown, and the counters."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .engine import Engine, GenRequest, Job, Outcome
from .protocol import ApiError

OUTCOMES = ("ok", "bad_request", "rejected", "unavailable", "timeout", "cancelled", "error")


@dataclass
class Limits:
    max_queue: int = 8  # requests that may wait while one is decoded; past that: 429
    request_timeout: float = 300.0  # seconds from admission (waiting included) to the last token
    max_body: int = 1 << 20  # bytes
    shutdown_timeout: float = 30.0  # after SIGTERM, admitted work gets this long before it is cancelled


class Metrics:
    """Counters for /metrics (Prometheus text format); only touched from the event loop."""

    def __init__(self):
        self.requests = dict.fromkeys(OUTCOMES, 0)
        self.prompt_tokens = self.completion_tokens = self.cycles = self.accepted = 0
        self.decode_s = 0.0

    def record(self, outcome: str, gen: GenRequest | None = None, out: Outcome | None = None) -> None:
        self.requests[outcome] += 1
        if out is not None and gen is not None:
            self.prompt_tokens += len(gen.prompt_ids)
            self.completion_tokens += len(out.output_ids)
            self.cycles += len(out.acceptance_lengths)
            self.accepted += sum(out.acceptance_lengths)
            self.decode_s += out.timing["total_s"]

    def render(self, queued: int, running: int, draining: bool) -> str:
        lines = ["# HELP flashdraft_requests_total Requests by outcome.", "# TYPE flashdraft_requests_total counter"]
        lines += [f'flashdraft_requests_total{{outcome="{k}"}} {v}' for k, v in self.requests.items()]
        tau = self.accepted / self.cycles if self.cycles else 0.0
        for name, kind, value, help_ in [
            ("prompt_tokens_total", "counter", self.prompt_tokens, "Prompt tokens of completed requests."),
            ("completion_tokens_total", "counter", self.completion_tokens, "Tokens generated for completed requests."),
            ("cycles_total", "counter", self.cycles, "Target verify passes (draft-verify cycles)."),
            ("accepted_tokens_total", "counter", self.accepted, "Sum of acceptance lengths."),
            ("decode_seconds_total", "counter", round(self.decode_s, 6), "Seconds spent decoding completed requests."),
            ("mean_tau", "gauge", round(tau, 6), "Mean acceptance length over all cycles so far."),
            ("queued_requests", "gauge", queued, "Admitted requests waiting for the decoder."),
            ("running_requests", "gauge", running, "Requests being decoded (0 or 1)."),
            ("draining", "gauge", int(draining), "1 after SIGTERM: new requests are refused."),
        ]:
            name = f"flashdraft_{name}"
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
        return "\n".join(lines) + "\n"


class Scheduler:
    """Admits up to 1 + max_queue requests and feeds them, in order, to one decode thread."""

    def __init__(self, engine: Engine, limits: Limits):
        self.engine, self.limits, self.metrics = engine, limits, Metrics()
        self.admitted: set[Job] = set()  # until the handler has seen the job end
        self.running: Job | None = None
        self.draining = False
        self._queue: asyncio.Queue[Job] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._worker: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="flashdraft-decode")

    async def start(self) -> None:
        self._loop, self._queue = asyncio.get_running_loop(), asyncio.Queue()
        self._worker = asyncio.create_task(self._work())

    async def stop(self) -> None:
        self.cancel_all("shutdown")
        if self._worker:
            self._worker.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)

    @property
    def queued(self) -> int:
        return len(self.admitted) - (self.running in self.admitted)

    def submit(self, gen: GenRequest, stream: bool) -> Job:
        """Admit a request or refuse it at once (503 while draining, 429 when full): never a hang."""
        if self.draining:
            raise ApiError(503, "the server is shutting down", "unavailable_error", code="shutting_down")
        if len(self.admitted) >= 1 + self.limits.max_queue:
            raise ApiError(429, f"the server is busy: {len(self.admitted)} requests admitted, queue limit "
                                f"{self.limits.max_queue}; retry later", "rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"})
        job = Job(gen, time.monotonic() + self.limits.request_timeout, self._loop, stream)
        self.admitted.add(job)
        self._queue.put_nowait(job)
        return job

    def finish(self, job: Job, outcome: str, out: Outcome | None = None) -> None:
        """The handler is done with job (idempotent): free its slot, count it, and stop the worker on it."""
        if job not in self.admitted:
            return
        self.admitted.discard(job)
        job.abort("client")  # a no-op once the worker has finished it
        self.metrics.record(outcome, job.request, out)

    def drain(self) -> None:
        """SIGTERM (any thread): refuse new work now; cancel what is still admitted after shutdown_timeout."""
        self.draining = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.call_later, self.limits.shutdown_timeout, self.cancel_all,
                                            "shutdown")

    def cancel_all(self, reason: str) -> None:
        for job in list(self.admitted):
            job.abort(reason)

    async def _work(self) -> None:
        while True:
            job = await self._queue.get()
            if job.cancel.is_set() or job not in self.admitted:  # its client left while it waited
                job.emit("aborted", job.reason or "client")
                continue
            self.running = job
            try:
                await self._loop.run_in_executor(self._executor, self.engine.run, job)
            finally:
                self.running = None
