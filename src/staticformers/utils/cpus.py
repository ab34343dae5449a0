"""How many CPUs this process may really use, and so how many threads its kernels should run on.

`os.cpu_count()` counts the machine's CPUs, not the ones a process gets: an affinity mask
(`taskset`, a batch scheduler) or a container's CPU quota (cgroup v2 `cpu.max`, v1
`cpu.cfs_quota_us` / `cpu.cfs_period_us`) gives it fewer. A compiled step whose workers wait for each
other at every region's end loses far more to a thread without a core than it gains from one more
thread, so the default is the CPUs usable: the affinity mask's size, capped by the floor of the quota,
at least 1. An explicit count wins: an argument (the command line's `--threads`), then
`STATICFORMERS_NUM_THREADS`, then `OMP_NUM_THREADS` (the OpenMP runtime's own).

The OpenMP runtime's wait policy (`OMP_WAIT_POLICY`, libgomp's `GOMP_SPINCOUNT`) is read once, when the
runtime loads with torch, so only a process that has not imported torch yet can still choose it
(`prefer_bounded_spin`, which the command line calls first thing). The default spins 300,000 times before an
idle worker sleeps: on a quiet machine the fastest, on a busy one the workers take the CPUs the step's own
thread needs and a decode step collapses; passive wait (sleep at once) holds under load but pays a wake-up
at every barrier (2x slower on a quiet machine over a 30-layer model). A short spin (`GOMP_SPINCOUNT=2000`)
stays within a few percent of the default when quiet and holds up better under load; 200 was as slow as passive
quietly on a deep model (BENCHMARKS.md, "Threads on a busy machine").

Everything here is plain Python (no torch), so the command line can decide before torch loads; the
functions that parse take the files' text, so tests give them fake cgroup files.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Union

THREADS_ENV = "STATICFORMERS_NUM_THREADS"
WAIT_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # read by libgomp (torch's OpenMP on Linux) as it loads
BOUNDED_SPINCOUNT = "2000"  # spins before an idle OpenMP worker sleeps, where the user chose no wait policy
CGROUP_ROOT = "/sys/fs/cgroup"


def parse_cpu_max(text: Optional[str]) -> Optional[float]:
    """cgroup v2 `cpu.max` ("QUOTA PERIOD", or "max PERIOD": no limit) -> the CPUs it allows, or None
    (no limit, or text that is not a quota)."""
    parts = (text or "").split()
    if not parts or parts[0] == "max":
        return None
    try:
        quota = int(parts[0])
        period = int(parts[1]) if len(parts) > 1 else 100_000  # the kernel's default period
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def parse_cfs(quota_text: Optional[str], period_text: Optional[str]) -> Optional[float]:
    """cgroup v1 `cpu.cfs_quota_us` (-1: no limit) and `cpu.cfs_period_us` -> the CPUs they allow, or None."""
    try:
        quota, period = int((quota_text or "").strip()), int((period_text or "").strip())
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def cgroup_dirs(proc_self_cgroup: str, root: str = CGROUP_ROOT) -> list[tuple[str, str]]:
    """The folders whose quota applies to this process, from `/proc/self/cgroup`'s text: ("v2" or "v1", folder)
    for its own cgroup and every parent up to the mount, plus the mount itself (inside a container the
    cgroup's path names the host's hierarchy, while the container sees its own cgroup at the mount)."""
    out = []
    for line in proc_self_cgroup.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":
            version, mount = "v2", root
        elif "cpu" in controllers.split(","):
            version = "v1"
            mount = next(
                (
                    os.path.join(root, name)
                    for name in (controllers, "cpu", "cpu,cpuacct")
                    if os.path.isdir(os.path.join(root, name))
                ),
                os.path.join(root, "cpu"),
            )
        else:
            continue
        parts = [p for p in path.strip().split("/") if p and p not in (".", "..")]
        for i in range(len(parts), -1, -1):
            out.append((version, os.path.join(mount, *parts[:i])))
    return out


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read(4096)
    except (OSError, UnicodeDecodeError):
        return None


def cgroup_quota(
    root: str = CGROUP_ROOT, proc_self_cgroup: Optional[str] = None, read: Callable[[str], Optional[str]] = _read
) -> Optional[float]:
    """The tightest CPU quota over this process's cgroup and its parents, in CPUs (1.5 = one and a half), or
    None where none is set or nothing can be read (files missing or malformed are skipped, never fatal)."""
    text = proc_self_cgroup if proc_self_cgroup is not None else read("/proc/self/cgroup")
    quotas = []
    for version, folder in cgroup_dirs(text or "", root):
        if version == "v2":
            quota = parse_cpu_max(read(os.path.join(folder, "cpu.max")))
        else:
            quota = parse_cfs(
                read(os.path.join(folder, "cpu.cfs_quota_us")), read(os.path.join(folder, "cpu.cfs_period_us"))
            )
        if quota is not None:
            quotas.append(quota)
    return min(quotas) if quotas else None


def affinity_size() -> Optional[int]:
    """How many CPUs this process may run on (its affinity mask), or None where the OS cannot say."""
    try:
        return len(os.sched_getaffinity(0)) or None
    except (AttributeError, OSError):  # not Linux
        return None


def usable_cpus(affinity: Optional[int], quota: Optional[float], cpu_count: Optional[int]) -> int:
    """The CPUs a process may keep busy: its affinity mask (else the machine's count), capped by the floor
    of its quota, at least 1."""
    n = affinity or cpu_count or 1
    if quota is not None:
        n = min(n, math.floor(quota))
    return max(1, n)


@dataclass(frozen=True)
class ThreadChoice:
    """The thread count chosen, and what it was chosen from (what `doctor` prints)."""

    threads: int
    source: str  # "--threads", THREADS_ENV, "OMP_NUM_THREADS" or "usable CPUs"
    usable: int
    affinity: Optional[int]
    quota: Optional[float]
    cpu_count: Optional[int]

    @property
    def explicit(self) -> bool:
        return self.source != "usable CPUs"

    def reason(self) -> str:
        """One line: the count and why."""
        quota = "no CPU quota" if self.quota is None else f"CPU quota {self.quota:g}"
        cpus = f"{self.usable} CPU(s) usable: affinity {self.affinity or '?'} of {self.cpu_count or '?'}, {quota}"
        if not self.explicit:
            return f"{self.threads} thread(s): {cpus}"
        return f"{self.threads} thread(s) from {self.source} ({cpus})"


def positive_count(text: Union[str, int], what: str) -> int:
    """A thread count given as text: a whole number of at least 1, or one sentence saying it is not."""
    try:
        value = int(str(text).strip())
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(
            f"{what}={text!r} is not a thread count: give a whole number of at least 1, or unset it "
            f"to use the CPUs this process may use."
        )
    return value


def choose_threads(
    requested: Optional[int] = None,
    environ: Optional[Mapping[str, str]] = None,
    affinity: Optional[int] = -1,
    quota: Optional[float] = -1.0,
    cpu_count: Optional[int] = -1,
) -> ThreadChoice:
    """The thread count: `requested` (the command line's `--threads`), else `STATICFORMERS_NUM_THREADS`, else
    `OMP_NUM_THREADS` (its first level), else the usable CPUs. `affinity`, `quota` and `cpu_count` default to
    this process's (-1: read them); tests pass their own."""
    environ = os.environ if environ is None else environ
    affinity = affinity_size() if affinity == -1 else affinity
    quota = cgroup_quota() if quota == -1.0 else quota
    cpu_count = os.cpu_count() if cpu_count == -1 else cpu_count
    usable = usable_cpus(affinity, quota, cpu_count)
    facts: dict[str, Any] = dict(usable=usable, affinity=affinity, quota=quota, cpu_count=cpu_count)
    if requested is not None:
        return ThreadChoice(positive_count(requested, "--threads"), "--threads", **facts)
    if environ.get(THREADS_ENV, "").strip():
        return ThreadChoice(positive_count(environ[THREADS_ENV], THREADS_ENV), THREADS_ENV, **facts)
    omp = environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if omp.isdigit() and int(omp) > 0:  # torch already runs at this count; anything else torch itself refuses
        return ThreadChoice(int(omp), "OMP_NUM_THREADS", **facts)
    return ThreadChoice(usable, "usable CPUs", **facts)


_SET_HERE: list = []  # the variables `prefer_bounded_spin` set in this process


def wait_policy(environ: Optional[Mapping[str, str]] = None) -> str:
    """How the OpenMP workers wait between parallel regions, as this process's environment sets it."""
    environ = os.environ if environ is None else environ
    set_ = [f"{name}={environ[name]}" for name in WAIT_ENV if environ.get(name, "").strip()]
    if not set_:
        return (
            "OpenMP's default: idle workers spin 300,000 times before sleeping (set GOMP_SPINCOUNT="
            f"{BOUNDED_SPINCOUNT} or OMP_WAIT_POLICY=PASSIVE before torch is imported to make them sleep sooner)"
        )
    here = environ is os.environ and _SET_HERE and all(name in _SET_HERE for name in WAIT_ENV if environ.get(name))
    return ", ".join(set_) + (
        " (set by the command line; a program importing torch itself sets it first)" if here else ""
    )


def prefer_bounded_spin(environ=None, modules: Optional[Mapping] = None) -> bool:
    """Set `GOMP_SPINCOUNT=2000` (idle OpenMP workers spin briefly, then sleep) when the user set no wait policy
    and torch, which loads the OpenMP runtime that reads it, is not imported yet. Returns whether it was set."""
    environ = os.environ if environ is None else environ
    modules = sys.modules if modules is None else modules
    if "torch" in modules or any(environ.get(name, "").strip() for name in WAIT_ENV):
        return False
    environ["GOMP_SPINCOUNT"] = BOUNDED_SPINCOUNT
    if environ is os.environ:
        _SET_HERE.append("GOMP_SPINCOUNT")
    return True


__all__ = [
    "BOUNDED_SPINCOUNT",
    "THREADS_ENV",
    "WAIT_ENV",
    "ThreadChoice",
    "affinity_size",
    "cgroup_dirs",
    "cgroup_quota",
    "choose_threads",
    "parse_cfs",
    "parse_cpu_max",
    "positive_count",
    "prefer_bounded_spin",
    "usable_cpus",
    "wait_policy",
]
