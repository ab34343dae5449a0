"""bench/peers.py (our engine, transformers, OpenVINO and llama.cpp on the real model): the runs it refuses, each in
one sentence, the like-precision pairs, the peers' venvs it would install (never installed here), the GGUFs it
writes for llama.cpp (from a tiny file made here), and how it turns child processes into figures. Nothing is
installed, downloaded or measured: the peers' own runs are recorded in BENCHMARKS.md ("Peers on a real model")."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import llama_cpp_peer  # noqa: E402
import peer_envs  # noqa: E402
import peers  # noqa: E402


@pytest.fixture(autouse=True)
def nothing_heavy(monkeypatch, tmp_path):
    """No test here installs a venv or runs the benchmark: either would fail the test."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    def refuse(*a, **k):
        raise AssertionError("a test tried to install a peer or run the benchmark")

    monkeypatch.setattr(peer_envs, "install", refuse)
    monkeypatch.setattr(peers, "run_plan", refuse)


@pytest.mark.parametrize(
    "argv, sentence",
    [
        (["--batches", "1", "0"], "--batches: each batch must be a positive integer, not 0."),
        (
            ["--new", "1"],
            "--new must be at least 2 (decode tokens/s is measured over the tokens after the first), not 1.",
        ),
        (["--prompt", "0"], "--prompt must be at least 1 token, not 0."),
        (
            ["--prompt", "8000", "--new", "500"],
            "--prompt 8000 + --new 500 is past SmolLM2-135M's context of 8192 tokens.",
        ),
        (["--rounds", "0"], "--rounds must be at least 1, not 0."),
        (["--repeats", "0"], "--repeats must be at least 1, not 0."),
        (["--threads", "0"], "--threads must be a positive integer, not 0."),
        (["--child-timeout", "0"], "--child-timeout must be positive, not 0.0."),
        (["--install-only", "llama-cpp", "--no-install"], "--install-only and --no-install contradict each other"),
        (
            ["--engines", "hf", "--precisions", "int8"],
            "--engines hf has no contender in --precisions int8 (transformers has no int8 pair here)",
        ),
    ],
)
def test_bad_arguments_get_one_sentence(argv, sentence):
    with pytest.raises(SystemExit) as e:
        peers.main(argv)
    assert str(e.value).startswith(sentence) and str(e.value).count("\n") == 0


@pytest.mark.parametrize(
    "argv, word",
    [
        (["--precisions", "fp16"], "--precisions"),
        (["--engines", "vllm"], "--engines"),
        (["--install-only", "onnx"], "--install-only"),
        (["--batches", "x"], "--batches"),
        (["--int8-dtype", "float16"], "--int8-dtype"),
    ],
)
def test_argparse_refuses_unknown_values(argv, word, capsys):
    with pytest.raises(SystemExit) as e:
        peers.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert word in err and ("invalid choice" in err or "invalid int value" in err)


def test_no_install_names_the_missing_peer_and_the_command(monkeypatch):
    with pytest.raises(SystemExit) as e:
        peers.main(["--no-install", "--engines", "sf", "llama_cpp"])
    env = peer_envs.peers()["llama-cpp"]
    assert str(e.value) == (
        f"--no-install: the llama-cpp peer (llama.cpp through llama-cpp-python "
        f"{peer_envs.LLAMA_CPP_VERSION}) is not installed in {peer_envs.venv_dir(env)}; install it "
        f"with `python bench/peers.py --install-only llama-cpp` (it takes minutes and needs PyPI) "
        f"or drop --no-install."
    )
    with pytest.raises(SystemExit, match=r"^--no-install: the openvino peer .*--install-only openvino`"):
        peers.main(["--no-install"])  # every engine: the first missing peer in engine order is named


def test_no_install_without_peers_runs_and_an_installed_peer_is_used(monkeypatch):
    seen = []
    monkeypatch.setattr(peers, "run_plan", lambda args, pythons: seen.append(pythons) or {"table": "", "out": "x"})
    peers.main(["--no-install", "--engines", "sf", "hf", "--precisions", "fp32"])
    assert seen == [{}]
    env = peer_envs.peers()["llama-cpp"]
    os.makedirs(peer_envs.venv_dir(env))
    peer_envs.marker(env).write_text(json.dumps({"install_seconds": 1.0}))
    peers.main(["--no-install", "--engines", "llama_cpp", "--precisions", "int8"])
    assert seen[-1] == {"llama-cpp": str(peer_envs.python_of(env))}


