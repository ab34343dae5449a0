"""The benchmarks' shared parts: the reference sizes (the 1.7B shape checked against transformers' own
model on the meta device, never built here), the checkpoints they save, the ceiling probes, a report's JSON, and the cold-start A/B's token agreement."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import ceilings  # noqa: E402
import reference  # noqa: E402


def test_the_1_7b_reference_has_qwen3_1_7b_shape_and_transformers_parameter_count():
    import transformers

    c = reference.SIZES["1.7b"]
    assert (
        c["hidden_size"],
        c["num_hidden_layers"],
        c["num_attention_heads"],
        c["num_key_value_heads"],
        c["head_dim"],
        c["intermediate_size"],
        c["vocab_size"],
        c["tie_word_embeddings"],
    ) == (2048, 28, 16, 8, 128, 6144, 151936, True)
    assert c["eos_token_id"] is None  # every benchmark generates all the tokens it asks for
    ours = reference.weight_counts("1.7b")
    hf_config = transformers.Qwen3Config(**{k: v for k, v in c.items() if k != "rope_theta"})
    with torch.device("meta"):
        theirs = transformers.Qwen3ForCausalLM(hf_config)
    assert ours["parameters"] == sum(p.numel() for p in theirs.parameters())  # tied: the embedding once
    assert reference.DEFAULT_DTYPES["1.7b"] == "bfloat16"


def test_the_gemma3_reference_is_gemma3_text_with_transformers_parameter_count():
    import transformers

    config = reference.reference_config("gemma3-50m")
    assert config.family.architecture == "Gemma3ForCausalLM" and config.vocab_size == 262144
    assert [config.layer_window(i) for i in range(6)] == [128] * 5 + [None]  # 5 sliding : 1 full
    hf_config = transformers.Gemma3TextConfig(**reference.SIZES["gemma3-50m"])
    with torch.device("meta"):
        theirs = transformers.Gemma3ForCausalLM(hf_config)
    assert reference.weight_counts("gemma3-50m")["parameters"] == sum(p.numel() for p in theirs.parameters())


def test_the_qwen3_5_reference_is_hybrid_with_transformers_parameter_count():
    import transformers

    config = reference.reference_config("qwen3_5-50m")
    assert config.family.architecture == "Qwen3_5ForCausalLM"
    assert [config.layer_is_linear(i) for i in range(8)] == [True, True, True, False] * 2  # 3 linear : 1 full
    hf_config = transformers.Qwen3_5TextConfig(**reference.SIZES["qwen3_5-50m"])
    with torch.device("meta"):
        theirs = transformers.Qwen3_5ForCausalLM(hf_config)
    assert reference.weight_counts("qwen3_5-50m")["parameters"] == sum(p.numel() for p in theirs.parameters())


def test_state_bytes_of_a_hybrid_against_its_pure_attention_twin(capsys):
    """bench/state_bytes.py: the Qwen3.5-shaped reference's cache at 4k (two full layers' keys and values, six
    fixed-size states and its counted-token index) against every layer full attention; the cache's allocation is what its accounting says."""
    import state_bytes

    out = state_bytes.main(["--size", "qwen3_5-50m", "--context", "4096"])
    kv_row = 2 * 2 * 64 * 4  # keys and values of 2 KV heads of 64, float32
    assert out["model"]["per_position"] == 2 * kv_row and out["pure_attention"]["per_position"] == 8 * kv_row
    conv, recurrent = (2 * 4 * 64 + 8 * 64) * 3 * 4, 8 * 64 * 64 * 4
    assert out["model"]["states"] == 6 * (conv + recurrent)
    assert out["model"]["fixed"] == 6 * (conv + recurrent) + 8  # and the row's counted-token index (int64)
    assert out["pure_attention"]["fixed"] == 0
    assert out["ratio"] == round((4096 * 2 * kv_row + 6 * (conv + recurrent) + 8) / (4096 * 8 * kv_row), 4) < 0.3
    with pytest.raises(SystemExit):
        state_bytes.main(["--context", "0"])


