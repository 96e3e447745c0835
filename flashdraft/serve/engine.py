"""The decode side of the server: one generation at a time in a worker thread, text deltas out, stop strings,
cancellation at block boundaries. No web code here."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from ..decoding import DecodeSettings, Session, mean_acceptance
from ..models import Target


@dataclass
class GenRequest:
    """A validated generation request: token ids in, sampling settings, stop strings."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stops: list[str] = field(default_factory=list)


@dataclass
class Outcome:
    """What a finished generation reports: ids, text, why it ended, and the decoding stats."""

    output_ids: list[int]
    text: str
    finish_reason: str  # "stop" (stop token or stop string) or "length"
    acceptance_lengths: list[int]
    timing: dict

    @property
    def tau(self) -> float:
        return mean_acceptance(self.acceptance_lengths)


class Aborted(Exception):
    """The generation was stopped at a block boundary: reason is "client", "timeout" or "shutdown"."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(eq=False)
class Job:
    """One admitted request; the worker thread reports to the handler through `events` on the event loop."""

    request: GenRequest
    deadline: float  # time.monotonic() after which the job is abandoned
    loop: asyncio.AbstractEventLoop
    stream: bool = False  # text deltas are only sent to streaming handlers
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    reason: str = ""
    admitted: float = field(default_factory=time.monotonic)

    def abort(self, reason: str) -> None:
        """Ask the worker to stop at the next block boundary (the first reason wins)."""
        if not self.cancel.is_set():
            self.reason = reason
            self.cancel.set()

    def emit(self, kind: str, payload) -> None:
        """Thread-safe: ("delta", text), ("done", Outcome) or ("aborted" | "error", reason / message)."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))


class TextTracker:
    """Incremental detokenization: hands out text only once it cannot change (no half character, no partial stop
    string), and cuts the output at the first stop string."""

    def __init__(self, decode_ids: Callable[[list[int]], str], stops: list[str]):
        self.decode, self.stops = decode_ids, stops
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.stopped = False

    def add(self, new: list[int]) -> str:
        """Take newly emitted ids; return the text that may be sent now."""
        base = len(self.ids)
        self.ids = self.ids + new
        self.text = self.decode(self.ids)
        cut = self._find_stop(self.text)
        if cut is None:
            return self._take(self._settled_end())
        # a block can run past the stop string: keep the fewest ids whose text already contains it
        for k in range(base + 1, len(self.ids) + 1):
            if self._find_stop(self.decode(self.ids[:k])) is not None:
                self.ids = self.ids[:k]
                break
        self.text, self.stopped = self.text[:cut], True
        return self._take(len(self.text))

    def finish(self) -> str:
        """The text still held back (sent when the generation ends)."""
        return self._take(len(self.text))

    def _find_stop(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _settled_end(self) -> int:
        end = len(self.text)
        for s in self.stops:  # hold back a tail that may grow into a stop string
            for n in range(min(len(s) - 1, end), 0, -1):
                if self.text.endswith(s[:n]):
                    end = min(end, len(self.text) - n)
                    break
        while end > self.sent and self.text[end - 1] == "\ufffd":  # an incomplete multi-byte character
            end -= 1
        return end

    def _take(self, end: int) -> str:
        delta = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta


class Engine:
    """A loaded target + drafter and the settings every request shares (block size, DLoop, prompt lookup, tree);
    each request brings its own length, sampling settings and seed."""

    def __init__(self, target: Target, drafter: torch.nn.Module | None, settings: DecodeSettings = DecodeSettings()):
        self.target, self.drafter, self.settings = target, drafter, settings.validate()
        self.block_size = settings.resolve(drafter.config.block_size if drafter is not None else None).block_size
        self.stop_ids = target.stop_token_ids()

    def session(self, req: GenRequest) -> Session:
        """The decoding session for req: the same setup as flashdraft.generate_ids (so outputs are identical)."""
        settings = self.settings.updated(max_new_tokens=req.max_tokens, temperature=req.temperature, top_k=req.top_k,
                                         top_p=req.top_p, seed=req.seed, stop_token_ids=self.stop_ids)
        return Session(self.target.model, self.drafter, req.prompt_ids, settings)

    def run(self, job: Job) -> None:
        """Worker thread: generate job.request, emitting text deltas per accepted block, then one final event."""
        try:
            job.emit("done", self._generate(job))
        except Aborted as e:
            job.emit("aborted", e.reason)
        except Exception as e:  # reported to the client as a 500; the worker keeps serving
            job.emit("error", f"{type(e).__name__}: {e}")

    def _generate(self, job: Job) -> Outcome:
        req = job.request
        queue_s = time.monotonic() - job.admitted
        self._check(job)
        tracker = TextTracker(self.target.decode, req.stops)
        t0 = time.perf_counter()
        session = self.session(req)  # its KV caches are freed here, in this thread, when it goes out of scope
        for cycle in session:
            delta = tracker.add(cycle.emitted)
            if delta and job.stream:
                job.emit("delta", delta)
            if tracker.stopped:
                break
            self._check(job)
        rest = tracker.finish()
        if rest and job.stream:
            job.emit("delta", rest)
        timing = session.finish().timing
        ids = tracker.ids
        timing.close(time.perf_counter() - t0, len(ids))
        stopped = tracker.stopped or (bool(ids) and ids[-1] in self.stop_ids)
        return Outcome(ids, tracker.text, "stop" if stopped else "length", [c.accepted + 1 for c in session.cycles],
                       {**asdict(timing), "queue_s": queue_s})

    @staticmethod
    def _check(job: Job) -> None:
        """Block boundary: stop here if the client left, the server is shutting down or the deadline passed."""
        if job.cancel.is_set():
            raise Aborted(job.reason or "client")
        if time.monotonic() > job.deadline:
            job.abort("timeout")
            raise Aborted("timeout")
