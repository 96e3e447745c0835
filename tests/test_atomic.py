"""Crash safety of flashdraft.atomic: a writer SIGKILLed at any point leaves the old or the new directory, whole."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from flashdraft import atomic

ATOMIC = Path(atomic.__file__)

# Loads atomic.py alone (importing the package would load torch, seconds per run), wraps every step that touches the
# disk and SIGKILLs itself just before step number KILL_AT; NO_SWAP makes the system look unable to swap directories.
WRITER = r"""
import importlib.util, os, shutil, signal, sys
spec = importlib.util.spec_from_file_location("atomic", sys.argv[1])
atomic = importlib.util.module_from_spec(spec)
spec.loader.exec_module(atomic)
path, content, kill_at, no_swap = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "1"
steps = 0

def step(f):
    def wrapped(*a, **k):
        global steps
        steps += 1
        if steps == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return f(*a, **k)
    return wrapped

os.rename, os.replace, os.fsync, shutil.rmtree = map(step, (os.rename, os.replace, os.fsync, shutil.rmtree))
atomic.exchange = step((lambda a, b: False) if no_swap else atomic.exchange)
with atomic.atomic_dir(path) as tmp:
    for name in ("config.json", "model.safetensors"):
        (tmp / name).write_text(f"{content} {name}")
    (tmp / "sub").mkdir()
    (tmp / "sub" / "x").write_text(content)
print(steps)
"""


def contents(path: Path) -> dict[str, str] | None:
    if not path.exists():
        return None
    return {str(p.relative_to(path)): p.read_text() for p in sorted(path.rglob("*")) if p.is_file()}


def expected(content: str) -> dict[str, str]:
    return {"config.json": f"{content} config.json", "model.safetensors": f"{content} model.safetensors",
            "sub/x": content}


def write(path: Path, content: str, kill_at: int = 0, no_swap: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WRITER, str(ATOMIC), str(path), content, str(kill_at),
                           "1" if no_swap else "0"], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("no_swap", [False, True], ids=["swap", "two-renames"])
@pytest.mark.parametrize("replace", [False, True], ids=["new", "replace"])
def test_a_writer_killed_at_any_step_leaves_the_old_or_the_new_directory(tmp_path, replace, no_swap):
    path = tmp_path / "best"
    seen = set()
    for kill_at in range(1, 200):
        if replace:
            assert write(path, "old").returncode == 0
        r = write(path, "new", kill_at, no_swap)
        if r.returncode == 0:  # it ran out of steps before step kill_at: every step has been a kill point
            assert int(r.stdout) == kill_at - 1 and contents(path) == expected("new")
            break
        assert r.returncode == -signal.SIGKILL, r.stderr
        old = expected("old") if replace else None
        state = contents(path)
        if no_swap and replace and state is None:  # killed between the two renames: the old copy is aside
            atomic.recover(path)  # what the next writer does first
            state = contents(path)
            seen.add("aside")
        assert state in (old, expected("new")), (kill_at, state)
        seen.add("new" if state == expected("new") else "old")
        with atomic.atomic_dir(path) as tmp:
            (tmp / "f").write_text("next")
        assert contents(path) == {"f": "next"} and os.listdir(tmp_path) == ["best"], os.listdir(tmp_path)
        atomic.shutil.rmtree(path)
    else:
        pytest.fail("the writer never finished")
    assert seen == {"old", "new"} | ({"aside"} if no_swap and replace else set()) and kill_at > 5


def test_a_failed_switch_keeps_the_old_directory_in_place(tmp_path, monkeypatch):
    """Without a swap, the old copy is renamed aside; when the new one cannot take its place, it goes back."""
    path = tmp_path / "best"
    with atomic.atomic_dir(path) as tmp:
        (tmp / "f").write_text("old")
    real_rename = os.rename

    def rename(a, b):
        if Path(b) == path and not Path(a).name.endswith(".old"):
            raise OSError("rename failed")
        return real_rename(a, b)

    monkeypatch.setattr(atomic, "exchange", lambda a, b: False)
    monkeypatch.setattr(atomic.os, "rename", rename)
    with pytest.raises(OSError, match="rename failed"):
        with atomic.atomic_dir(path) as tmp:
            (tmp / "f").write_text("new")
    assert contents(path) == {"f": "old"} and os.listdir(tmp_path) == ["best"]


def test_swap_exchanges_two_directories(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("a")
    (b / "y").write_text("b")
    if not atomic.exchange(a, b):
        pytest.skip("this file system cannot swap directories")
    assert contents(a) == {"y": "b"} and contents(b) == {"x": "a"}
    with pytest.raises(FileNotFoundError):
        atomic.exchange(a, tmp_path / "missing")
