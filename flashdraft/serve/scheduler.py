"""Admission and the counters: up to max_batch decoding together plus max_queue waiting, 429 beyond, draining on
shutdown; the decoding itself runs in the one worker thread (the model is not thread-safe)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ..decoding import GenerationResult
from .protocol import ApiError
from .worker import BATCH_BUCKETS, GenRequest, Job, Worker

OUTCOMES = ("ok", "bad_request", "rejected", "unavailable", "timeout", "cancelled", "error")


@dataclass
class Limits:
    max_queue: int = 8  # requests that may wait while the batch is full; past that: 429
    request_timeout: float = 300.0  # seconds from admission (waiting included) to the last token
    max_body: int = 1 << 20  # bytes
    shutdown_timeout: float = 30.0  # after SIGTERM, admitted work gets this long before it is cancelled
    body_timeout: float = 30.0  # seconds a client may take to send its request body; past that: 408


class Metrics:
    """Request counters (touched from the event loop only), exposed with the worker's Stats by prometheus_client."""

    def __init__(self):
        self.requests = dict.fromkeys(OUTCOMES, 0)
        self.prompt_tokens = self.completion_tokens = self.cycles = self.accepted = 0
        self.decode_s = 0.0

    def record(self, outcome: str, gen: GenRequest | None = None, out: GenerationResult | None = None) -> None:
        self.requests[outcome] += 1
        if out is not None and gen is not None:
            self.prompt_tokens += len(gen.prompt_ids)
            self.completion_tokens += len(out.output_ids)
            self.cycles += len(out.acceptance_lengths)
            self.accepted += sum(out.acceptance_lengths)
            self.decode_s += out.timing.total_s


class Collector:
    """The /metrics families, read at scrape time from the scheduler's counters and the worker's Stats (the names
    are those of docs/design.md §5.1; prometheus_client adds the _total of counters)."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    def collect(self):
        sch = self.scheduler
        m, stats = sch.metrics, sch.worker.stats
        requests = CounterMetricFamily("flashdraft_requests", "Requests by outcome.", labels=["outcome"])
        for outcome, n in m.requests.items():
            requests.add_metric([outcome], n)
        yield requests
        tau = m.accepted / m.cycles if m.cycles else 0.0
        for name, family, value, help_ in [
            ("prompt_tokens", CounterMetricFamily, m.prompt_tokens, "Prompt tokens of completed requests."),
            ("completion_tokens", CounterMetricFamily, m.completion_tokens, "Tokens generated for completed requests."),
            ("cycles", CounterMetricFamily, m.cycles, "Draft-verify cycles of completed requests."),
            ("accepted_tokens", CounterMetricFamily, m.accepted, "Sum of acceptance lengths."),
            ("decode_seconds", CounterMetricFamily, m.decode_s, "Seconds spent decoding completed requests."),
            ("mean_tau", GaugeMetricFamily, tau, "Mean acceptance length over all cycles so far."),
            ("prefix_cached_tokens", CounterMetricFamily, stats.prefix_tokens,
             "Prompt tokens not prefilled: whole chunks reused from a recent prompt (--prefix-cache-mib)."),
            ("generated_tokens", CounterMetricFamily, stats.tokens, "Tokens decoded for any request, finished or not."),
            ("tokens_per_second", GaugeMetricFamily, stats.tokens_per_s(), "Tokens decoded per second, last 10 s."),
            ("batch_steps", CounterMetricFamily, stats.steps, "Batched cycles (one verify for the whole batch)."),
            ("batch_size", GaugeMetricFamily, stats.batch, "Sequences in the batch now."),
            ("max_batch", GaugeMetricFamily, sch.worker.max_batch, "Sequences that may decode together (--max-batch)."),
            ("queued_requests", GaugeMetricFamily, sch.queued, "Admitted requests waiting for a place in the batch."),
            ("running_requests", GaugeMetricFamily, stats.batch, "Requests being decoded (sequences in the batch)."),
            ("draining", GaugeMetricFamily, int(sch.draining), "1 after SIGTERM: new requests are refused."),
        ]:
            yield family(f"flashdraft_{name}", help_, value=value)
        buckets = [(str(b), stats.sizes[b]) for b in BATCH_BUCKETS] + [("+Inf", stats.steps)]
        yield HistogramMetricFamily("flashdraft_step_batch_size", "Sequences per batched cycle.", buckets=buckets,
                                    sum_value=stats.rows)


class Scheduler:
    """Admits up to max_batch + max_queue requests and hands them, in order, to the worker thread."""

    def __init__(self, worker: Worker, limits: Limits):
        self.worker, self.limits, self.metrics = worker, limits, Metrics()
        self.admitted: set[Job] = set()  # until the handler has seen the job end
        self.draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.registry = CollectorRegistry(auto_describe=False)  # its own: several servers may share a process (tests)
        self.registry.register(Collector(self))

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.worker.start()

    async def stop(self) -> None:
        self.cancel_all("shutdown")
        self.worker.stop()

    @property
    def capacity(self) -> int:
        return self.worker.max_batch + self.limits.max_queue

    @property
    def queued(self) -> int:
        return sum(job.state == "queued" and job.live for job in self.admitted)

    @property
    def running(self) -> int:
        """Sequences in the batch now."""
        return self.worker.stats.batch

    def render_metrics(self) -> bytes:
        """/metrics in the Prometheus text format."""
        return generate_latest(self.registry)

    @property
    def live(self) -> int:
        """Admitted jobs still to be decoded: a cancelled or ended job whose handler has not yet finished it holds
        no place (its row leaves at the next cycle boundary)."""
        return sum(job.live for job in self.admitted)

    def submit(self, gen: GenRequest, stream: bool, rid: str = "") -> Job:
        """Admit a request or refuse it at once (503 while draining, 429 when full): never a hang."""
        if self.draining:
            raise ApiError(503, "the server is shutting down", "unavailable_error", code="shutting_down")
        live = self.live
        if live >= self.capacity:
            raise ApiError(429, f"the server is busy: {live} requests admitted ({self.worker.max_batch} "
                                f"decoding together, queue limit {self.limits.max_queue}); retry later",
                           "rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
        job = Job(gen, time.monotonic() + self.limits.request_timeout, self._loop, stream, rid=rid)
        self.admitted.add(job)
        self.worker.submit(job)
        return job

    def finish(self, job: Job, outcome: str | None, out: GenerationResult | None = None) -> None:
        """The handler is done with job (idempotent): free its slot, count it (unless outcome is None: counted
        elsewhere), and stop the worker on it."""
        if job not in self.admitted:
            return
        self.admitted.discard(job)
        job.abort("client")  # a no-op once the worker has finished it
        if outcome is not None:
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
