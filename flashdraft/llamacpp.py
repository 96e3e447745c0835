"""llama.cpp as a second engine: the pinned build, GGUF export with llama.cpp's own converter, and a server client.

`make llamacpp` builds the llama.cpp that the pinned `llama-cpp-python` sdist vendors into
$FLASHDRAFT_LLAMACPP (default: the flashdraft cache, llamacpp/VERSION): bin/ holds the tools, src/ the source tree
with convert_hf_to_gguf.py. Decoding goes through `llama-server` (one process per model setting, one request at a
time), which returns token ids and its own prompt / generation timings, so HTTP costs are not measured.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from .errors import FlashdraftError

LLAMACPP_VERSION = "0.3.36"  # the llama-cpp-python sdist whose vendored llama.cpp `make llamacpp` builds (Makefile)
OUTTYPES = ("f32", "f16", "bf16", "q8_0")
HOW_TO_GET = "run `make llamacpp` (builds the pinned llama.cpp once) or set FLASHDRAFT_LLAMACPP to such a build"


def home() -> Path:
    """Where the llama.cpp build lives: $FLASHDRAFT_LLAMACPP, else <flashdraft cache>/llamacpp/<version>."""
    from .models import cache_root

    env = os.environ.get("FLASHDRAFT_LLAMACPP")
    return Path(env) if env else cache_root() / "llamacpp" / LLAMACPP_VERSION


def tool(name: str) -> Path:
    """Path of a built llama.cpp tool (llama-server), or a one-line error saying how to build it."""
    path = home() / "bin" / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise FlashdraftError(f"llama.cpp's {name} is not built in {home()}: {HOW_TO_GET}")
    return path


def converter() -> Path:
    """llama.cpp's convert_hf_to_gguf.py from the pinned source."""
    path = home() / "src" / "convert_hf_to_gguf.py"
    if not path.is_file():
        raise FlashdraftError(f"llama.cpp's convert_hf_to_gguf.py is not in {home() / 'src'}: {HOW_TO_GET}")
    return path


# ---------------------------------------------------------------- export

