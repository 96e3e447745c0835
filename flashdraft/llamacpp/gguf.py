"""GGUF files for llama.cpp: a drafter or target exported with llama.cpp's own converter (cached per content), and
the target files `--gguf` names."""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig

from ..checkpoint import check_compatible
from ..config import load_config
from ..errors import FlashdraftError
from ..models import REGISTRY, gguf_path, resolve_target
from ..paths import cache_root
from .build import LLAMACPP_VERSION, OUTTYPES, converter


def check_writable(out: Path) -> None:
    """One-line errors for an output path that cannot take a new file."""
    if out.is_dir():
        raise FlashdraftError(f"{out} is a directory; give a file name such as {out / 'model.gguf'}")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise FlashdraftError(f"cannot write {out}: the directory {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise FlashdraftError(f"cannot write {out}: permission denied; choose a writable path")


CONVERT_TIMEOUT_S = 1800  # a 135M model converts in seconds; hours would mean a hang, not a big model


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
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CONVERT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise FlashdraftError(f"llama.cpp's converter did not finish {model_dir} within {CONVERT_TIMEOUT_S} s; "
                                  "check the machine's load and free memory, then retry") from None
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
    try:
        config = AutoConfig.from_pretrained(target_dir, local_files_only=True).get_text_config()
    except (OSError, ValueError) as e:
        raise FlashdraftError(f"{target_dir} is not a HF model directory: {str(e).splitlines()[0]}") from None
    return config.num_hidden_layers, config.hidden_size, config.vocab_size


def local_target_dir(target: str | None) -> Path:
    """A registered name or a local HF directory → its directory (the converter needs files, not a hub id)."""
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
    drafter_dir, out = Path(drafter_dir), Path(out)
    check_writable(out)
    config = load_config(drafter_dir)
    target_dir = local_target_dir(target)
    check_compatible(config, *target_dims(target_dir), str(drafter_dir))
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




# ---------------------------------------------------------------- target files

@dataclass
class Gguf:
    """A target file for llama.cpp: a short label and its path."""

    label: str
    path: Path


def resolve_ggufs(specs: list[str] | None, target_name: str) -> list[Gguf]:
    """--gguf values → labelled target files: an outtype is exported once (cached), `packaged` is the registry's."""
    out = []
    for spec in specs or ["f32"]:
        if spec in OUTTYPES:
            out.append(Gguf(spec, cached_export("target", local_target_dir(target_name), spec)))
        elif spec == "packaged":
            if target_name not in REGISTRY:
                raise FlashdraftError(f"--gguf packaged: {target_name} is not a registered target with a packaged "
                                      "GGUF; give a path or an outtype")
            path = gguf_path(REGISTRY[target_name])
            out.append(Gguf(path.stem.rsplit(".", 1)[-1], path))
        else:
            path = Path(spec)
            if not path.is_file():
                raise FlashdraftError(f"--gguf {spec}: no such file; give a GGUF path, packaged or one of "
                                      f"{', '.join(OUTTYPES)}")
            out.append(Gguf(path.stem.rsplit(".", 1)[-1], path))
    labels = [g.label for g in out]
    if len(set(labels)) != len(labels):
        raise FlashdraftError(f"--gguf files share the label {labels}; rename one")
    return out
