"""Admission and the counters: up to max_batch decoding together plus max_queue waiting, 429 beyond, draining on
shutdown; the decoding itself runs in the engine's one worker thread (the model is not thread-safe)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from .engine import BATCH_BUCKETS, Engine, GenRequest, Job, Outcome, Stats
from .protocol import ApiError

OUTCOMES = ("ok", "bad_request", "rejected", "unavailable", "timeout", "cancelled", "error")


@dataclass
class Limits:
    max_queue: int = 8  # requests that may wait while the batch is full; past that: 429
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

    def render(self, queued: int, stats: Stats, max_batch: int, draining: bool) -> str:
        lines = ["# HELP flashdraft_requests_total Requests by outcome.", "# TYPE flashdraft_requests_total counter"]
        lines += [f'flashdraft_requests_total{{outcome="{k}"}} {v}' for k, v in self.requests.items()]
        tau = self.accepted / self.cycles if self.cycles else 0.0
        for name, kind, value, help_ in [
            ("prompt_tokens_total", "counter", self.prompt_tokens, "Prompt tokens of completed requests."),
            ("completion_tokens_total", "counter", self.completion_tokens, "Tokens generated for completed requests."),
            ("cycles_total", "counter", self.cycles, "Draft-verify cycles of completed requests."),
            ("accepted_tokens_total", "counter", self.accepted, "Sum of acceptance lengths."),
            ("decode_seconds_total", "counter", round(self.decode_s, 6), "Seconds spent decoding completed requests."),
            ("mean_tau", "gauge", round(tau, 6), "Mean acceptance length over all cycles so far."),
            ("generated_tokens_total", "counter", stats.tokens, "Tokens decoded for any request, finished or not."),
            ("tokens_per_second", "gauge", round(stats.tokens_per_s(), 3), "Tokens decoded per second, last 10 s."),
            ("batch_steps_total", "counter", stats.steps, "Batched cycles (one target verify for the whole batch)."),
            ("batch_size", "gauge", stats.batch, "Sequences in the batch now."),
            ("max_batch", "gauge", max_batch, "Sequences that may decode together (--max-batch)."),
            ("queued_requests", "gauge", queued, "Admitted requests waiting for a place in the batch."),
            ("running_requests", "gauge", stats.batch, "Requests being decoded (the sequences in the batch)."),
            ("draining", "gauge", int(draining), "1 after SIGTERM: new requests are refused."),
        ]:
            name = f"flashdraft_{name}"
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
        return "\n".join(lines + histogram(stats)) + "\n"


def histogram(stats: Stats) -> list[str]:
    """Batched cycles by their number of sequences, as a Prometheus histogram."""
    name = "flashdraft_step_batch_size"
    lines = [f"# HELP {name} Sequences per batched cycle.", f"# TYPE {name} histogram"]
    lines += [f'{name}_bucket{{le="{b}"}} {stats.sizes[b]}' for b in BATCH_BUCKETS]
    return lines + [f'{name}_bucket{{le="+Inf"}} {stats.steps}', f"{name}_sum {stats.rows}",
                    f"{name}_count {stats.steps}"]


class Scheduler:
    """Admits up to max_batch + max_queue requests and hands them, in order, to the engine's worker thread."""

    def __init__(self, engine: Engine, limits: Limits):
        self.engine, self.limits, self.metrics = engine, limits, Metrics()
        self.admitted: set[Job] = set()  # until the handler has seen the job end
        self.draining = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.engine.start()

    async def stop(self) -> None:
        self.cancel_all("shutdown")
        self.engine.stop()

    @property
    def capacity(self) -> int:
        return self.engine.max_batch + self.limits.max_queue

    @property
    def queued(self) -> int:
        return sum(job.state == "queued" for job in self.admitted)

    @property
    def running(self) -> int:
        """Sequences in the batch now."""
        return self.engine.stats.batch

    def render_metrics(self) -> str:
        return self.metrics.render(self.queued, self.engine.stats, self.engine.max_batch, self.draining)

    def submit(self, gen: GenRequest, stream: bool) -> Job:
        """Admit a request or refuse it at once (503 while draining, 429 when full): never a hang."""
        if self.draining:
            raise ApiError(503, "the server is shutting down", "unavailable_error", code="shutting_down")
        if len(self.admitted) >= self.capacity:
            raise ApiError(429, f"the server is busy: {len(self.admitted)} requests admitted ({self.engine.max_batch} "
                                f"decoding together, queue limit {self.limits.max_queue}); retry later",
                           "rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
        job = Job(gen, time.monotonic() + self.limits.request_timeout, self._loop, stream)
        self.admitted.add(job)
        self.engine.submit(job)
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
