"""Crash-safe writes: a file or directory is complete or absent, and a replaced one is the old or the new one.

A directory is written into a hidden scratch sibling, fsynced (files, then directories), and then put in place by
one rename (a new path) or one atomic swap with the old directory (Linux renameat2 RENAME_EXCHANGE, macOS
renamex_np RENAME_SWAP), after which the old copy is deleted. So at every instant `path` is a whole directory and
readers need nothing special. Where the system cannot swap, the old copy is renamed aside first and put back if the
second rename fails; a writer killed between the two renames leaves it aside, and the next write for that path puts
it back before starting. Scratch left by killed writers is deleted by the next write for the same path.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

RENAME_EXCHANGE = 2  # linux/fs.h
RENAME_SWAP = 2  # macOS <stdio.h>, renamex_np
AT_FDCWD = -100  # Linux
SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276}  # for a C library without the renameat2 wrapper (glibc < 2.28)
NOT_SUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV}


def umask() -> int:
    """The process umask (read without changing it)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_path(path: Path) -> None:
    """Flush a file's or directory's data and metadata to disk."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    except OSError as e:  # some file systems cannot fsync a directory; their renames are as durable as they get
        if e.errno not in (errno.EINVAL, errno.EBADF) or not path.is_dir():
            raise
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under root, then every directory bottom-up, root last."""
    dirs = [root]
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            continue
        if p.is_dir():
            dirs.append(p)
        else:
            fsync_path(p)
    for d in reversed(dirs):
        fsync_path(d)


def write_text(path: str | Path, text: str) -> None:
    """Write text to path via a temporary file in the same directory and an atomic rename."""
    write_bytes(path, text.encode())


def write_bytes(path: str | Path, data: bytes) -> None:
    """Write data to path via a temporary file in the same directory, fsynced, and an atomic rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o666 & ~umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:  # no C library to call (not a POSIX system)
        return None


LIBC = _libc()


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths; False where the system or file system cannot (nothing changed then)."""
    fa, fb = os.fsencode(a), os.fsencode(b)
    if LIBC is None:
        return False
    if sys.platform.startswith("linux") and hasattr(LIBC, "renameat2"):
        rc = LIBC.renameat2(AT_FDCWD, fa, AT_FDCWD, fb, ctypes.c_uint(RENAME_EXCHANGE))
    elif sys.platform.startswith("linux") and platform.machine() in SYS_RENAMEAT2:
        rc = LIBC.syscall(ctypes.c_long(SYS_RENAMEAT2[platform.machine()]), AT_FDCWD, fa, AT_FDCWD, fb,
                          ctypes.c_uint(RENAME_EXCHANGE))
    elif sys.platform == "darwin" and hasattr(LIBC, "renamex_np"):
        rc = LIBC.renamex_np(fa, fb, ctypes.c_uint(RENAME_SWAP))
    else:
        return False
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in NOT_SUPPORTED:
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def scratch_prefix(path: Path) -> str:
    """Scratch directories for `path` are named .NAME.PID.*.tmp (the writer's process id tells stale ones)."""
    return f".{path.name}.{os.getpid()}."


def writer_alive(pid: int) -> bool:
    """Whether process pid (on this machine) still runs."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def recover(path: Path) -> None:
    """Clean up after writers of `path` that were killed: put an old copy left aside back, delete their scratch."""
    prefix = f".{path.name}."
    with os.scandir(path.parent) as entries:  # one listing; a data directory may hold thousands of shards
        mine = sorted(Path(e.path) for e in entries if e.name.startswith(prefix))
    for p in mine:
        pid = p.name[len(prefix):].split(".", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or writer_alive(int(pid)):
            continue
        if p.name.endswith(".old") and not path.exists():
            os.rename(p, path)  # killed between moving the old copy aside and putting the new one in place
            fsync_path(path.parent)
        elif p.name.endswith((".old", ".tmp")):
            shutil.rmtree(p, ignore_errors=True)


def put_in_place(tmp: Path, path: Path) -> None:
    """Make the complete directory tmp appear at path, replacing what is there in one step where possible."""
    if not path.exists() and not path.is_symlink():
        os.rename(tmp, path)
        fsync_path(path.parent)
        return
    if exchange(tmp, path):
        old = tmp  # which now holds the old copy
    else:
        old = tmp.with_name(tmp.name.removesuffix(".tmp") + ".old")
        os.rename(path, old)
        try:
            os.rename(tmp, path)
        except BaseException:
            os.rename(old, path)
            raise
    fsync_path(path.parent)  # the new copy is in place for good before the old one goes
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a scratch directory; on success it becomes `path` (fsynced, replacing any old one in one atomic step
    where the system can), on failure it is removed and `path` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    recover(path)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=scratch_prefix(path), suffix=".tmp"))
    tmp.chmod(0o777 & ~umask())  # mkdtemp makes 0700; a saved checkpoint should be readable like any new dir
    try:
        yield tmp
        mode = 0o666 & ~umask()
        for f in tmp.rglob("*"):  # some writers (safetensors) create files 0600; give them a new file's mode
            if f.is_file():
                f.chmod(mode)
        fsync_tree(tmp)
        put_in_place(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
