"""The decode side of the server: one worker thread owns a batched decoder; requests join it at cycle boundaries (up
to max_batch), get their text deltas per cycle, and leave when done, stopped, cancelled or out of time. No web code."""

from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import target as T
from ..decoding import Cycle, DecodeSettings, Decoder, GenerationResult, Request
from ..decoding.settings import PREFILL_CHUNK
from ..decoding.prefixes import PrefixCache
from ..models import Target
from ..target_batch import supports_batch

log = logging.getLogger("flashdraft.serve")

RATE_WINDOW_S = 10.0  # /metrics tokens per second: output tokens over this many recent seconds
HOLD_IDS = 64  # the detokenizer's window never waits for a character to complete over more ids than this
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
WARM_UP = ((24, 12), (40, 20))  # made-up requests run before the first real one: (prompt tokens, new tokens)


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
    ignore_eos: bool = False  # vLLM's extension: no stop tokens, so exactly max_tokens (what its benchmark sends)


class PerThread:
    """The tokenizer, one copy per thread: a Hugging Face fast tokenizer shared across threads can fail with
    "RuntimeError: Already borrowed", and a lock would make the decode thread wait on a long prompt's encoding."""

    def __init__(self, tokenizer):
        self.base, self.local, self.lock = tokenizer, threading.local(), threading.Lock()

    def get(self):
        """This thread's copy (made on first use; None without a tokenizer)."""
        tok = getattr(self.local, "tok", None)
        if tok is None and self.base is not None:
            with self.lock:  # copies read the original: one at a time
                tok = self.local.tok = copy.deepcopy(self.base)
        return tok

    def decode(self, ids: list[int]) -> str:
        """As Target.decode, on this thread's copy."""
        tok = self.get()
        return tok.decode(ids, skip_special_tokens=True) if tok is not None else ""


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
    state: str = "queued"  # "queued" → "running" (in the batch) → "ended"; written by the worker only
    decoding: Request | None = None  # the worker's: its decoding request, text tracker, wait and largest batch
    tracker: TextTracker | None = None
    queue_s: float = 0.0
    batch: int = 1
    rid: str = ""  # the response id: the client's 500 names it, the server log has the traceback under it

    @property
    def live(self) -> bool:
        """Still to be decoded: neither ended by the worker nor cancelled (a place in the admission bound)."""
        return self.state != "ended" and not self.cancel.is_set()

    def abort(self, reason: str) -> None:
        """Ask the worker to drop the job at the next cycle boundary (the first reason wins)."""
        if not self.cancel.is_set():
            self.reason = reason
            self.cancel.set()

    def emit(self, kind: str, payload) -> None:
        """Thread-safe: ("delta", text), ("done", GenerationResult), ("aborted", reason) or ("error", request id)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop has closed (shutdown): nobody is listening
            pass


class TextTracker:
    """Incremental detokenization (as vLLM / TextIteratorStreamer): each cycle decodes only a window of recent ids,
    hands out text only once it cannot change (no half character, no trailing space a later token may clean up, no
    partial stop string), and cuts the output at the first stop string. The work per cycle is bounded by the window
    and the longest stop string, never by the output's length: the settled text is kept in pieces, joined once."""

    def __init__(self, decode_ids: Callable[[list[int]], str], stops: list[str]):
        self.decode, self.stops = decode_ids, stops
        self.longest = max(map(len, stops), default=0)
        self.ids: list[int] = []
        self.parts: list[str] = []  # the text before `base`, never looked at again until the end
        self.base = 0  # where `head` starts: min(sent, fixed - longest + 1), what a stop or a delta may reach back to
        self.head = ""  # the text from `base` to `fixed` (final: its ids are never decoded again)
        self.tail = ""  # the window's text after `fixed` (without a trailing incomplete character)
        self.sent = 0
        self.stopped = False
        self.prefix = self.read = 0  # the window: ids[prefix:read] decode to the text before `fixed`
        self.fixed = 0

    @property
    def text(self) -> str:
        """The text so far (cut before the stop string once stopped)."""
        return "".join(self.parts) + self.head + self.tail

    def add(self, new: list[int]) -> str:
        """Take newly emitted ids; return the text that may be sent now."""
        start = len(self.ids)
        self.ids.extend(new)
        piece, settled = self._window(len(self.ids))
        cut = self._find_stop(piece)
        if cut is None:
            self.tail = piece
            if settled or len(self.ids) - self.prefix > HOLD_IDS:
                self._settle()
            return self._take(self._settled_end())
        # a block can run past the stop string: keep the fewest ids whose text already contains it
        for k in range(start + 1, len(self.ids) + 1):
            if self._find_stop(self._window(k)[0]) is not None:
                del self.ids[k:]
                break
        local = (self.head + piece)[:cut - self.base]  # the stop may begin before `fixed`, never before `base`
        self.head, self.tail, self.fixed, self.stopped = local, "", self.base + len(local), True
        return self._take(self.fixed)

    def finish(self) -> str:
        """The text still held back (sent when the generation ends)."""
        if not self.stopped and self.read < len(self.ids):
            self.tail = self._window(len(self.ids), final=True)[0]
        return self._take(self.fixed + len(self.tail))

    def _settle(self) -> None:
        """The window's text is final: move it into `head`, and what no stop or delta can reach into `parts`."""
        self.prefix, self.read = self.read, len(self.ids)
        self.head, self.fixed, self.tail = self.head + self.tail, self.fixed + len(self.tail), ""
        keep_from = max(self.base, min(self.sent, self.fixed - max(self.longest - 1, 0)))
        if keep_from > self.base:
            self.parts.append(self.head[:keep_from - self.base])
            self.head, self.base = self.head[keep_from - self.base:], keep_from

    def _window(self, end: int, final: bool = False) -> tuple[str, bool]:
        """(text of ids[read:end] in the context of ids[prefix:read], whether it is settled); unless final, without
        a trailing incomplete character."""
        before = self.decode(self.ids[self.prefix:self.read]) if self.read > self.prefix else ""
        new = self.decode(self.ids[self.prefix:end])[len(before):]
        if final:
            return new, True
        piece = new.rstrip("\ufffd")
        return piece, piece == new and not piece[-1:].isspace()

    def _find_stop(self, piece: str) -> int | None:
        """Where the first stop string begins in the text with `piece` after `fixed` (an absolute offset), or None."""
        if not self.stops:
            return None
        frm = max(0, self.fixed - self.longest + 1) - self.base  # text before this was searched in earlier cycles
        local = self.head[frm:] + piece
        hits = [i for i in (local.find(s) for s in self.stops) if i >= 0]
        return self.base + frm + min(hits) if hits else None

    def _settled_end(self) -> int:
        """How far the text may be sent: not a trailing space that the next token may clean up (" ." → ".") inside
        the window, nor a tail that may grow into a stop string."""
        local = self.head + self.tail
        end = self.base + len(local)
        floor = max(self.sent, self.fixed)  # text before `fixed` is final: its spaces cannot change
        while end > floor and local[end - 1 - self.base].isspace():
            end -= 1
        return min(end, self.base + len(local) - self._partial_stop(local))

    def _partial_stop(self, local: str) -> int:
        """The length of the longest end of local that begins a stop string (0 if none)."""
        hold = 0
        for s in self.stops:
            tail = local[len(local) - len(s) + 1:] if len(s) > 1 else ""
            i = tail.find(s[0])
            while 0 <= i and len(tail) - i > hold:  # the first hit is the longest candidate
                if s.startswith(tail[i:]):
                    hold = len(tail) - i
                    break
                i = tail.find(s[0], i + 1)
        return hold

    def _take(self, end: int) -> str:
        local = self.head + self.tail
        delta = local[self.sent - self.base:end - self.base] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta


