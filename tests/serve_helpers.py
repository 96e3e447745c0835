"""Tiny model directories and a real `flashdraft serve` subprocess on a free loopback port, for the server tests."""

from __future__ import annotations

import http.client
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from helpers import VOCAB, random_drafter, tiny_target

from flashdraft.checkpoint import save_drafter

ROOT = Path(__file__).resolve().parents[1]
CHARS = [chr(c) for c in range(32, 32 + VOCAB - 5)]  # 91 printable characters
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
STARTUP_S = 120  # importing torch + transformers and loading a model on a busy 2-core machine


def char_tokenizer():
    """Character-level tokenizer with a chat template; every id of the tiny vocabulary decodes."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<|im_start|>", "<|im_end|>", "<unused>"]
    vocab = {t: i for i, t in enumerate(specials + CHARS + ["<mask>"])}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>", "<unused>", "<mask>"])
    tok.chat_template = TEMPLATE
    return tok


def make_model_dirs(root: Path, max_pos: int = 16384, block_size: int = 4) -> tuple[Path, Path]:
    """A tiny Llama target (no EOS, so every answer runs to max_tokens) + char tokenizer, and a random drafter."""
    model = tiny_target("llama", seed=3, max_pos=max_pos)
    model.save_pretrained(root / "tiny-target")
    char_tokenizer().save_pretrained(root / "tiny-target")
    save_drafter(random_drafter(model, block_size=block_size), root / "tiny-drafter")
    return root / "tiny-target", root / "tiny-drafter"


def child_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


class Server:
    """`python -m flashdraft.cli serve … --port 0` as a child process: its URL, its stderr, and a clean stop."""

    def __init__(self, *args: str, startup_s: float = STARTUP_S):
        cmd = [sys.executable, "-m", "flashdraft.cli", "serve", "--host", "127.0.0.1", "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env=child_env(), cwd=ROOT)
        self.lines: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()
        self.url = self._wait_url(startup_s)
        self.port = int(self.url.rsplit(":", 1)[1].split("/")[0])
        self._wait_health(startup_s)

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line)
            self.lines.put(line)

    def _wait_url(self, timeout: float) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)
            if m:
                return m.group(1)
        self.kill()
        raise RuntimeError(f"the server did not start:\n{''.join(self.stderr)}")

    def _wait_health(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                if self.request("GET", "/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"/health never answered:\n{''.join(self.stderr)}")

    def request(self, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None,
                timeout: float = 60) -> tuple[int, dict | str, dict]:
        """One raw HTTP request: (status, parsed JSON or text, headers)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = json.dumps(body).encode() if isinstance(body, dict) else body
            hdrs = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=data, headers=hdrs)
            resp = conn.getresponse()
            raw = resp.read().decode()
            try:
                parsed = json.loads(raw)
            except json.JSONDecodeError:
                parsed = raw
            return resp.status, parsed, dict(resp.getheaders())
        finally:
            conn.close()

    def metrics(self) -> dict[str, float]:
        """/metrics as {'name{labels}': value}."""
        _, text, _ = self.request("GET", "/metrics")
        return {k: float(v) for k, v in (l.rsplit(" ", 1) for l in text.splitlines() if l and l[0] != "#")}

    def terminate(self, timeout: float = 60) -> int:
        """SIGTERM and wait; returns the exit status."""
        self.proc.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def cli_generate(target: Path | str | None, drafter: Path | str | None, *args: str, timeout: float = 600) -> dict:
    """`flashdraft generate … --json` in a subprocess: the record it prints."""
    cmd = [sys.executable, "-m", "flashdraft.cli", "generate", *args, "--json"]
    if target is not None:
        cmd += ["--target", str(target)]
    if drafter is not None:
        cmd += ["--drafter", str(drafter)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=timeout)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)