def test_the_pairs_are_like_precision():
    def labels(p, engines=peers.ENGINES):
        return [(c.label, c.dtype, c.weights) for c in peers.contenders(p, engines)]

    assert labels("fp32") == [
        ("sf", "float32", "float32"),
        ("hf", "float32", "float32"),
        ("openvino", "float32", "float32"),
        ("llama_cpp_F32", "float32", "F32"),
    ]
    assert [x[0] for x in labels("bf16")] == ["sf", "hf", "openvino", "llama_cpp_F16", "llama_cpp_BF16"]
    assert {x[1] for x in labels("bf16")} == {"bfloat16"}
    assert labels("int8") == [
        ("sf_int8", "bfloat16", "int8"),
        ("sf_int8_head", "bfloat16", "int8+head"),
        ("openvino_int8", "bfloat16", "int8"),
        ("llama_cpp_Q8_0", "bfloat16", "Q8_0"),
    ]
    assert {c.dtype for c in peers.contenders("int8", peers.ENGINES, "float32")} == {"float32"}
    assert labels("int8", ("hf",)) == []
    assert peers.needed_peers(["fp32"], ("sf", "hf")) == []
    assert peers.needed_peers(["int8", "fp32"], peers.ENGINES) == ["openvino", "llama-cpp"]


def test_peer_venvs_live_outside_the_clone_named_by_what_they_install(tmp_path):
    env = peer_envs.peers()["llama-cpp"]
    folder = peer_envs.venv_dir(env)
    assert folder.parent == tmp_path / "cache" / "staticformers"
    assert folder.name == f"venv-llama-cpp-{peer_envs.spec_hash(env)}" and len(peer_envs.spec_hash(env)) == 12
    assert "--no-binary" in env.pip_options and dict(env.env)["CMAKE_ARGS"].startswith("-DLLAVA_BUILD=OFF")
    other = peer_envs.PeerEnv(**{**env.__dict__, "requirements": ("llama-cpp-python==0.0.1",)})
    assert peer_envs.spec_hash(other) != peer_envs.spec_hash(env)
    assert peer_envs.installed(env) is None  # no marker: not installed (a half-made venv is redone)
    ov = peer_envs.peers()["openvino"]
    assert "optimum-intel[openvino]==2.2.0" in ov.requirements and ov.remove_after == ("torchvision",)
    assert any(r.startswith("torch==") for r in ov.requirements)


def test_prompt_rows_are_windows_and_a_short_text_is_refused():
    assert peers.prompt_rows(list(range(10)), 2, 3) == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(
        SystemExit,
        match=r"^the prompt text has 10 tokens, fewer than --batches' largest x --prompt "
        r"\(4 x 3\): lower one of them\.$",
    ):
        peers.prompt_rows(list(range(10)), 4, 3)
    assert len(peers.prompt_text()) > 20_000  # ~8 x 128 tokens and more


def _tiny_q4_1_gguf(path: str) -> dict:
    """A GGUF shaped like the suite's: a Q4_1 matrix, a Q8_0 embedding, an F32 norm, a few metadata keys."""
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(0)
    arrays = {
        "token_embd.weight": (rng.standard_normal((8, 64)).astype(np.float32), "Q8_0"),
        "blk.0.ffn_up.weight": (rng.standard_normal((4, 64)).astype(np.float32), "Q4_1"),
        "blk.0.attn_norm.weight": (rng.standard_normal(64).astype(np.float32), "F32"),
    }
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_string("general.name", "tiny")
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    w.add_file_type(3)
    for name, (values, kind) in arrays.items():
        if kind == "F32":
            w.add_tensor(name, values)
        else:
            qtype = getattr(gguf.GGMLQuantizationType, kind)
            w.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = gguf.GGUFReader(path)
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}


