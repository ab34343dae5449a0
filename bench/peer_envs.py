"""The virtual environments of bench/peers.py's peers: each installed on demand, outside the clone, once.

A peer that pins what the main venv must not have (optimum-intel 2.2 needs transformers<5.6; llama-cpp-python is
a C++ build) runs in a venv of its own, in `${XDG_CACHE_HOME:-~/.cache}/staticformers/venv-<peer>-<hash>`, the
hash of what it installs (its requirements, pip options, build variables and the Python's version), so a fresh
clone on the same machine reuses it and a changed pin makes a new one. Nothing here runs from `make test`: the
venv is installed by `python bench/peers.py --install-only` or by a run of bench/peers.py that needs it (unless
`--no-install`, which refuses in one sentence naming the command instead).

- `llama-cpp`: llama-cpp-python built from source by pip (its sdist; PyPI has no Linux wheel), llava off (not
  needed, a third of the build), `GGML_NATIVE` on: llama.cpp compiled for this CPU, as its users build it.
- `openvino`: the project's `openvino` extra's pins (optimum-intel 2.2.0, openvino 2026.4.1) with the main venv's
  torch (the CPU wheel where that is what the main venv has), and torchvision removed after the install (it fails
  to load against this torch and breaks transformers.AutoProcessor, which optimum-intel imports: BENCHMARKS.md).

The venv is complete once its `.installed` marker exists (written last, with what was installed and how long it
took), so an install killed half-way is redone, not used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class PeerEnv:
    name: str  # as `--install-only` spells it
    what: str  # one line, for messages
    requirements: tuple[str, ...]
    module: str  # imported to check the install
    pip_options: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()  # build variables (part of the hash)
    remove_after: tuple[str, ...] = ()  # distributions uninstalled after the install


def _main_torch() -> str:
    """The main venv's torch version (its local label included: `2.13.0+cpu` installs the CPU wheel)."""
    try:
        return version("torch")
    except PackageNotFoundError:
        return "2.13.0"


LLAMA_CPP_VERSION = "0.3.36"
OPTIMUM_INTEL_VERSION, OPENVINO_VERSION = "2.2.0", "2026.4.1"


def peers() -> dict[str, PeerEnv]:
    return {
        "llama-cpp": PeerEnv(
            name="llama-cpp",
            what=f"llama.cpp through llama-cpp-python {LLAMA_CPP_VERSION}",
            requirements=(f"llama-cpp-python=={LLAMA_CPP_VERSION}", "numpy"),
            module="llama_cpp",
            pip_options=("--no-binary", "llama-cpp-python", "--no-cache-dir"),
            env=(("CMAKE_ARGS", "-DLLAVA_BUILD=OFF -DGGML_NATIVE=ON"), ("CMAKE_BUILD_PARALLEL_LEVEL", "2")),
        ),
        "openvino": PeerEnv(
            name="openvino",
            what=f"OpenVINO {OPENVINO_VERSION} through optimum-intel {OPTIMUM_INTEL_VERSION}",
            requirements=(
                f"optimum-intel[openvino]=={OPTIMUM_INTEL_VERSION}",
                f"openvino=={OPENVINO_VERSION}",
                f"torch=={_main_torch()}",
                "psutil",
            ),
            module="optimum.intel",
            remove_after=("torchvision",),
        ),
    }


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "staticformers"


def spec_hash(peer: PeerEnv) -> str:
    text = json.dumps(
        {
            "requirements": peer.requirements,
            "pip": peer.pip_options,
            "env": peer.env,
            "remove": peer.remove_after,
            "python": platform.python_version(),
        },
        sort_keys=True,
    )
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def venv_dir(peer: PeerEnv) -> Path:
    return cache_root() / f"venv-{peer.name}-{spec_hash(peer)}"


def python_of(peer: PeerEnv) -> Path:
    return venv_dir(peer) / "bin" / "python"


def marker(peer: PeerEnv) -> Path:
    return venv_dir(peer) / ".installed"


def installed(peer: PeerEnv) -> dict | None:
    """What the marker records (requirements, versions, install seconds) once the venv is complete, else None."""
    try:
        with open(marker(peer)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def install_command(peer: PeerEnv) -> str:
    return f"python bench/peers.py --install-only {peer.name}"


def missing_sentence(peer: PeerEnv) -> str:
    """The `--no-install` refusal: one sentence naming the peer, where it would go, and the command."""
    return (
        f"--no-install: the {peer.name} peer ({peer.what}) is not installed in {venv_dir(peer)}; "
        f"install it with `{install_command(peer)}` (it takes minutes and needs PyPI) or drop --no-install."
    )


def install(peer: PeerEnv, log=sys.stderr, nice: int = 19) -> dict:
    """Create the peer's venv and install it (under `nice`, so a shared machine's other work suffers less); the
    marker's record. Raises SystemExit with pip's last lines when the install fails."""
    done = installed(peer)
    if done is not None:
        return done
    folder = venv_dir(peer)
    shutil.rmtree(folder, ignore_errors=True)  # a half-made venv from a killed install
    folder.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    print(f"installing the {peer.name} peer into {folder} (nice -n {nice}) ...", file=log, flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
    py = str(python_of(peer))
    env = dict(os.environ, **dict(peer.env))
    prefix = ["nice", "-n", str(nice)] if nice and shutil.which("nice") else []
    steps = [
        [py, "-m", "pip", "install", "-q", "--upgrade", "pip"],
        [*prefix, py, "-m", "pip", "install", *peer.pip_options, *peer.requirements],
    ]
    if peer.remove_after:
        steps.append([py, "-m", "pip", "uninstall", "-y", *peer.remove_after])
    log_path = folder / "install.log"
    for cmd in steps:
        with open(log_path, "a") as out:
            out.write(f"$ {' '.join(cmd)}\n")
            out.flush()
            res = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, check=False)
        if res.returncode != 0:
            tail = log_path.read_text().strip().splitlines()[-15:]
            raise SystemExit(
                f"installing the {peer.name} peer failed ({' '.join(cmd[-3:])} exited {res.returncode}); "
                f"the log is {log_path}:\n" + "\n".join(tail)
            )
    check = subprocess.run([py, "-c", f"import {peer.module}"], capture_output=True, text=True, check=False)
    if check.returncode != 0:
        raise SystemExit(
            f"the {peer.name} peer installed but `import {peer.module}` fails in {folder}: "
            f"{(check.stderr.strip().splitlines() or ['?'])[-1]}"
        )
    freeze = subprocess.run([py, "-m", "pip", "freeze"], capture_output=True, text=True, check=False).stdout.split()
    record = {
        "peer": peer.name,
        "requirements": list(peer.requirements),
        "env": dict(peer.env),
        "install_seconds": round(time.time() - t0, 1),
        "installed_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "freeze": freeze,
    }
    with open(marker(peer), "w") as f:
        json.dump(record, f, indent=1)
    print(f"installed the {peer.name} peer in {record['install_seconds']} s", file=log, flush=True)
    return record


def require(peer: PeerEnv, allow_install: bool, log=sys.stderr) -> Path:
    """The peer venv's python: installed now if it is missing and `allow_install`, else one sentence and exit."""
    if installed(peer) is None:
        if not allow_install:
            raise SystemExit(missing_sentence(peer))
        install(peer, log)
    return python_of(peer)


if __name__ == "__main__":  # python bench/peer_envs.py llama-cpp: install one peer (bench/peers.py --install-only)
    for name in sys.argv[1:]:
        print(json.dumps({k: v for k, v in install(peers()[name]).items() if k != "freeze"}))
