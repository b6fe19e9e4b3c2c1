"""File helpers every stage shares: atomic writes, checksums, the lock that keeps one writer per run
directory, and the error a full disk becomes."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import time
from pathlib import Path


def fsync_path(path: str | Path) -> None:
    """Flush a file's (or a directory's entries') data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | Path, data: bytes | str) -> None:
    """Write to `path.tmp`, flush to disk, rename over `path`, flush the directory: a reader sees the old file
    or the whole new one, never a part. A link at `path` is replaced, never written through."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def write_json(path: str | Path, obj) -> None:
    write_atomic(path, json.dumps(obj, indent=2) + "\n")


def replace_dir(tmp: Path, final: Path) -> None:
    """Rename the complete directory `tmp` to `final`; an existing `final` is moved aside first and removed
    only once the new one is in place."""
    if final.exists():
        old = final.with_name(f"{final.name}.old")
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)


def sha256_file(path: str | Path, chunk: int = 1 << 24) -> str:
    """The sha256 of a file's bytes, read in chunks (any size)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# -- one writer per run directory -------------------------------------------------------------------------
LOCK = ".lock"


class RunInUse(OSError):
    """Another process holds the run directory's lock."""


@contextlib.contextmanager
def run_lock(run_dir: str | Path, stage: str, say=print):
    """Hold `run_dir/.lock` (an exclusive `flock`) while a stage writes into `run_dir`. A second process gets
    RunInUse naming the holder (stage, pid, host, since when). The kernel drops the lock when its holder dies,
    so a lock file left by a killed process is recognised (it names a holder but nobody holds it) and taken
    over. On network file systems this relies on their `flock` support (NFS emulates it with POSIX locks)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            raise RunInUse(f"{run_dir} is in use by {holder}: one process writes a run_dir at a time. Wait for "
                           f"it to end, or use another run_dir (the lock is {path})") from None
        left = _read(fd)
        if left:
            say(f"mtp-train: {path} was left by {_describe(left)}, which no longer holds it (it was killed); "
                "taking it over")
        me = {"stage": stage, "pid": os.getpid(), "host": socket.gethostname(),
              "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # a clean exit leaves an empty file: a non-empty one means its holder died
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _read(fd: int) -> dict | None:
    raw = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return {"stage": "?", "pid": "?", "host": "?", "since": f"? (unreadable: {raw[:40]!r})"}


def _describe(h: dict) -> str:
    return f"`mtp-train {h.get('stage')}` (pid {h.get('pid')} on host {h.get('host')}, since {h.get('since')})"


def _holder(fd: int) -> str:
    h = _read(fd)
    return _describe(h) if h else "another process (it has not written its name yet)"


# -- a full disk ------------------------------------------------------------------------------------------
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class DiskFull(OSError):
    """A write ran out of space (or quota): the message names the file, the bytes it needed and what is kept."""


def _free_bytes(path: Path) -> int | None:
    for p in (path, *path.parents):
        if p.exists():
            return shutil.disk_usage(p).free
    return None


def _no_space(e: Exception, path: Path, needed: int) -> int | None:
    """The errno when `e` is a write that ran out of space, else None. Writers wrap it: safetensors' Rust
    writer says "os error 28", torch.save only "file write failed" (then the free space decides)."""
    if isinstance(e, DiskFull):
        return None
    if isinstance(e, OSError):
        return e.errno if e.errno in NO_SPACE else None
    text = str(e)
    for code in NO_SPACE:
        if f"os error {code}" in text or os.strerror(code) in text:
            return code
    if "write failed" in text:
        free = _free_bytes(path)
        if free is not None and free < needed:
            return errno.ENOSPC
    return None


@contextlib.contextmanager
def space_for(path: str | Path, needed: int, what: str, kept: str, partial: list[Path] = ()):
    """Writing `needed` bytes of `what` at `path`: an ENOSPC / EDQUOT inside becomes DiskFull naming them, after
    the `partial` files or directories (the write's temporary names) are removed; `kept` says what survives."""
    path = Path(path)
    try:
        yield
    except Exception as e:
        code = _no_space(e, path, needed)
        if code is None:
            raise
        for p in partial:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            elif p.exists():
                p.unlink()
        raise _disk_full(code, path, needed, what, kept) from None


def _disk_full(code: int, path: Path, needed: int, what: str, kept: str) -> DiskFull:
    free = _free_bytes(path)
    quota = " (disk quota exceeded)" if code == errno.EDQUOT else ""
    return DiskFull(code, f"no space left{quota} writing {what} {path}: it needs about {needed:,} bytes, "
                          f"{'?' if free is None else f'{free:,}'} are free there. Nothing partial was left; "
                          f"{kept}. Free space and run the same command again: it goes on from there")


def check_space(path: str | Path, needed: int, what: str, kept: str) -> None:
    """DiskFull, before anything is written, when the file system holding `path` has less than `needed` bytes
    free (a quota is not seen here: the write itself reports that)."""
    path = Path(path)
    free = _free_bytes(path)
    if free is not None and free < needed:
        raise _disk_full(errno.ENOSPC, path, needed, what, kept)


DATA_ENV = "MTP_TRAIN_DATA"


def data_cache_dir() -> Path:
    """`$MTP_TRAIN_DATA` if set, else `~/.cache/mtp_train/data` (beside the fetched models and prompts): fetched
    datasets and the regeneration journals kept across run directories."""
    env = os.environ.get(DATA_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mtp_train" / "data"