@pytest.mark.parametrize("fmt", llama_cpp_peer.FORMATS)
def test_llama_cpp_files_hold_the_dequantised_values(tmp_path, fmt):
    gguf = pytest.importorskip("gguf")
    source = str(tmp_path / "tiny.Q4_1.gguf")
    want = _tiny_q4_1_gguf(source)
    dest = str(tmp_path / llama_cpp_peer.gguf_name("tiny.Q4_1.gguf", fmt))
    assert dest.endswith(f"tiny.{fmt}.gguf")
    info = llama_cpp_peer.make_gguf(source, dest, fmt)
    assert info["format"] == fmt and info["bytes"] == os.path.getsize(dest) and not os.path.exists(dest + ".partial")
    reader = gguf.GGUFReader(dest)
    assert reader.fields["general.file_type"].contents() == llama_cpp_peer.FILE_TYPES[fmt]
    assert reader.fields["general.name"].contents() == "tiny"
    assert reader.fields["tokenizer.ggml.tokens"].contents() == ["a", "b", "c"]
    got = {t.name: (t.tensor_type.name, gguf.quants.dequantize(t.data, t.tensor_type)) for t in reader.tensors}
    assert set(got) == set(want)
    assert got["blk.0.attn_norm.weight"][0] == "F32"  # one-dimensional tensors stay F32 in every format
    for name in ("token_embd.weight", "blk.0.ffn_up.weight"):
        kind, values = got[name]
        assert kind == fmt and values.shape == want[name].shape
        if fmt == "F32":
            np.testing.assert_array_equal(values, want[name])  # exactly the values our loader dequantises
        elif fmt == "F16":
            np.testing.assert_array_equal(values, want[name].astype(np.float16).astype(np.float32))
        else:  # BF16: 8 bits of mantissa; Q8_0: a block's max / 127 a step
            tol = 2**-8 * np.abs(want[name]) if fmt == "BF16" else np.abs(want[name]).max() / 127
            assert (np.abs(values - want[name]) <= tol + 1e-7).all()
    assert llama_cpp_peer.weight_bytes(dest) == sum(int(t.n_bytes) for t in reader.tensors)
    with pytest.raises(ValueError, match="llama.cpp format 'Q4_K': use one of F32, F16, BF16, Q8_0"):
        llama_cpp_peer.make_gguf(source, dest, "Q4_K")


def test_spawn_records_a_child_s_error_and_its_pressure():
    rec = peers.spawn([sys.executable, "-c", "import sys; sys.exit('no model here')"], dict(os.environ), 60)
    assert rec["error"] == "exit 1: no model here"
    assert rec["pressure_before"] and rec["pressure_after"]


def test_spawn_turns_a_child_s_clocks_into_starts():
    code = (
        "import json, time; t = time.time(); print(json.dumps({'t_start': t, 't_imported': t, 't_loaded': t, "
        "'t_first_token': t + 0.5, 'warmup_s': 0, 'ttft_s': [0.01, 0.03, 0.02], 'total_s': [0.5, 0.4, 0.6], "
        "'tokens': list(range(40))}))"
    )
    rec = peers.spawn([sys.executable, "-c", code], dict(os.environ), 60)
    assert rec["ttft_ms"] == 20.0 and rec["total_s"] == 0.5 and len(rec["tokens"]) == 32
    assert 0.5 <= rec["start_to_first_token_s"] < 30 and "t_first_token" not in rec


def test_summaries_are_medians_of_the_warm_processes_and_the_cold_one_s_start():
    runs = [
        {"cold": True, "start_to_first_token_s": 40.0, "ttft_ms": 500.0, "total_s": 9.0, "tokens": [1]},
        {"cold": False, "start_to_first_token_s": 4.0, "ttft_ms": 20.0, "total_s": 0.02 + 0.01 * 15, "tokens": [1, 2]},
        {"cold": False, "start_to_first_token_s": 6.0, "ttft_ms": 40.0, "total_s": 0.04 + 0.03 * 15, "tokens": [1, 3]},
        {"cold": False, "error": "exit 1: boom"},
    ]
    s = peers.summarise(runs, batch=8, new=16, weight_bytes=10**9)
    assert s["cold_start_s"] == 40.0 and s["warm_start_s"] == 5.0 and s["ttft_ms"] == 30.0
    assert s["step_ms"] == 20.0 and s["decode_tok_s"] == 400.0 and s["all_decode_tok_s"] == [800.0, 266.7]
    assert s["weights_gb_s"] == 50.0 and s["errors"] == ["exit 1: boom"]
    assert peers.summarise([{"cold": True, "error": "x"}], 1, 16, None) == {"cold_start_s": None, "errors": ["x"]}