def check_writable(out: Path) -> None:
    """One-line errors for an output path that cannot take a new file."""
    if out.is_dir():
        raise FlashdraftError(f"{out} is a directory; give a file name such as {out / 'model.gguf'}")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise FlashdraftError(f"cannot write {out}: the directory {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise FlashdraftError(f"cannot write {out}: permission denied; choose a writable path")


def convert(model_dir: Path, out: Path, outtype: str, target_dir: Path | None = None) -> Path:
    """Run llama.cpp's converter on a HF directory (a target, or a drafter with its target), writing out atomically."""
    if outtype not in OUTTYPES:
        raise FlashdraftError(f"--outtype {outtype!r}: choose from {', '.join(OUTTYPES)}")
    out = Path(out)
    check_writable(out)
    script = converter()
    fd, tmp = tempfile.mkstemp(dir=out.parent if str(out.parent) else ".", prefix=f".{out.name}.", suffix=".tmp")
    os.close(fd)
    cmd = [sys.executable, str(script), str(model_dir), "--outtype", outtype, "--outfile", tmp]
    if target_dir is not None:
        cmd += ["--target-model-dir", str(target_dir)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
            raise FlashdraftError(f"llama.cpp's converter failed on {model_dir}: {lines[-1] if lines else proc.returncode}")
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return out


def target_dims(target_dir: Path) -> tuple[int, int, int]:
    """(layers, hidden size, vocabulary) from a HF target directory's config."""
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(target_dir, local_files_only=True).get_text_config()
    except (OSError, ValueError) as e:
        raise FlashdraftError(f"{target_dir} is not a HF model directory: {str(e).splitlines()[0]}") from None
    return cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size


def local_target_dir(target: str | None) -> Path:
    """A registered name or a local HF directory → its directory (the converter needs files, not a hub id)."""
    from .models import resolve_target

    path = Path(resolve_target(target))
    if not (path / "config.json").is_file():
        raise FlashdraftError(f"target {target!r} is not a local HF model directory (config.json); the GGUF converter "
                              "needs one: pass --target DIR")
    return path


def export_drafter(drafter_dir: str | Path, out: str | Path, target: str | None = None, outtype: str = "f32") -> Path:
    """A z-lab format drafter (DFlash 1 or 2) → a GGUF that llama.cpp's draft-dflash loads, with its target's tokenizer.

    The converter writes target layer ids +1 (llama.cpp taps layer inputs, HF hidden_states[i+1] is layer i's output).
    A draft_vocab.json is not carried over: llama.cpp drafts over the whole vocabulary.
    """
    from .checkpoint import check_compatible
    from .config import load_config

    drafter_dir, out = Path(drafter_dir), Path(out)
    check_writable(out)
    cfg = load_config(drafter_dir)
    target_dir = local_target_dir(target)
    check_compatible(cfg, *target_dims(target_dir), str(drafter_dir))
    return convert(drafter_dir, Path(out), outtype, target_dir)


def export_target(target: str | None, out: str | Path, outtype: str = "f32") -> Path:
    """A HF target (registered name or local directory) → a GGUF of outtype."""
    check_writable(Path(out))
    return convert(local_target_dir(target), Path(out), outtype)


@functools.lru_cache(maxsize=None)
def _file_digest(path: Path, size: int, mtime_ns: int) -> str:
    """sha256 of one file; memoised by (path, size, mtime) since a bench exports per variant from the same files."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _digest(paths: list[Path]) -> str:
    h = hashlib.sha256(LLAMACPP_VERSION.encode())
    for p in paths:
        st = p.stat()
        h.update(p.name.encode() + _file_digest(p.resolve(), st.st_size, st.st_mtime_ns).encode())
    return h.hexdigest()[:16]


def _model_files(d: Path) -> list[Path]:
    return sorted([p for p in d.iterdir() if p.suffix in (".json", ".safetensors") and p.name != "draft_vocab.json"])


def cached_export(kind: str, src: Path, outtype: str, target: str | None = None) -> Path:
    """Export a drafter (kind "drafter") or target (kind "target") once per content and outtype; cached GGUF path."""
    from .models import cache_root

    target_dir = local_target_dir(target) if kind == "drafter" else None
    files = _model_files(src) + (_model_files(target_dir) if target_dir else [])
    out = cache_root() / "gguf" / f"{src.name}-{_digest(files)}.{outtype}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"flashdraft: exporting {src.name} to {out.name} for llama.cpp (cached in {out.parent}) …", file=sys.stderr)
    if kind == "drafter":
        return export_drafter(src, out, target, outtype)
    return convert(src, out, outtype)


# ---------------------------------------------------------------- llama-server

@dataclass
class Completion:
    """One llama-server generation: ids (stop token included, as flashdraft does) and the server's own timings."""

    tokens: list[int]
    prompt_ms: float
    predicted_ms: float
    acceptance_lengths: list[int] = field(default_factory=list)  # per cycle: drafts accepted + 1 (DFlash only)
    draft_ms: float | None = None  # time spent drafting (DFlash only)


ACCEPTED = re.compile(r"accepted\s+(\d+)/\s*(\d+) draft tokens")
DRAFT_DUR = re.compile(r"draft-dflash: .*dur\(b,g,a\) = ([\d.]+), ([\d.]+), ([\d.]+) ms")


@functools.cache
def cpu_has_amx() -> bool:
    """Whether this CPU has Intel AMX tiles (Linux: /proc/cpuinfo flags)."""
    try:
        return " amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix="llama-server.", suffix=".log", delete=False)
        env = {**os.environ, "LLAMA_TRACE": "1"}  # per-cycle "accepted k/n draft tokens" lines
        self.proc = subprocess.Popen(self.command(port), stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                why = self.last_error()
                self.close()
                raise FlashdraftError(f"llama-server exited while loading {self.model.name}: {why}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        self.close()
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
            out.acceptance_lengths, out.draft_ms = self.read_cycles()
        return out

    def read_cycles(self) -> tuple[list[int], float]:
        """Per-cycle acceptance lengths and drafting ms of the request just finished, from the server's log."""
        deadline = time.monotonic() + 10
        raw = self.new_log()
        while b"release:" not in raw and time.monotonic() < deadline:  # the log is written asynchronously
            time.sleep(0.02)
            raw = self.new_log()
        end = raw.find(b"release:")
        raw = raw if end < 0 else raw[: end + len(b"release:")]
        self.log_pos += len(raw)
        text = raw.decode(errors="replace")
        lengths = [int(k) + 1 for k, _ in ACCEPTED.findall(text)]
        durs = DRAFT_DUR.findall(text)
        draft_ms = 0.0
        if durs:  # cumulative over the server's life
            total = float(durs[-1][1])
            draft_ms, self.draft_total = total - self.draft_total, total
        return lengths, draft_ms

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


# ---------------------------------------------------------------- cost profile

def measure_llamacpp(model: Path, drafter: Path | None, block_sizes: list[int], ids: list[int],
                     threads: int | None = None, tokens: int = 128, ctx: int = 4096) -> dict:
    """llama.cpp's cost profile (the shape of profile.measure_torch) measured inside its own loop on one prompt.

    plain_ms: generation time per token of plain decoding; for each B, a DFlash run at n_max = B - 1 gives
    draft_ms (llama.cpp's timer around the drafter's block pass, per cycle) and verify_ms (the rest of the generation
    time per cycle: the B-token target pass, the drafter's context update, sampling and acceptance). Runs ignore EOS
    so every one generates `tokens` tokens.
    """
    def run(server: LlamaServer) -> Completion:
        with server:
            server.complete(ids, 8, ignore_eos=True)  # warm-up: first-call allocations stay out of the timing
            return server.complete(ids, tokens, ignore_eos=True)

    plain = run(LlamaServer(model, threads=threads, ctx=ctx))
    out = {"engine": "llama.cpp", "plain_ms": plain.predicted_ms / max(1, len(plain.tokens) - 1),
           "verify_ms": {}, "draft_ms": {}, "context_len": len(ids) + tokens // 2}
    for b in block_sizes if drafter is not None else []:
        c = run(LlamaServer(model, drafter, b, threads, ctx))
        cycles = len(c.acceptance_lengths)
        if cycles:
            out["draft_ms"][b] = c.draft_ms / cycles
            out["verify_ms"][b] = (c.predicted_ms - c.draft_ms) / cycles
    return out