class Stats:
    """What the worker measures for /metrics: the batch now, batched steps by size, and tokens per second over the
    last RATE_WINDOW_S seconds, kept as per-second buckets (bounded memory however many tokens). Written by the
    worker, read by the event loop."""

    def __init__(self):
        self.lock, self.started = threading.Lock(), time.monotonic()
        self.batch = self.steps = self.rows = self.tokens = 0
        self.prefix_tokens = 0  # prompt tokens not prefilled thanks to the prefix cache
        self.sizes = dict.fromkeys(BATCH_BUCKETS, 0)  # steps with at most this many rows (cumulative when read)
        self.recent: deque[list[int]] = deque(maxlen=int(RATE_WINDOW_S) + 1)  # [second, tokens emitted in it]

    def step(self, rows: int, tokens: int) -> None:
        with self.lock:
            self.steps, self.rows = self.steps + 1, self.rows + rows
            for b in BATCH_BUCKETS:
                self.sizes[b] += rows <= b
        self.emitted(tokens)

    def emitted(self, tokens: int) -> None:
        second = int(time.monotonic())
        with self.lock:
            self.tokens += tokens
            if self.recent and self.recent[-1][0] == second:
                self.recent[-1][1] += tokens
            else:
                self.recent.append([second, tokens])

    def tokens_per_s(self) -> float:
        """Output tokens per second over the last RATE_WINDOW_S seconds (the current one partly; less since the
        start)."""
        t = time.monotonic()
        first = int(t) - int(RATE_WINDOW_S) + 1
        with self.lock:
            n = sum(k for second, k in self.recent if second >= first)
        return n / max(min(t - first, t - self.started), 1e-3)