def test_build_reference_saves_bf16_once_and_loads_in_both_libraries(tmp_path, monkeypatch):
    import transformers
    from safetensors import safe_open

    from staticformers import AutoModelForCausalLM

    monkeypatch.setenv(reference.MODELS_ENV, str(tmp_path))
    path = reference.build_reference(size="tiny", dtype="bfloat16")
    assert path == reference.reference_dir("tiny") == str(tmp_path / "reference-qwen3-tiny")
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    weights = os.path.join(path, "model.safetensors")
    stamp = os.stat(weights).st_mtime_ns
    assert reference.build_reference(size="tiny", dtype="bfloat16") == path and os.stat(weights).st_mtime_ns == stamp
    with open(os.path.join(path, "reference.json")) as f:
        assert json.load(f)["config"] == reference.SIZES["tiny"]
    ours = AutoModelForCausalLM.from_pretrained(path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert (
        ours.num_parameters()
        == reference.weight_counts("tiny")["parameters"]
        == sum(p.numel() for p in theirs.parameters())
    )
    with pytest.raises(ValueError, match="Unknown reference size '7b': use one of"):
        reference.build_reference(size="7b")


def test_cpu_memory_ceiling_is_the_best_of_three_probes_over_the_weights_bytes():
    nbytes = 4 * 2**20  # bytes of weights; 2 bytes an element in bf16, 512 columns
    ceiling = ceilings.MemoryCeiling(torch.device("cpu"), nbytes, torch.bfloat16, cols=512)
    first = ceiling.sample(repeats=3)
    assert set(first) == {"torch.mv", "sum", "compiled multiply-and-sum"}
    probe = ceiling.result()
    assert probe["what"].startswith(
        "the best of torch.mv, sum and a compiled multiply-and-sum over a 4096 x 512 bfloat16 matrix"
    )
    assert probe["bytes"] == nbytes and probe["gb_s"] > 0
    assert probe["gb_s"] == ceilings.sig(nbytes / probe["seconds"] / 1e9) == max(first.values())
    assert first[probe["probe"]] == probe["gb_s"]
    second = ceiling.sample(repeats=3)  # the ceiling is the best over every sample, never a later, slower one
    best = ceiling.result()
    assert best["samples"] == [first, second] and best["gb_s"] == max(*first.values(), *second.values())
    ceiling.close()
    with pytest.raises(RuntimeError, match="was closed"):
        ceiling.sample()
    assert ceilings.memory_ceiling(torch.device("cpu"), nbytes, torch.float32, cols=512, repeats=3)["bytes"] == nbytes
    mm = ceilings.matmul_ceiling(torch.device("cpu"), n=128, repeats=3)
    assert mm["flop"] == 2 * 128**3 and mm["tflop_s"] == ceilings.sig(mm["flop"] / mm["seconds"] / 1e12)


def test_cpu_int8_memory_ceiling_also_reads_its_bytes_as_bf16_pairs():
    """The int8 probe reads the int8 bytes three ways: a sum, a reduction widening the rows to bf16, and the bf16
    reduction over the same bytes read as bf16 pairs; an odd column count, which has no pairs, is refused in one
    sentence."""
    nbytes = 2**20
    ceiling = ceilings.MemoryCeiling(torch.device("cpu"), nbytes, torch.int8, cols=512, backend="eager")
    first = ceiling.sample(repeats=1)
    assert set(first) == {"sum", "compiled multiply-and-sum", "compiled multiply-and-sum over the bytes as bf16"}
    assert all(rate > 0 for rate in first.values()) and ceiling.bytes == nbytes
    assert ceiling.result()["what"].startswith("the best of sum, a compiled multiply-and-sum (bf16 x, int8 rows")
    ceiling.close()
    with pytest.raises(ValueError, match="give an even cols, not 511"):
        ceilings.MemoryCeiling(torch.device("cpu"), nbytes, torch.int8, cols=511, backend="eager")


def test_the_compiled_probe_reads_the_gemv_s_bytes_and_computes_its_product():
    w, x = torch.randn(300, 64, dtype=torch.float64), torch.randn(64, dtype=torch.float64)
    compiled = torch.compile(ceilings._multiply_and_sum, backend="inductor", fullgraph=True, dynamic=False)
    got = compiled(x.float(), w.float())
    assert got.dtype == torch.float32 and got.shape == (300,)
    # 64 float32 products summed: each within 64 units of float32 rounding of the sum of magnitudes
    bound = 64 * torch.finfo(torch.float32).eps * (w.abs() @ x.abs())
    assert ((got.double() - w @ x).abs() <= bound).all()


def test_generate_s_utilisation_is_against_the_run_s_ceiling_and_names_a_contender_above_it():
    import generate

    case = {
        "dtype": "float32",
        "batch": 1,
        "hf": {"weights_gb_s": 10.0, "prefill_tflop_s": 0.1},
        "sf": {"weights_gb_s": 30.0, "prefill_tflop_s": 0.2},
    }
    generate.add_utilisation(case, {"memory": {"gb_s": 40.0}, "matmul": {"tflop_s": 0.4}})
    assert (case["hf"]["bandwidth_utilisation"], case["sf"]["bandwidth_utilisation"]) == (0.25, 0.75)
    assert (
        case["sf"]["prefill_flops_utilisation"] == 0.5 and case["ceiling_misses"] == [] and case["ceiling_gb_s"] == 40
    )
    generate.add_utilisation(case, {"memory": {"gb_s": 20.0}, "matmul": {"tflop_s": 0.4}})  # a probe that missed
    assert case["sf"]["bandwidth_utilisation"] == 1.5 and case["ceiling_misses"] == ["sf"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_gpu_benchmark_without_a_gpu_says_what_to_do():
    with pytest.raises(SystemExit, match="sees no CUDA GPU.*--device cpu"):
        ceilings.check_device("cuda:0")
    with pytest.raises(SystemExit, match="run on cpu, cuda or cuda:N"):
        ceilings.check_device("mps")


@pytest.mark.cuda
def test_gpu_ceilings_are_measured_on_the_device():
    device = torch.device("cuda", 0)
    copy = ceilings.memory_ceiling(device, 256 * 2**20)
    assert copy["bytes"] == 2 * 256 * 2**20 and copy["what"].startswith("device-to-device copy")
    assert copy["probe"] == "copy" and torch.cuda.memory_allocated(device) < 256 * 2**20  # freed after sampling
    assert copy["gb_s"] == ceilings.sig(copy["bytes"] / copy["seconds"] / 1e9) > 0
    mm = ceilings.matmul_ceiling(device, n=4096)
    assert mm["flop"] == 2 * 4096**3 and mm["tflop_s"] > 0


def test_serve_bench_reads_the_graph_count_the_server_renders():
    import serve

    from staticformers.serving.metrics import ServerMetrics

    metrics = ServerMetrics("tiny")
    metrics.graphs.inc(3)
    assert serve.parse_graphs_compiled(metrics.render().decode()) == 3.0
    with pytest.raises(RuntimeError, match="has no staticformers:graphs_compiled_total line"):
        serve.parse_graphs_compiled("# nothing here\n")


def test_a_report_is_printed_and_written_as_the_same_json(tmp_path, capsys):
    report = {"a": {"cold": 42.68}, "runs": [1, 2]}
    out = tmp_path / "report.json"
    reference.emit(report, str(out))
    printed = capsys.readouterr().out
    assert json.loads(printed) == report and json.loads(out.read_text()) == report
    reference.emit(report, None)  # printed only
    assert json.loads(capsys.readouterr().out) == report


def test_the_cold_start_ab_counts_the_leading_tokens_two_runs_share():
    import cold_start

    assert cold_start.agreeing([1, 2, 3], [1, 2, 3]) == 3
    assert cold_start.agreeing([1, 2, 3], [1, 5, 3]) == 1
    assert cold_start.agreeing([4], [1]) == 0
    assert cold_start.agreeing([1, 2], [1, 2, 3]) == 2
