"""Weight-only int8 under tensor parallel (2 CPU ranks, gloo) against the same int8 model in one process.

One torchrun launch (tests/distributed_quant_worker.py) quantises a tiny untied Llama as it loads at
tp_size=2, and loads the int8 checkpoint one process saved (`pack-quantized`) at tp_size=2; each gives the
prompt's logits and greedy tokens (by forward passes and by `generate`). The int8 values and scales are the same numbers in both (each row's
scale depends on that row only, and a colwise shard holds whole rows), so only the order of fp32 sums
differs: the logits agree within `FP32_REORDERED` and the greedy tokens exactly.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import distributed_quant_worker as W
from launch import torchrun
import tolerances as tol
from staticformers import AutoModelForCausalLM, QuantizationConfig

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints):
    return tiny_checkpoints("llama", num_key_value_heads=4)  # untied: its greedy tokens vary


@pytest.fixture(scope="module")
def one_process(checkpoint, tmp_path_factory):
    """(the int8 model's logits and greedy tokens in one process, the folder it saved)."""
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, quantization_config=QuantizationConfig("int8_weight_only")
    )
    saved = str(tmp_path_factory.mktemp("int8"))
    model.save_pretrained(saved)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(W.PROMPT)).logits[0]
    generated = model.generate(
        torch.tensor(W.PROMPT), max_new_tokens=W.NEW_TOKENS, do_sample=False, disable_compile=True
    )
    return {
        "logits": logits,
        "greedy": W.greedy(model, W.PROMPT, W.NEW_TOKENS),
        "generate": generated[0, len(W.PROMPT[0]) :].tolist(),
    }, saved


@pytest.fixture(scope="module")
def launched(checkpoint, one_process, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tp_int8"))
    torchrun("distributed_quant_worker.py", checkpoint, one_process[1], out, nproc=2)
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]


@pytest.mark.parametrize("how", ["quantized_at_load", "saved_int8"])
def test_tp2_int8_matches_one_process_int8(launched, one_process, how):
    expected = one_process[0]
    assert (
        json.load(open(os.path.join(one_process[1], "config.json")))["quantization_config"]["format"]
        == "pack-quantized"
    )
    for rank in launched:
        got = rank[how]
        tol.assert_close(torch.tensor(got["logits"]), expected["logits"])
        assert got["greedy"] == expected["greedy"]
        assert got["generate"] == expected["generate"] == expected["greedy"]
        shards = got["shards"]  # hidden 64 at tp 2: q_proj's rows and o_proj's columns halved
        assert shards["q_proj.weight"] == [["S(0)"], [32, 64], "torch.int8"]
        assert shards["q_proj.weight_scale"] == [["S(0)"], [32, 1], "torch.float32"]
        assert shards["o_proj.weight"] == [["S(1)"], [64, 32], "torch.int8"]
        assert shards["o_proj.weight_scale"] == [["R"], [64, 1], "torch.float32"]


def test_fsdp_over_an_int8_model_is_refused_in_one_sentence(launched):
    for rank in launched:
        assert rank["fsdp_refused"] is not None and "tensor parallelism only" in rank["fsdp_refused"]
        assert "dp_size=2" in rank["fsdp_refused"]
