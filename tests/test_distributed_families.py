"""The newer families partitioned under torchrun (2 CPU ranks, gloo), against one process: Phi-3 (q/k/v and
gate/up fused on disk, read per rank from the fused tensors), GLM-4 (interleaved partial RoPE, q/k/v biases,
fused gate/up, post norms), Granite (its multipliers, biases) and SmolLM3 (layers without RoPE) at tensor
parallel 2; gpt-oss at tensor parallel 2 (the attention sinks split over the heads) and at expert parallel 2
over FSDP (the expert biases split with the experts); DeepSeek-V3 at tensor parallel 2 (latent attention: each rank
its heads, the latent whole) and at expert parallel 2; Qwen3.5 at tensor parallel 2 (the gated full layer's heads
split, the Gated DeltaNet layers and their states whole on every rank). Per run: logits, greedy tokens, a training step's loss
(LoRA on PEFT's names for Phi-3's fused projections and Granite) and the gradients of the parameters that
the split touches, and the checkpoint a partitioned model saves (the file's names, equal tensors)."""

from __future__ import annotations

import json
import os

import pytest
import torch

import distributed_families_worker as W
from launch import torchrun
import tolerances as tol

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
transformers = pytest.importorskip("transformers")


# name -> (tiny family, DistributedConfig's arguments, LoRA targets for the training step, gradients compared)
SINKS = ["model.layers.0.self_attn.sinks", "model.layers.1.self_attn.sinks"]
EXPERT_BIASES = ["model.layers.0.mlp.experts.gate_up_proj_bias", "model.layers.0.mlp.experts.down_proj_bias",
                 "model.layers.0.mlp.experts.down_proj"]
# DeepSeek-V3: the latent path every head reads (its gradient summed over the ranks' heads), the heads' own
# projections, the router and shared experts beside the split experts
LATENT = [f"model.layers.0.self_attn.{name}.weight" for name in
          ("kv_a_proj_with_mqa", "kv_a_layernorm", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_b_proj", "o_proj")]
ROUTED = ["model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.gate_up_proj",
          "model.layers.1.mlp.shared_experts.down_proj.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
# Qwen3.5: the gated full layer split over its heads, the linear layers whole on every rank (their state too)
HYBRID = ["model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.q_norm.weight",
          "model.layers.0.linear_attn.in_proj_qkv.weight", "model.layers.0.linear_attn.A_log",
          "model.layers.0.linear_attn.conv1d.weight"]
RUNS = {
    "phi3": ("phi3", {"tp_size": 2}, ["qkv_proj", "gate_up_proj"], []),
    "glm4": ("glm4", {"tp_size": 2}, None, []),
    "granite": ("granite", {"tp_size": 2}, ["q_proj", "v_proj", "down_proj"], []),
    "smollm3": ("smollm3", {"tp_size": 2}, None, []),
    "gpt-oss-tp": ("gpt-oss", {"tp_size": 2}, None, SINKS + ["model.layers.0.self_attn.o_proj.bias"]),
    "gpt-oss-ep": ("gpt-oss", {"fsdp_size": 2, "ep_size": 2}, None, SINKS + EXPERT_BIASES),
    "deepseek-v3-tp": ("deepseek-v3", {"tp_size": 2}, None, LATENT),
    "deepseek-v3-ep": ("deepseek-v3", {"fsdp_size": 2, "ep_size": 2}, None, ROUTED),
    "qwen3_5-tp": ("qwen3_5", {"tp_size": 2}, None, HYBRID),
}


@pytest.fixture(scope="module")
def launched(tiny_checkpoints, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dist_families"))
    paths = {name: tiny_checkpoints(family) for name, (family, _, _, _) in RUNS.items()}
    specs = [{"name": name, "path": paths[name], "distributed": dist, "lora": lora, "grads": grads}
             for name, (_, dist, lora, grads) in RUNS.items()]
    spec_file = os.path.join(out, "runs.json")
    with open(spec_file, "w") as f:
        json.dump(specs, f)
    torchrun("distributed_families_worker.py", spec_file, out, nproc=2)
    results = []
    for r in range(2):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            results.append(json.load(f))
    return results, out, paths


def _single(name, path):
    from staticformers import AutoModelForCausalLM, LoraConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(W.PROMPT)).logits[0, -1]
    ids = model.generate(torch.tensor(W.PROMPT), max_new_tokens=W.NEW_TOKENS, do_sample=False, disable_compile=True)
    lora = RUNS[name][2]
    if lora:
        torch.manual_seed(0)
        model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=lora, init_lora_weights=False))
    model.train()
    loss = model(input_ids=W.TRAIN, labels=W.TRAIN).loss
    loss.backward()
    params = dict(model.named_parameters())
    grads = {name: params[name].grad for name in RUNS[name][3]}
    return logits, ids[0, len(W.PROMPT[0]):].tolist(), float(loss.detach()), grads


@pytest.mark.parametrize("family", list(RUNS))
def test_partitioned_over_2_ranks_equals_one_process(launched, family):
    results, out, paths = launched
    logits, tokens, loss, grads = _single(family, paths[family])
    for rank in results:
        tol.assert_close(torch.tensor(rank[family]["logits"]), logits)
        assert rank[family]["generate"] == tokens
        assert rank[family]["loss"] == pytest.approx(loss, rel=tol.FP32_REORDERED)
        assert set(rank[family]["grads"]) == set(grads)
        for name, grad in grads.items():
            tol.assert_close(torch.tensor(rank[family]["grads"][name]), grad)
    from safetensors import safe_open

    saved = os.path.join(out, f"{family}_saved")
    with safe_open(os.path.join(saved, "model.safetensors"), "pt") as f, \
            safe_open(os.path.join(paths[family], "model.safetensors"), "pt") as g:
        assert set(f.keys()) == set(g.keys())
        for name in g.keys():
            assert torch.equal(f.get_tensor(name), g.get_tensor(name)), name