def _case():
    return {
        "precision": "fp32",
        "batch": 1,
        "contenders": {
            "sf": {
                "engine": "sf",
                "dtype": "float32",
                "weights": "float32",
                "decode_tok_s": 100.0,
                "ttft_ms": 20.0,
                "warm_start_s": 4.0,
                "cold_start_s": 40.0,
                "tokens": [5, 6, 7],
                "weights_gb_s": 54.0,
                "errors": [],
            },
            "llama_cpp_F32": {
                "engine": "llama_cpp",
                "dtype": "float32",
                "weights": "F32",
                "decode_tok_s": 90.0,
                "ttft_ms": 30.0,
                "warm_start_s": 1.0,
                "cold_start_s": 1.1,
                "tokens": [5, 6, 8],
                "weights_gb_s": 48.6,
                "errors": [],
            },
            "openvino": {
                "engine": "openvino",
                "dtype": "float32",
                "weights": "float32",
                "cold_start_s": None,
                "errors": ["exit 1: no export"],
            },
        },
    }


def test_the_table_has_a_row_per_contender_errors_included():
    case = _case()
    peers.add_agreement(case)
    peers.add_ceiling(case, {"gb_s": 60.0})
    report = {
        "cases": [case],
        "ceilings": {"fp32": {"gb_s": 60.0, "probe": "sum"}},
        "pressure_before": "some avg10=1",
        "pressure_after": "some avg10=2",
    }
    table = peers.markdown(report).splitlines()
    assert table[2] == (
        "| fp32 | 1 | sf (fp32 weights, fp32) | 100.0 | 20.0 | 54.0 of 60.0 (0.90) | 4.00 | 40.00 | 3 of 3 |"
    )
    assert (
        table[3] == "| fp32 | 1 | llama_cpp_F32 (F32 file) | 90.0 | 30.0 | 48.6 of 60.0 (0.81) | 1.00 | 1.10 | 2 of 3 |"
    )
    assert table[4].startswith("| fp32 | 1 | openvino (fp32 weights, fp32) | error: exit 1: no export |")
    assert table[-1] == "CPU pressure before: some avg10=1; after: some avg10=2."
    assert case["ceiling_misses"] == []
    peers.add_ceiling(case, {"gb_s": 50.0})  # a busier probe: sf read faster than it
    assert case["ceiling_misses"] == ["sf"] and case["contenders"]["sf"]["bandwidth_utilisation"] == 1.08


def test_runs_made_in_pieces_merge_into_one_report(tmp_path, capsys):
    pieces = []
    for i, batch in enumerate((1, 8)):
        case = dict(_case(), batch=batch)
        peers.add_ceiling(case, {"gb_s": 60.0 + i})
        report = {
            "started": f"t{i}",
            "cases": [case],
            "ceilings": {"fp32": {"gb_s": 60.0 + i, "probe": "sum"}},
            "pressure_before": f"before {i}",
            "pressure_after": f"after {i}",
            "prep": {},
        }
        pieces.append(tmp_path / f"piece{i}.json")
        pieces[-1].write_text(json.dumps(report))
    out = tmp_path / "all.json"
    merged = peers.main(["--merge", *map(str, pieces), "--out", str(out)])
    assert [c["batch"] for c in merged["cases"]] == [1, 8] and json.loads(out.read_text())["table"] == merged["table"]
    assert (merged["pressure_before"], merged["pressure_after"]) == ("before 0", "after 1")
    assert [p["started"] for p in merged["pieces"]] == ["t0", "t1"]
    rows = merged["table"].splitlines()
    assert rows[2].startswith("| fp32 | 1 | sf (fp32 weights, fp32) | 100.0 | 20.0 | 54.0 of 60.0 (0.90) |")
    assert rows[5].startswith("| fp32 | 8 | sf (fp32 weights, fp32) | 100.0 | 20.0 | 54.0 of 61.0 (0.89) |")
    assert capsys.readouterr().out.strip() == merged["table"]
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SystemExit, match=r"^--merge: .*bad\.json is not a bench/peers\.py JSON \(it has no cases\)\.$"):
        peers.main(["--merge", str(tmp_path / "bad.json")])
