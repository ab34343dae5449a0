"""The CPU kernels' thread count: chosen from the CPUs a process may use (affinity, a cgroup's quota, fake
files here), overridable (`--threads`, `STATICFORMERS_NUM_THREADS`, `OMP_NUM_THREADS`), applied by the CPU
backend, OpenMP's short spin set by the command line before torch loads, and `doctor` saying all of it."""

import json
import os
import subprocess
import sys

import pytest
import torch

from staticformers.backends.cpu.threads import apply_thread_choice
from staticformers.commands.cli import main
from staticformers.utils.cpus import (
    THREADS_ENV,
    ThreadChoice,
    cgroup_dirs,
    cgroup_quota,
    choose_threads,
    parse_cfs,
    parse_cpu_max,
    prefer_bounded_spin,
    usable_cpus,
    wait_policy,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "text, cpus, usable",
    [
        ("max 100000", None, 4),
        ("max", None, 4),
        ("150000 100000", 1.5, 1),
        ("200000 100000", 2.0, 2),
        ("50000 100000", 0.5, 1),  # less than a CPU: still one thread
        ("300000", 3.0, 3),  # no period: the kernel's default
        ("", None, 4),
        ("lots 100000", None, 4),
        ("-5 100000", None, 4),
        ("100000 0", None, 4),
    ],
)
def test_cpu_max_quota_caps_the_usable_cpus(text, cpus, usable):
    assert parse_cpu_max(text) == cpus
    assert usable_cpus(4, parse_cpu_max(text), 8) == usable


@pytest.mark.parametrize(
    "quota, period, cpus",
    [
        ("-1", "100000", None),
        ("150000", "100000", 1.5),
        ("200000\n", "100000\n", 2.0),
        ("x", "100000", None),
        (None, "100000", None),
        ("100000", "", None),
    ],
)
def test_cgroup_v1_cfs_quota(quota, period, cpus):
    assert parse_cfs(quota, period) == cpus


def test_affinity_smaller_than_the_machine_wins():
    assert usable_cpus(affinity=3, quota=None, cpu_count=64) == 3
    assert usable_cpus(affinity=8, quota=2.5, cpu_count=64) == 2
    assert usable_cpus(affinity=None, quota=None, cpu_count=6) == 6
    assert usable_cpus(affinity=None, quota=None, cpu_count=None) == 1


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_v2_quota_is_the_tightest_of_the_cgroup_and_its_parents(tmp_path):
    _write(tmp_path / "a" / "b" / "cpu.max", "max 100000\n")
    _write(tmp_path / "a" / "cpu.max", "150000 100000\n")
    _write(tmp_path / "cpu.max", "400000 100000\n")
    assert cgroup_quota(str(tmp_path), "0::/a/b\n") == 1.5
    assert cgroup_quota(str(tmp_path), "0::/\n") == 4.0  # a container's own cgroup at the mount
    assert [d for _, d in cgroup_dirs("0::/a/b\n", str(tmp_path))] == [
        str(tmp_path / "a" / "b"),
        str(tmp_path / "a"),
        str(tmp_path),
    ]


