"""The newer families partitioned under torchrun (2 CPU ranks, gloo), against one process: Phi-3 (q/k/v and
gate/up fused on disk, read per rank from the fused tensors), GLM-4 (interleaved partial RoPE, q/k/v biases,
fused gate/up, post norms), Granite (its multipliers, biases) and SmolLM3 (layers without RoPE) at tensor
parallel 2; gpt-oss at tensor parallel 2 (the attention sinks split over the heads) and at expert parallel 2
over FSDP (the expert biases split with the experts); DeepSeek-V3 at tensor parallel 2 (latent attention: each rank
its heads, the latent whole) and at expert parallel 2; Qwen3.5 at tensor parallel 2 (the gated full layer's heads
split, and the Gated DeltaNet layers' too: each rank holds half the rows of every split linear-layer parameter and its
cache holds half the heads' states, both asserted), with LoRA on the DeltaNet's projections by PEFT's names too, and
Qwen3-Next likewise (its fused DeltaNet projections split per key head, its experts and gated shared expert beside).
Per run: logits, greedy tokens, a training step's loss (LoRA on PEFT's names for Phi-3's fused projections, Granite
and Qwen3.5) and the gradients of the parameters that the split touches, and the checkpoint a partitioned model saves
(the file's names, equal tensors); Qwen3.5's DCP checkpoint at tensor parallel 2 resumed in one process."""

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
EXPERT_BIASES = [
    "model.layers.0.mlp.experts.gate_up_proj_bias",
    "model.layers.0.mlp.experts.down_proj_bias",
    "model.layers.0.mlp.experts.down_proj",
]
# DeepSeek-V3: the latent path every head reads (its gradient summed over the ranks' heads), the heads' own
# projections, the router and shared experts beside the split experts
LATENT = [
    f"model.layers.0.self_attn.{name}.weight"
    for name in ("kv_a_proj_with_mqa", "kv_a_layernorm", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_b_proj", "o_proj")
]
ROUTED = [
    "model.layers.1.mlp.gate.weight",
    "model.layers.1.mlp.experts.gate_up_proj",
    "model.layers.1.mlp.shared_experts.down_proj.weight",
    "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
]
# Qwen3.5: the gated full layer split over its heads, and the linear layers over their key heads: the parts of
# in_proj_qkv and of the convolution, the gate and decay projections, A_log and dt_bias by rows, out_proj by columns,
# the gated norm replicated (its gradient summed over the ranks' heads)
LINEAR = "model.layers.0.linear_attn."
SPLIT = [
    LINEAR + name
    for name in (
        "in_proj_qkv.q.weight",
        "in_proj_qkv.k.weight",
        "in_proj_qkv.v.weight",
        "conv1d.q.weight",
        "conv1d.v.weight",
        "in_proj_z.weight",
        "in_proj_a.weight",
        "A_log",
        "dt_bias",
    )
]
HYBRID = [
    "model.layers.3.self_attn.q_proj.weight",
    "model.layers.3.self_attn.q_norm.weight",
    *SPLIT,
    LINEAR + "out_proj.weight",
    LINEAR + "norm.weight",
]
# Qwen3.5 with LoRA on the DeltaNet's projections by PEFT's names: in_proj_qkv's parts share one A (whole) and split
# their rows of B with their heads; out_proj's A splits by columns
LORA = ["in_proj_qkv", "in_proj_z", "out_proj"]
HYBRID_LORA = [
    LINEAR + name
    for name in (
        "in_proj_qkv.q.lora_A.default.weight",
        "in_proj_qkv.k.lora_B.default.weight",
        "in_proj_z.lora_B.default.weight",
        "out_proj.lora_A.default.weight",
    )
]
# Qwen3-Next: the same with its DeltaNet projections fused per key head (a plain row split keeps whole groups),
# experts and a gated shared expert (layer 1 dense) beside the split attention
NEXT_SPLIT = [LINEAR + name for name in ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.k.weight", "A_log")]
NEXT = [
    "model.layers.3.self_attn.q_proj.weight",
    *NEXT_SPLIT,
    LINEAR + "norm.weight",
    "model.layers.0.mlp.experts.gate_up_proj",
    "model.layers.0.mlp.shared_expert_gate.weight",
    "model.layers.1.mlp.down_proj.weight",
]
# run -> (parameters each rank must hold half the rows of, a linear-attention layer whose cached states must be half)
HALVED = {"qwen3_5-tp": (SPLIT, 0), "qwen3-next-tp": (NEXT_SPLIT, 0)}
DCP = ("qwen3_5-tp",)  # runs whose DCP checkpoint (split linear layers) must resume in one process
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
    "qwen3_5-tp-lora": ("qwen3_5", {"tp_size": 2}, LORA, HYBRID_LORA),
    "qwen3-next-tp": ("qwen3-next", {"tp_size": 2}, None, NEXT),
}


@pytest.fixture(scope="module")
def launched(tiny_checkpoints, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dist_families"))
    paths = {name: tiny_checkpoints(family) for name, (family, _, _, _) in RUNS.items()}
    specs = [
        {
            "name": name,
            "path": paths[name],
            "distributed": dist,
            "lora": lora,
            "grads": grads,
            "local": HALVED.get(name, ([], None))[0],
            "states": HALVED.get(name, ([], None))[1],
            "dcp": name in DCP,
        }
        for name, (_, dist, lora, grads) in RUNS.items()
    ]
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
    split, layer = HALVED.get(name, ([], None))
    params = dict(model.named_parameters())
    whole = {"local": {n: list(params[n].shape) for n in split}, "states": W.cached_states(model, layer)}
    lora = RUNS[name][2]
    if lora:
        torch.manual_seed(0)
        model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=lora, init_lora_weights=False))
    model.train()
    loss = model(input_ids=W.TRAIN, labels=W.TRAIN).loss
    loss.backward()
    params = dict(model.named_parameters())
    grads = {name: params[name].grad for name in RUNS[name][3]}
    return logits, ids[0, len(W.PROMPT[0]) :].tolist(), float(loss.detach()), grads, whole


