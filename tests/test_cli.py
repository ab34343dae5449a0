"""The command line: flags (no abbreviations, -v anywhere, help for every option), refusals that print only
the error, --chat-template, train's --tokenizer hint, and --stats telling compiled graphs from cached ones."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from staticformers.commands.cli import _available_commands, build_parser, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import inference

    return inference.build_checkpoint(str(tmp_path_factory.mktemp("cli")))


@pytest.fixture(scope="module")
def no_template(checkpoint, tmp_path_factory):
    """The same model with no chat template in its tokenizer files."""
    folder = tmp_path_factory.mktemp("no_template") / "model"
    shutil.copytree(checkpoint, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.fixture(autouse=True)
def eager_backend(monkeypatch):
    monkeypatch.setenv("STATICFORMERS_COMPILE_BACKEND", "eager")


def test_verbose_before_or_after_the_subcommand():
    parser = build_parser(_available_commands())
    assert parser.parse_args(["-v", "doctor"]).verbose is True
    assert parser.parse_args(["doctor", "-v"]).verbose is True
    assert parser.parse_args(["doctor", "--verbose", "--json"]).verbose is True
    assert parser.parse_args(["doctor"]).verbose is False


def test_abbreviated_flags_are_refused_naming_the_subcommand_s_close_flags(checkpoint, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", checkpoint, "hi", "--max-new-token", "3"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("usage: staticformers generate ")  # the subcommand's usage
    assert err.strip().endswith(
        "staticformers generate: error: unrecognized arguments: --max-new-token 3; --max-new-token: "
        "did you mean --max-new-tokens (a flag of 'staticformers generate')?"
    )
    with pytest.raises(SystemExit):
        main(["train", checkpoint, "--data", "x.txt", "--lerning-rate=1e-3"])
    assert "--lerning-rate: did you mean --learning-rate (a flag of 'staticformers train')?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--verb", "doctor"])
    assert "--verb: did you mean --verbose (a flag of 'staticformers doctor')?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["doctor", "--nothing-like-it"])
    assert (
        "--nothing-like-it is not a flag of 'staticformers doctor': see staticformers doctor --help"
        in capsys.readouterr().err
    )


def test_version_prints_staticformers_version(capsys):
    import re

    import staticformers

    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        (declared,) = re.findall(r'^version = "([^"]+)"$', f.read(), re.M)
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"staticformers {declared}\n"
    assert staticformers.__version__ == declared


def test_doctor_prints_its_version_and_what_to_install_for_neuron(capsys, monkeypatch):
    import staticformers
    from staticformers.backends import devices

    monkeypatch.setattr(devices, "_neuron_version", lambda: None)  # a host without torch-neuronx
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"staticformers {staticformers.__version__}  python ")
    assert "torch-neuronx not installed" in out
    lines = out.strip().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("torch-neuronx is not installed"))
    assert all(len(line) <= 100 for line in lines[start:])  # wrapped, never one 600-character line
    hint = " ".join(line.strip() for line in lines[start:])
    assert hint.startswith("torch-neuronx is not installed: the neuron device is TorchNeuron's (Trn2/Trn3")
    assert (
        "pip install 'torch-neuronx==2.13.*'" in hint
        and "--extra-index-url https://pip.repos.neuron.amazonaws.com" in hint
    )
    assert "make demo VENV=" in hint and "SKIP_TORCH=1" in hint and "Inf2/Trn1" in hint
    assert main(["doctor", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["staticformers"] == staticformers.__version__ and info["neuron_hint"] == hint


def test_doctor_on_a_cpu_only_host_answers_without_importing_torch_and_as_torch_would():
    """Where no accelerator can be here, doctor skips `import torch` (nearly all of its time), and its report
    is the one the devices' probes give."""
    import importlib.util

    from staticformers.backends.devices import describe
    from staticformers.commands import doctor

    full = describe()
    if any(d["available"] for name, d in full["devices"].items() if name != "cpu"):
        pytest.skip("this machine has an accelerator: doctor probes it through torch")
    assert doctor.cpu_only_report() == full
    code = (
        "import sys; from staticformers.commands import doctor; from staticformers.commands.cli import main; "
        "skip = doctor.may_skip_torch(); main(['doctor', '--json']); print(skip, 'torch' in sys.modules)"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src")),
    )
    assert res.returncode == 0, res.stderr
    report, verdict = res.stdout.rstrip("\n").rsplit("\n", 1)
    assert json.loads(report)["devices"] == full["devices"]
    plain = (
        sys.platform.startswith("linux")
        and not any(os.path.exists(n) for n in doctor.ACCELERATOR_NODES)
        and not any(importlib.util.find_spec(m) for m in ("torch_neuronx", "torch_xla"))
    )
    if plain:  # nothing could be here but the CPU: torch is never imported
        assert verdict == "True False", verdict
    else:
        assert verdict.endswith("True"), verdict


