"""A llama-server process for one model (and optionally one DFlash drafter), one request at a time.

It returns token ids and its own prompt / generation timings, so HTTP costs are not measured; per-cycle acceptance
and drafting time come from its trace log.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import FlashdraftError
from .build import tool


@dataclass
class Completion:
    """One llama-server generation: ids (stop token included, as flashdraft does) and the server's own timings."""

    tokens: list[int]
    prompt_ms: float
    predicted_ms: float
    acceptance_lengths: list[int] = field(default_factory=list)  # per cycle: drafts accepted + 1 (DFlash only)
    draft_ms: float | None = None  # time spent drafting (DFlash only)


ACCEPTED = re.compile(r"accepted\s+(\d+)/\s*(\d+) draft tokens")
LISTENING = re.compile(r"listening on (http://[\w.:\[\]]+)")
DRAFT_DUR = re.compile(r"draft-dflash: .*dur\(b,g,a\) = ([\d.]+), ([\d.]+), ([\d.]+) ms")


@functools.cache
def cpu_has_amx() -> bool:
    """Whether this CPU has Intel AMX tiles (Linux: /proc/cpuinfo flags)."""
    try:
        return " amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def check_counts(lengths: list[int], drafted: int, timings: dict) -> None:
    """The per-cycle counts read from the log must add up to the totals the server's API reports (draft_n,
    draft_n_accepted): a build that logs in another format fails here, loudly, instead of reporting τ 1.00."""
    want = (int(timings.get("draft_n", 0)), int(timings.get("draft_n_accepted", 0)))
    got = (drafted, sum(lengths) - len(lengths))
    if got != want:
        raise FlashdraftError(f"could not read llama-server's per-cycle acceptance from its log (read {got[1]} of "
                              f"{got[0]} drafts accepted, its API reports {want[1]} of {want[0]}); this build logs "
                              "in another format: use the pinned build (make llamacpp)")


class LlamaServer:
    """A llama-server process for one model (and optionally one DFlash drafter at n_max = block_size - 1)."""

    def __init__(self, model: Path, drafter: Path | None = None, block_size: int | None = None,
                 threads: int | None = None, ctx: int = 4096, startup_s: float = 120.0):
        self.model, self.drafter, self.block_size = Path(model), drafter, block_size
        self.threads, self.ctx, self.startup_s = threads or os.cpu_count() or 1, ctx, startup_s
        self.proc: subprocess.Popen | None = None
        self.log_pos, self.draft_total = 0, 0.0

    def command(self, port: int) -> list[str]:
        t = str(self.threads)
        cmd = [str(tool("llama-server")), "-m", str(self.model), "--host", "127.0.0.1", "--port", str(port),
               "-t", t, "-tb", t, "-c", str(self.ctx), "-np", "1", "--no-webui", "-lv", "4"]
        if self.drafter is not None:
            cmd += ["-md", str(self.drafter), "--spec-type", "draft-dflash", "--spec-draft-n-max",
                    str(self.block_size - 1), "-td", t]
        if cpu_has_amx():  # the pinned build segfaults in its AMX matmul (repacked weights) at warm-up on such CPUs
            cmd += ["--no-repack"]
        return cmd

    def start(self) -> "LlamaServer":
        if self.proc is not None:
            return self
        self.log = tempfile.NamedTemporaryFile(prefix="llama-server.", suffix=".log", delete=False)
        try:  # whatever stops the start (a missing binary, a crash, Ctrl-C), the process and its log go
            env = {**os.environ, "LLAMA_TRACE": "1"}  # per-cycle "accepted k/n draft tokens" lines
            # port 0: the server binds a free port itself and logs it (no window for another process to take it)
            self.proc = subprocess.Popen(self.command(0), stdout=self.log, stderr=subprocess.STDOUT, env=env)
            self.wait_healthy(time.monotonic() + self.startup_s)
        except BaseException:
            self.close()
            raise
        return self

    def wait_healthy(self, deadline: float) -> None:
        """Read the bound address from the log, then wait for /health."""
        self.url = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise FlashdraftError(f"llama-server exited while loading {self.model.name}: {self.last_error()}")
            if self.url is None:
                found = LISTENING.search(Path(self.log.name).read_text(errors="replace"))
                self.url = found.group(1) if found else None
            try:
                if self.url is not None:
                    with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                        if r.status == 200:
                            return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise FlashdraftError(f"llama-server did not come up within {self.startup_s:.0f}s for {self.model.name}")

    def last_error(self) -> str:
        lines = [ln for ln in Path(self.log.name).read_text(errors="replace").splitlines() if ln.strip()]
        bad = [ln for ln in lines if " E " in ln or "error" in ln.lower()]
        return (bad or lines or ["no output"])[-1].strip()

    def new_log(self) -> bytes:
        with open(self.log.name, "rb") as f:
            f.seek(self.log_pos)
            return f.read()

    def complete(self, ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, ignore_eos: bool = False) -> Completion:
        """Generate from prompt ids; greedy at temperature 0, else the same temperature / top-k / top-p as flashdraft."""
        self.start()
        body = {"prompt": ids, "n_predict": max_new_tokens, "temperature": temperature, "top_k": top_k,
                "top_p": top_p, "min_p": 0.0, "seed": seed, "cache_prompt": False, "return_tokens": True,
                "ignore_eos": ignore_eos}
        req = urllib.request.Request(self.url + "/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=3600) as r:
                res = json.load(r)
        except urllib.error.HTTPError as e:
            raise FlashdraftError(f"llama-server refused the request: {e.read().decode(errors='replace')[:200]}") from None
        except (urllib.error.URLError, ConnectionError) as e:
            raise FlashdraftError(f"llama-server ({self.model.name}) failed: {e}; {self.last_error()}") from None
        t = res["timings"]
        out = Completion(list(res["tokens"]), float(t["prompt_ms"]), float(t["predicted_ms"]))
        if self.drafter is not None:
            out.acceptance_lengths, drafted, out.draft_ms = self.read_cycles()
            check_counts(out.acceptance_lengths, drafted, t)
        return out

    def read_cycles(self) -> tuple[list[int], int, float | None]:
        """Per-cycle acceptance lengths, drafts made and drafting ms of the request just finished, from the log;
        drafting ms is None when the log has no draft timer line (missing, not zero)."""
        deadline = time.monotonic() + 10
        raw = self.new_log()
        while b"release:" not in raw and time.monotonic() < deadline:  # the log is written asynchronously
            time.sleep(0.02)
            raw = self.new_log()
        end = raw.find(b"release:")
        raw = raw if end < 0 else raw[: end + len(b"release:")]
        self.log_pos += len(raw)
        text = raw.decode(errors="replace")
        counts = [(int(k), int(n)) for k, n in ACCEPTED.findall(text)]
        durs = DRAFT_DUR.findall(text)
        draft_ms = None
        if durs:  # cumulative over the server's life
            total = float(durs[-1][1])
            draft_ms, self.draft_total = total - self.draft_total, total
        return [k + 1 for k, _ in counts], sum(n for _, n in counts), draft_ms

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if getattr(self, "log", None) is not None:
            self.log.close()
            Path(self.log.name).unlink(missing_ok=True)
            self.log = None

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