class Worker:
    """A loaded target + drafter, the settings every request shares (block size, DLoop, prompt lookup, tree) and the
    worker thread that decodes up to max_batch requests together; each request brings its own length, sampling
    settings and seed."""

    def __init__(self, target: Target, drafter: torch.nn.Module | None, settings: DecodeSettings = DecodeSettings(),
                 max_batch: int = 8, adaptive: bool = True, tokens: PerThread | None = None,
                 prefill_chunk: int = PREFILL_CHUNK, threads: int | None = None, prefix_cache_mib: float = 0):
        self.target, self.drafter, self.settings = target, drafter, settings.validate()
        self.threads = threads  # torch threads of the decode thread (None: as the process has them; threads.hand_over)
        self.block_size = settings.resolve(drafter.config.block_size if drafter is not None else None).block_size
        self.stop_ids = target.stop_token_ids()
        self.batched = supports_batch(target.model)
        self.max_batch, self.adaptive = (max_batch if self.batched else 1), adaptive
        self.prefill_chunk = prefill_chunk
        self.prefixes = PrefixCache.of_mib(prefill_chunk, prefix_cache_mib)  # kept when a decoder is replaced
        self.tokens = tokens or PerThread(target.tokenizer)
        self.inbox: queue.Queue[Job | None] = queue.Queue()
        self.live: list[Job] = []  # the worker's: jobs in the batch
        self.stats = Stats()
        self.thread: threading.Thread | None = None

    def decoder(self) -> Decoder:
        """A fresh decoder (one request at a time where the target cannot batch: sliding-window layers), with the
        worker's prefix cache."""
        return Decoder(self.target.model, self.drafter, self.settings, adaptive=self.adaptive, slots=self.max_batch,
                       prefill_chunk=self.prefill_chunk, prefixes=self.prefixes)

    def settings_for(self, req: GenRequest) -> DecodeSettings:
        """req's settings: the same as flashdraft.generate_ids gets (so outputs are identical)."""
        return self.settings.updated(max_new_tokens=req.max_tokens, temperature=req.temperature, top_k=req.top_k,
                                     top_p=req.top_p, seed=req.seed,
                                     stop_token_ids=() if req.ignore_eos else self.stop_ids)

    def start(self) -> None:
        self.thread = threading.Thread(target=self.work, name="flashdraft-decode", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.inbox.put(None)

    def submit(self, job: Job) -> None:
        self.inbox.put(job)

    # ---------------------------------------------------------------- the worker thread

    def work(self) -> None:
        """Admit waiting jobs into free rows, drop cancelled or late ones, run one batched cycle; repeat."""
        if self.threads:
            torch.set_num_threads(self.threads)
        self.warm_up()
        dec = self.decoder()
        self.tokens.get()  # this thread's tokenizer copy, made before the first request needs it
        while self.admit(dec):
            self.sweep(dec)
            if not dec.busy:
                continue
            try:
                results = dec.step()
            except Exception as e:  # a shared pass failed: the batch's state is unknown, fail its requests, start anew
                log.error("a batched cycle failed; ending its requests %s", [j.rid for j in self.live], exc_info=e)
                for job in list(self.live):
                    self.end(job, "error", job.rid)
                dec = self.decoder()
                continue
            self.stats.step(len(results), sum(len(c.emitted) for _, c in results))
            self.stats.prefix_tokens = self.prefixes.reused_tokens if self.prefixes else 0
            for seq, cycle in results:
                seq.key.batch = max(seq.key.batch, len(results))
                if seq.error is not None:  # that row left the batch; the others went on
                    self.fail(dec, seq.key, seq.error)
                else:
                    self.advance(dec, seq.key, cycle)

    def warm_up(self) -> None:
        """Two made-up greedy requests through a decoder that is then thrown away: a process's first passes are
        several times slower than warm ones (its first drafter pass over two rows: 61 ms, warm ones 8.6), and the
        first request's decoder would take them for the machine's costs."""
        model = self.target.model
        dec, vocab, limit = self.decoder(), T.vocab_size(model), T.context_limit(model)
        dec.prefixes = None  # made-up prompts: nothing to keep
        try:
            for prompt, new in WARM_UP:
                dec.join([(7 * i + 3) % vocab for i in range(min(prompt, limit // 2))],
                         self.settings.updated(max_new_tokens=min(new, limit // 4), temperature=0.0,
                                               stop_token_ids=()))
            while dec.busy:
                dec.step()
        except Exception as e:  # noqa: BLE001 - the requests will meet it again and report it on their own
            log.error("the warm-up decode failed", exc_info=e)

    def admit(self, dec: Decoder) -> bool:
        """Join waiting jobs while there are free rows (waiting for one when idle); False once stopped."""
        while len(self.live) < self.max_batch:
            try:
                job = self.inbox.get_nowait() if self.live else self.inbox.get()
            except queue.Empty:
                return True
            if job is None:
                return False
            self.join(dec, job)
        return True

    def join(self, dec: Decoder, job: Job) -> None:
        """Prefill job's prompt and add it to the batch, unless it was cancelled or timed out while it waited."""
        if job.cancel.is_set() or time.monotonic() > job.deadline:
            return self.end(job, "aborted", job.reason or ("client" if job.cancel.is_set() else "timeout"))
        job.queue_s = time.monotonic() - job.admitted
        job.tracker = TextTracker(self.tokens.decode, job.request.stops)
        try:
            job.decoding, cycle = dec.join(job.request.prompt_ids, self.settings_for(job.request), key=job)
        except Exception as e:  # reported to the client as a 500; the others keep decoding
            return self.fail(dec, job, e)
        job.state = "running"
        self.live.append(job)
        self.stats.batch = len(self.live)
        self.stats.emitted(len(cycle.emitted))
        self.advance(dec, job, cycle)

    def sweep(self, dec: Decoder) -> None:
        """Cycle boundary: drop the jobs whose client left, whose deadline passed, or that shutdown cancelled."""
        for job in list(self.live):
            if time.monotonic() > job.deadline:
                job.abort("timeout")
            if job.cancel.is_set():
                dec.leave(job.decoding)
                self.end(job, "aborted", job.reason or "client")

    def advance(self, dec: Decoder, job: Job, cycle: Cycle) -> None:
        """Hand out the cycle's settled text; finish the job when its sequence is done or a stop string ends it."""
        try:
            delta = job.tracker.add(cycle.emitted)
            if delta and job.stream:
                job.emit("delta", delta)
            if job.tracker.stopped or job.decoding.done:
                dec.leave(job.decoding)
                self.end(job, "done", self.outcome(dec, job))
        except Exception as e:  # noqa: BLE001 - this request's fault only
            self.fail(dec, job, e)

    def fail(self, dec: Decoder, job: Job, e: BaseException) -> None:
        """End job with a 500 that names only its request id; the traceback goes to the server log."""
        log.error("request %s failed while decoding", job.rid, exc_info=e)
        if job.decoding is not None:
            dec.leave(job.decoding)
        self.end(job, "error", job.rid)

    def outcome(self, dec: Decoder, job: Job) -> GenerationResult:
        """The job's result: the ids and text its client got (cut at a stop string), why it ended, its wait and its
        largest batch (extras)."""
        tracker = job.tracker
        rest = tracker.finish()
        if rest and job.stream:
            job.emit("delta", rest)
        result, ids = dec.result(job.decoding), tracker.ids
        result.timing.close(result.timing.total_s, len(ids))
        stopped = tracker.stopped or (bool(ids) and ids[-1] in self.stop_ids)
        result.output_ids, result.text = ids, tracker.text
        result.extras = {"finish_reason": "stop" if stopped else "length", "queue_s": job.queue_s, "batch": job.batch}
        return result

    def end(self, job: Job, kind: str, payload) -> None:
        job.state = "ended"
        job.decoding = job.tracker = None  # its Request holds the job as its key: a cycle that would keep the request's
        # caches (~0.3 MB) alive until a full garbage collection, which a busy server runs only now and then
        if job in self.live:
            self.live.remove(job)
        self.stats.batch = len(self.live)
        job.emit(kind, payload)