@pytest.mark.parametrize("family", list(RUNS))
def test_partitioned_over_2_ranks_equals_one_process(launched, family):
    results, out, paths = launched
    logits, tokens, loss, grads, whole = _single(family, paths[family])
    for rank in results:
        # what a rank holds of each split parameter and of each row's linear-attention states: half the rows
        assert rank[family]["local"] == {n: [shape[0] // 2, *shape[1:]] for n, shape in whole["local"].items()}
        if whole["states"] is not None:
            assert rank[family]["states"] == [[shape[0] // 2, *shape[1:]] for shape in whole["states"]]
        tol.assert_close(torch.tensor(rank[family]["logits"]), logits)
        assert rank[family]["generate"] == tokens
        assert rank[family]["loss"] == pytest.approx(loss, rel=tol.FP32_REORDERED)
        assert set(rank[family]["grads"]) == set(grads)
        for name, grad in grads.items():
            tol.assert_close(torch.tensor(rank[family]["grads"][name]), grad)
    from safetensors import safe_open

    saved = os.path.join(out, f"{family}_saved")
    with (
        safe_open(os.path.join(saved, "model.safetensors"), "pt") as f,
        safe_open(os.path.join(paths[family], "model.safetensors"), "pt") as g,
    ):
        assert set(f.keys()) == set(g.keys())
        for name in g.keys():
            assert torch.equal(f.get_tensor(name), g.get_tensor(name)), name
    if family in DCP:  # the checkpoint of tp=2 shards read into one process's model, which starts from zeros
        from staticformers import AutoModelForCausalLM
        from staticformers.distributed.dcp_checkpoint import load_checkpoint

        want = AutoModelForCausalLM.from_pretrained(paths[family], dtype=torch.float32)
        got = AutoModelForCausalLM.from_pretrained(paths[family], dtype=torch.float32)
        with torch.no_grad():
            for p in got.parameters():
                p.zero_()
        load_checkpoint(os.path.join(out, f"{family}_dcp"), got)
        want = dict(want.named_parameters())
        for name, p in got.named_parameters():
            assert torch.equal(p, want[name]), name