def test_v1_quota_from_the_cpu_controller_s_mount(tmp_path):
    _write(tmp_path / "cpu,cpuacct" / "cpu.cfs_quota_us", "200000\n")
    _write(tmp_path / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    text = "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n"
    assert cgroup_quota(str(tmp_path), text) == 2.0  # the container sees its cgroup at the mount itself
    _write(tmp_path / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1\n")
    assert cgroup_quota(str(tmp_path), text) is None


def test_missing_or_bad_cgroup_files_are_ignored(tmp_path):
    assert cgroup_quota(str(tmp_path), "0::/a\n") is None  # no files at all
    _write(tmp_path / "a" / "cpu.max", "not a quota at all")
    (tmp_path / "cpu.max").mkdir()  # reading it fails (a folder)
    assert cgroup_quota(str(tmp_path), "0::/a\n") is None
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "cpu.max").write_bytes(b"\xff\xfe\x00garbage")
    assert cgroup_quota(str(tmp_path), "0::/b\n") is None
    assert cgroup_quota(str(tmp_path), "garbage without colons\n\n") is None
    assert cgroup_quota(str(tmp_path), "") is None


def test_this_process_reads_its_own_cpus_without_failing():
    choice = choose_threads(environ={})
    assert choice.source == "usable CPUs" and choice.threads == choice.usable >= 1
    assert choice.usable <= (os.cpu_count() or 1)


def test_an_explicit_count_wins_in_order():
    facts = dict(affinity=2, quota=None, cpu_count=2)
    assert choose_threads(None, {}, **facts).threads == 2
    omp = choose_threads(None, {"OMP_NUM_THREADS": "3,1"}, **facts)
    assert (omp.threads, omp.source) == (3, "OMP_NUM_THREADS")
    env = choose_threads(None, {"OMP_NUM_THREADS": "3", THREADS_ENV: "5"}, **facts)
    assert (env.threads, env.source) == (5, THREADS_ENV)
    flag = choose_threads(1, {"OMP_NUM_THREADS": "3", THREADS_ENV: "5"}, **facts)
    assert (flag.threads, flag.source) == (1, "--threads")
    assert choose_threads(None, {"OMP_NUM_THREADS": "lots"}, **facts).source == "usable CPUs"


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_a_bad_thread_count_in_the_environment_is_one_sentence(value):
    with pytest.raises(ValueError, match=rf"^{THREADS_ENV}='{value}' is not a thread count: give a whole number"):
        choose_threads(None, {THREADS_ENV: value}, affinity=2, quota=None, cpu_count=2)


def test_the_reason_names_affinity_quota_and_source():
    choice = choose_threads(None, {}, affinity=3, quota=2.5, cpu_count=16)
    assert choice.threads == 2
    assert choice.reason() == "2 thread(s): 2 CPU(s) usable: affinity 3 of 16, CPU quota 2.5"
    explicit = choose_threads(None, {THREADS_ENV: "4"}, affinity=3, quota=None, cpu_count=16)
    assert explicit.reason() == f"4 thread(s) from {THREADS_ENV} (3 CPU(s) usable: affinity 3 of 16, no CPU quota)"


@pytest.fixture
def torch_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _choice(threads, source):
    return ThreadChoice(threads, source, usable=threads, affinity=threads, quota=None, cpu_count=threads)


def test_the_backend_lowers_torch_s_count_to_the_usable_cpus_and_never_raises_it(torch_threads):
    torch.set_num_threads(3)
    apply_thread_choice(_choice(1, "usable CPUs"))
    assert torch.get_num_threads() == 1
    apply_thread_choice(_choice(2, "usable CPUs"))  # a caller's lower count stays
    assert torch.get_num_threads() == 1
    apply_thread_choice(_choice(3, THREADS_ENV))  # an explicit count applies as given
    assert torch.get_num_threads() == 3
    torch.set_num_threads(2)
    apply_thread_choice(_choice(1, "OMP_NUM_THREADS"))  # torch applied it at start; a later set_num_threads stays
    assert torch.get_num_threads() == 2


def test_bounded_spin_only_before_torch_and_only_unset():
    env = {}
    assert prefer_bounded_spin(env, modules={}) is True and env == {"GOMP_SPINCOUNT": "2000"}
    assert wait_policy(env) == "GOMP_SPINCOUNT=2000"
    env = {}
    assert prefer_bounded_spin(env, modules={"torch": object()}) is False and env == {}
    assert wait_policy(env).startswith("OpenMP's default: idle workers spin 300,000 times")
    for chosen in ({"GOMP_SPINCOUNT": "10000"}, {"OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_WAIT_POLICY": "active"}):
        env = dict(chosen)
        assert prefer_bounded_spin(env, modules={}) is False and env == chosen  # the user's choice stays


def test_doctor_says_the_threads_and_why(capsys, monkeypatch):
    monkeypatch.setenv(THREADS_ENV, "1")
    assert main(["doctor"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("CPU threads: "))
    assert line.startswith(f"CPU threads: 1 thread(s) from {THREADS_ENV} (") and "CPU(s) usable: affinity" in line
    assert "OpenMP wait: " in line
    monkeypatch.delenv(THREADS_ENV)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert main(["doctor", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)["cpu_threads"]
    assert info["source"] == "usable CPUs" and info["threads"] == info["usable"] >= 1
    assert set(info) >= {"affinity", "quota", "cpu_count", "reason", "wait"}


@pytest.mark.parametrize("command", ["generate", "serve", "train", "compile"])
def test_commands_that_run_a_model_take_threads_and_refuse_a_bad_count(command, capsys):
    from staticformers.commands.cli import _available_commands, build_parser

    parser = build_parser(_available_commands())
    sub = next(a for a in parser._actions if a.choices and command in a.choices).choices[command]
    assert any("--threads" in a.option_strings for a in sub._actions)
    with pytest.raises(SystemExit):
        main([command, "x", "--threads", "0"] + (["--data", "d"] if command == "train" else []))
    assert "argument --threads: '0' is not a thread count: give a whole number of at least 1" in capsys.readouterr().err


CHILD = r"""
import os, sys
from staticformers.commands.cli import main
code = main(["generate", sys.argv[1], "The", "--device", "cpu", "--no-compile", "--max-new-tokens", "1"] + sys.argv[2:])
import torch
print("RESULT", code, torch.get_num_threads(), os.environ.get("GOMP_SPINCOUNT"))
"""


def test_threads_applied_and_bounded_spin_read_by_the_openmp_runtime(tmp_path):
    """A fresh process: `generate --threads 3` runs at 3 threads (more than the usable CPUs: explicit), the command
    line set GOMP_SPINCOUNT=2000 before torch loaded, and libgomp reports reading it (OMP_DISPLAY_ENV, verbose)."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import inference

    checkpoint = inference.build_checkpoint(str(tmp_path / "model"))
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OMP_NUM_THREADS", THREADS_ENV, "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    }
    env.update(PYTHONPATH=os.path.join(ROOT, "src"), OMP_DISPLAY_ENV="VERBOSE", STATICFORMERS_CACHE=str(tmp_path / "c"))
    out = subprocess.run(
        [sys.executable, "-c", CHILD, checkpoint, "--threads", "3"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    result = next((line for line in out.stdout.splitlines() if line.startswith("RESULT")), None)
    assert result == "RESULT 0 3 2000", out.stdout[-2000:] + out.stderr[-2000:]
    assert "GOMP_SPINCOUNT = '2000'" in out.stderr, out.stderr[-2000:]


def test_several_spinning_threads_warn_once_naming_what_to_set(monkeypatch, caplog):
    from staticformers.backends.cpu import threads

    monkeypatch.setattr(threads, "_HINTED", False)
    assert threads.spin_hint(1, {}) is False  # one thread: nothing waits
    assert threads.spin_hint(2, {"OMP_WAIT_POLICY": "ACTIVE"}) is False  # the user chose
    assert threads.spin_hint(2, {}) is True
    assert threads.spin_hint(2, {}) is False  # once per process
    assert (
        "Set GOMP_SPINCOUNT=2000 (or OMP_WAIT_POLICY=PASSIVE) in the environment before torch is imported"
        in caplog.text
    )