def test_doctor_on_a_neuron_host_has_no_install_hint(fake_neuron, capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "torch-neuronx 0.0-standin" in out and "pip install" not in out
    fake_neuron.available = False  # installed, but no NeuronCore (or an XLA-based release)
    assert main(["doctor"]) == 0
    assert (
        "torch-neuronx 0.0-standin is installed but gives no available torch.neuron device" in capsys.readouterr().out
    )


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a CUDA GPU")
@pytest.mark.parametrize("command", ["generate", "compile", "serve"])
def test_device_cuda_without_a_gpu_is_refused_in_the_command_line_s_words(checkpoint, command, capsys):
    import torch

    argv = [command, checkpoint] + (["hi"] if command == "generate" else []) + ["--device", "cuda"]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == (
        f"staticformers {command}: --device cuda: this PyTorch ({torch.__version__}) sees no CUDA GPU here: leave "
        f"--device out (auto picks cpu here), or run on a machine with an NVIDIA GPU and a CUDA build of PyTorch."
    )
    assert "device_map" not in err
    assert main(["generate", checkpoint, "hi", "--device", "cpu:3"]) == 2
    assert "--device cpu:3: this machine has 1 cpu device(s): pass --device cpu." in capsys.readouterr().err
    assert main(["generate", checkpoint, "hi", "--device", "gpu"]) == 2
    assert "--device 'gpu' is not a device: pass auto, neuron, xla, cuda" in capsys.readouterr().err


def test_train_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for shown in (
        "(default: 8)",
        "(default: linear)",
        "(default: 1.0)",
        "(default: 3.0)",
        "(default: outputs)",
        "(default: 42)",
        "(default: 0.0)",
    ):
        assert shown in out, shown
    assert "(default: None)" not in out and "(default: False)" not in out


def test_every_option_has_help():
    parser = build_parser(_available_commands())
    sub = next(a for a in parser._actions if a.choices and "doctor" in a.choices)
    missing = [
        f"{name} {'/'.join(a.option_strings) or a.dest}"
        for name, p in sub.choices.items()
        for a in p._actions
        if not a.help
    ]
    assert missing == []


def test_an_unknown_backend_prints_only_the_error(checkpoint, capsys):
    assert main(["generate", checkpoint, "The French", "--backend", "foo"]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # the prompt is not echoed before the refusal
    assert err.strip() == (
        "staticformers generate: --backend 'foo' is not a torch.compile backend here: use inductor, "
        "aot_eager, eager, cudagraphs (or leave it out for the device's own)."
    )
    assert main(["compile", checkpoint, "--backend", "foo", "--dry-run"]) == 2
    assert "--backend 'foo'" in capsys.readouterr().err


def test_an_error_during_generation_prints_no_prompt_first(checkpoint, capsys):
    assert main(["generate", checkpoint, "The French", "--device", "cpu", "--max-model-len", "4096"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "max_model_len=4096" in err


def test_the_prompt_streams_before_the_continuation(checkpoint, capsys):
    assert main(["generate", checkpoint, "The French", "--device", "cpu", "--max-new-tokens", "3", "--stats"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("The French") and "3 new tokens" in err
    # the first call's shapes are announced before they compile, each with an estimate of the rest
    assert "compiling 2 shapes (" in err and "compiling shape 1/2\n" in err, err
    assert re.search(r"compiling shape 2/2 \(about \d+(\.\d+)? (us|ms|s) left: ", err), err
    # a short generation's time in milliseconds, not "0.01 s"
    summary = next(line for line in err.splitlines() if "new tokens" in line)
    assert re.match(r"3 new tokens in \d+(\.\d+)? (us|ms|s) on cpu; ", summary), summary
    assert re.search(r"\(first call \d+(\.\d+)? (us|ms|s)\) calls \d+", err), err


def test_durations_read_in_milliseconds_below_a_second():
    from staticformers.utils.durations import duration

    assert [duration(s) for s in (0.0004, 0.0012, 0.0123, 0.123, 0.9999, 1.234, 12.34, 123.4)] == [
        "400 us",
        "1.20 ms",
        "12.3 ms",
        "123 ms",
        "1000 ms",
        "1.23 s",
        "12.3 s",
        "123 s",
    ]
    with pytest.raises(ValueError, match="non-negative number of seconds"):
        duration(float("nan"))


def test_chat_without_a_template_names_the_flag(no_template, tmp_path, capsys):
    assert main(["generate", no_template, "hello", "--chat", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "has no chat template: pass --chat-template FILE" in err and "tok.chat_template" not in err
    template = tmp_path / "chat.jinja"
    template.write_text(
        "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    assert (
        main(
            [
                "generate",
                no_template,
                "hello",
                "--chat",
                "--chat-template",
                str(template),
                "--max-new-tokens",
                "2",
                "--stats",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert "new tokens" in err and "<|im_start|>" not in out  # the reply alone: the templated prompt is not echoed
    assert main(["generate", no_template, "hello", "--chat", "--chat-template", str(tmp_path / "none.jinja")]) == 2
    assert f"--chat-template {tmp_path / 'none.jinja'} is not a file" in capsys.readouterr().err
    assert main(["generate", no_template, "hello", "--chat-template", str(template)]) == 2
    assert "add --chat" in capsys.readouterr().err


def test_train_text_without_a_tokenizer_names_the_flag(checkpoint, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(checkpoint, model)
    os.remove(model / "tokenizer.json")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The French Bread Law states.\n\nStatic shapes avoid recompilation.\n")
    assert (
        main(["train", str(model), "--data", str(corpus), "--output-dir", str(tmp_path / "out"), "--max-steps", "1"])
        == 2
    )
    err = capsys.readouterr().err
    assert "holds text but" in err and "pass --tokenizer FOLDER" in err and "processing_class" not in err
    assert (
        main(
            [
                "train",
                str(model),
                "--data",
                str(corpus),
                "--output-dir",
                str(tmp_path / "out"),
                "--max-steps",
                "1",
                "--max-length",
                "16",
                "--batch-size",
                "1",
                "--no-save",
                "--quiet",
                "--tokenizer",
                checkpoint,
            ]
        )
        == 0
    )


@pytest.mark.inductor
def test_stats_say_which_graphs_came_from_the_cache(checkpoint, tmp_path, monkeypatch):
    """The first process compiles; a second one with the same cache loads them all (and says so)."""
    monkeypatch.delenv("STATICFORMERS_COMPILE_BACKEND")
    env = dict(
        os.environ, STATICFORMERS_CACHE=str(tmp_path / "cache"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor")
    )
    cmd = [
        sys.executable,
        "-m",
        "staticformers.commands.cli",
        "generate",
        checkpoint,
        "The French",
        "--device",
        "cpu",
        "--max-new-tokens",
        "3",
        "--stats",
    ]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    second = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    summary = [next(line for line in r.stderr.splitlines() if "new tokens" in line) for r in (first, second)]
    assert "compiled" in summary[0] and "loaded from the on-disk cache" not in summary[0], summary
    assert "loaded from the on-disk cache" in summary[1] and "compiled" not in summary[1], summary
