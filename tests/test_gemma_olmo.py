"""Gemma 2, Gemma 3 (text) and OLMo 2 against transformers 5 (tiny random models, tiny.py): their switches
change the logits (so parity proves them), greedy tokens over a mixed batch equal transformers' (eager and
through Dynamo's graphs), what we save transformers loads with the same logits and the family's keys,
LoRA equals peft's on Gemma 3, and what cannot work is refused in one sentence.

The plain logit parity (fp32, padded and not), bf16 parity, batch-1 greedy parity and speculation run
in the suites that sweep every family (test_modeling.py, test_on_device.py, test_generation.py,
test_speculative.py).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from staticformers import AutoModelForCausalLM, CompileConfig, ShapePlan
from staticformers.generation.engines import compile_stats, engine_for
from staticformers.models.config_checks import ConfigError
from staticformers.models.model_config import ModelConfig
from tiny import GEMMA_FAMILIES, build_hf_model, hf_config
import tolerances as tol

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

PLAN = ShapePlan(max_model_len=64, max_batch_size=4, min_prompt_length=8, min_kv_length=32)


def _ids(batch=1, seq=12, seed=1):
    return torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _left_padded(lengths, seed=2):
    width = max(lengths)
    g = torch.Generator().manual_seed(seed)
    ids, mask = torch.zeros(len(lengths), width, dtype=torch.long), torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, width - n :] = torch.randint(3, 128, (n,), generator=g)
        mask[i, width - n :] = 1
    return ids, mask


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


# ---------------------------------------------------------------------------------------------
# the tiny configs exercise every switch: turning one off moves the logits
# ---------------------------------------------------------------------------------------------
def test_gemma2_switches_change_the_logits(tiny_checkpoints):
    """Attention soft-capping, final soft-capping and the window of 4 (over 12 tokens) each change what
    Gemma 2 computes: logit parity with transformers therefore proves each."""
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("gemma2"))
    ids = _ids()
    base = _logits(model, ids)
    assert float(base.abs().max()) < 3.0  # the final cap (3.0) bounds them
    for layer in model.model.layers:
        layer.self_attn.softcap = None
    uncapped = _logits(model, ids)
    assert (uncapped - base).abs().max() > 1e-3
    model.config.final_logit_softcapping = None
    assert (_logits(model, ids) - uncapped).abs().max() > 1e-2
    windows = [layer.self_attn.window for layer in model.model.layers]
    assert windows == [4, None, 4]
    for layer in model.model.layers:
        layer.self_attn.window = None
    model.model.windows = {None}
    full = _logits(model, ids)
    tol.assert_close(full[0, :4], _logits_with_windows(model, ids, windows)[0, :4])
    assert (full[0, -1] - _logits_with_windows(model, ids, windows)[0, -1]).abs().max() > 1e-3


def _logits_with_windows(model, ids, windows):
    for layer, w in zip(model.model.layers, windows):
        layer.self_attn.window = w
    model.model.windows = set(windows)
    try:
        return _logits(model, ids)
    finally:
        for layer in model.model.layers:
            layer.self_attn.window = None
        model.model.windows = {None}


def test_gemma3_two_rope_bases_and_layer_kinds(tiny_checkpoints):
    """Sliding layers (window 5) rotate with base 10000, the full layer with base 1e6 and linear scaling 4:
    distinct tables, distinct layer kinds (compiled regions), and rotating every layer with one table moves
    the logits."""
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("gemma3"))
    decoder = model.model
    local, full = decoder.rotary_local.inv_freq, decoder.rotary_emb.inv_freq
    torch.testing.assert_close(local, 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    torch.testing.assert_close(full, 1.0 / 1000000.0 ** (torch.arange(0, 16, 2).float() / 16) / 4.0)
    kinds = [layer.kind for layer in decoder.layers]
    assert kinds == [(5, "dense", "local"), (5, "dense", "local"), (None, "dense", "global"), (5, "dense", "local")]
    ids = _ids()
    base = _logits(model, ids)
    decoder.rotary_local.inv_freq = full.clone()
    assert (_logits(model, ids) - base).abs().max() > 1e-3


def test_olmo2_norms_where_transformers_has_them(tiny_checkpoints):
    """No norm before attention or the MLP; a norm after each; q/k norms as wide as their projections."""
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("olmo2"))
    layer = model.model.layers[0]
    assert layer.input_layernorm is None and not hasattr(layer, "pre_feedforward_layernorm")
    assert layer.self_attn.q_norm.weight.shape == (4 * 16,) and layer.self_attn.k_norm.weight.shape == (2 * 16,)
    names = {n for n, _ in model.named_parameters()}
    ref = {n for n, _ in build_hf_model("olmo2").named_parameters()}
    assert names == ref


# ---------------------------------------------------------------------------------------------
# greedy generation through the engine
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", GEMMA_FAMILIES)
def test_greedy_tokens_equal_transformers_on_a_mixed_batch(tiny_checkpoints, family):
    """24 new tokens for a left-padded batch of 3 (prompts longer and shorter than the windows) and for
    one prompt alone, with the engine's eager step functions and with its compiled regions (Dynamo's
    graphs on the eager backend)."""
    path = tiny_checkpoints(family)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ours = AutoModelForCausalLM.from_pretrained(path)
    engine_for(ours, PLAN)
    ids, mask = _left_padded([5, 17, 11])
    kw = dict(max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None)
    ref = hf.generate(input_ids=ids, attention_mask=mask, **kw)
    assert torch.equal(ours.generate(input_ids=ids, attention_mask=mask, disable_compile=True, **kw), ref)
    compiled = ours.generate(input_ids=ids, attention_mask=mask, compile_config=CompileConfig(backend="eager"), **kw)
    assert torch.equal(compiled, ref)
    one = ids[1:2]
    ref_one = hf.generate(input_ids=one, attention_mask=torch.ones_like(one), **kw)
    assert torch.equal(ours.generate(input_ids=one, compile_config=CompileConfig(backend="eager"), **kw), ref_one)
    assert all(r["graphs"] <= r["functions"] for r in compile_stats(ours))


# ---------------------------------------------------------------------------------------------
# checkpoints and configs
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", GEMMA_FAMILIES)
def test_what_we_save_transformers_loads_with_the_same_logits(tiny_checkpoints, tmp_path, family):
    ours = AutoModelForCausalLM.from_pretrained(tiny_checkpoints(family))
    ours.save_pretrained(tmp_path)
    with open(os.path.join(tmp_path, "config.json")) as f:
        written = json.load(f)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    ids = _ids(batch=2)
    tol.assert_close(_logits(ours, ids), _logits(theirs, ids))
    assert ours.config.num_parameters == ours.num_parameters() == theirs.num_parameters()
    expected = hf_config(family)
    for key in (
        "layer_types",
        "sliding_window",
        "query_pre_attn_scalar",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "hidden_activation",
        "rope_parameters",
        "tie_word_embeddings",
        "attention_bias",
        "rms_norm_eps",
        "head_dim",
    ):
        if hasattr(expected, key):
            assert written[key] == getattr(expected, key), key
            assert getattr(theirs.config, key) == getattr(expected, key), key
    assert written["model_type"] == expected.model_type
    assert ("hidden_act" in written) == (family == "olmo2")  # Gemma spells it hidden_activation


def test_older_gemma_configs_get_transformers_defaults():
    """A Gemma 3 config.json of the Hub's first spelling (rope_theta, rope_local_base_freq, rope_scaling, no
    layer_types) and a Gemma 2 one without layer_types read as transformers reads them."""
    base = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=7,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    old = {
        "architectures": ["Gemma3ForCausalLM"],
        **base,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window": 512,
    }
    ours = ModelConfig.from_dict(old)
    theirs = transformers.Gemma3TextConfig(**{k: v for k, v in old.items() if k != "architectures"})
    assert ours.layer_types == theirs.layer_types and ours.head_dim == 256 and ours.tie_word_embeddings
    assert ours.to_dict()["rope_parameters"] == theirs.rope_parameters
    assert ours.query_pre_attn_scalar == 256 and ours.final_logit_softcapping is None
    g2 = ModelConfig.from_dict({"architectures": ["Gemma2ForCausalLM"], **base, "hidden_act": "gelu_pytorch_tanh"})
    assert g2.layer_types == transformers.Gemma2Config(**base).layer_types
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping) == (50.0, 30.0)


@pytest.mark.parametrize(
    "change, words",
    [
        (
            {"use_bidirectional_attention": True},
            "use_bidirectional_attention=true makes a Gemma3ForCausalLM an encoder",
        ),
        ({"hidden_activation": "relu"}, "hidden_activation='relu' is not supported"),
        ({"final_logit_softcapping": -1.0}, "final_logit_softcapping"),
        ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
        (
            {"rope_parameters": {"sliding_attention": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}},
            "rope_parameters.sliding_attention",
        ),
    ],
)
def test_bad_gemma_keys_get_one_sentence(change, words):
    raw = {
        "architectures": ["Gemma3ForCausalLM"],
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        **change,
    }
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        ModelConfig.from_dict(raw)


def test_tanh_gelu_is_refused_for_experts():
    raw = {
        "architectures": ["MixtralForCausalLM"],
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "hidden_act": "gelu_pytorch_tanh",
    }
    with pytest.raises(ConfigError, match="MixtralForCausalLM's experts compute SiLU only"):
        ModelConfig.from_dict(raw)
    llama = ModelConfig.from_dict({**raw, "architectures": ["LlamaForCausalLM"]})  # a dense MLP takes either
    assert llama.hidden_act == "gelu_pytorch_tanh" and llama.to_dict()["hidden_act"] == "gelu_pytorch_tanh"


def test_tensor_parallel_olmo2_is_refused():
    from staticformers.distributed.distributed_config import DistributedConfig, DistributedConfigError

    config = ModelConfig.from_dict(hf_config("olmo2").to_dict())
    with pytest.raises(DistributedConfigError, match="Olmo2ForCausalLM normalises q and k over the whole projection"):
        DistributedConfig(tp_size=2).check_model(config)
    DistributedConfig(tp_size=2).check_model(ModelConfig.from_dict(hf_config("gemma3").to_dict()))


# ---------------------------------------------------------------------------------------------
# LoRA against peft
# ---------------------------------------------------------------------------------------------
def test_lora_on_gemma3_equals_peft_both_ways(tiny_checkpoints, tmp_path):
    peft = pytest.importorskip("peft")
    from staticformers import LoraConfig

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    hf = build_hf_model("gemma3")
    torch.manual_seed(1)
    pm = peft.get_peft_model(
        hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, lora_dropout=0.0)
    ).eval()
    pm.save_pretrained(str(tmp_path / "peft"))
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("gemma3"))
    model.load_adapter(tmp_path / "peft")
    ids = _ids(batch=2, seed=3)
    with torch.no_grad():
        tol.assert_close(model(ids).logits, pm(ids).logits)
    ours = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("gemma3"))
    torch.manual_seed(2)
    ours.add_adapter(LoraConfig(r=4, lora_alpha=16, target_modules=targets, init_lora_weights=False))
    ours.save_pretrained(tmp_path / "ours")
    loaded = peft.PeftModel.from_pretrained(build_hf_model("gemma3"), str(tmp_path / "ours")).eval()
    with torch.no_grad():
        tol.assert_close(loaded(ids).logits, ours(ids).logits)


# ---------------------------------------------------------------------------------------------
# served, int8, and the CPU's attention formulations with a soft cap
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_an_int8_gemma2_is_served_with_its_own_greedy_tokens(tmp_path):
    """Gemma 2 (soft caps, windows) quantized to int8 and served through the plan's compiled steps: the
    openai client's completion equals the model's own greedy tokens."""
    pytest.importorskip("openai")
    from served_greedy import assert_served_completion_is_greedy
    from staticformers import AutoTokenizer, QuantizationConfig
    from staticformers.models.quantization import QuantLinear
    from tiny import save_served

    folder = save_served("gemma2", tmp_path, positions=128)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=QuantizationConfig("int8_weight_only"))
    assert isinstance(model.model.layers[0].self_attn.q_proj, QuantLinear)
    assert_served_completion_is_greedy(model, tok, folder, "Hello there, this is a longer prompt", 8)


@pytest.mark.parametrize("queries", [1, 5])
def test_the_cpus_attention_formulations_apply_the_soft_cap(queries):
    """Fused reductions (one query), grouped matmuls and the plain path equal transformers' eager
    attention with soft-capped scores, over a padded, windowed mask."""
    from staticformers.backends.cpu.formulations import CPUOps
    from staticformers.models.ops import Ops
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, n, 16, generator=g) * 3 for h, n in ((4, queries), (2, 9), (2, 9)))
    pos = torch.arange(9 - queries, 9).view(1, 1, queries, 1)
    keys = torch.arange(9).view(1, 1, 1, 9)
    mask = ((keys <= pos) & (pos - keys < 4)).expand(2, 1, queries, 9).clone()
    mask[1, ..., :2] = False
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 2, False
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    want = eager_attention_forward(module, q, k, v, additive, scaling=0.25, softcap=1.5)[0].transpose(1, 2)
    for ops in (Ops(), CPUOps("reduce"), CPUOps("matmul"), CPUOps()):
        tol.assert_close(ops.attention(q, k, v, mask, 0.25, softcap=1.5), want)
    uncapped = Ops().attention(q, k, v, mask, 0.25)
    assert (uncapped - want).abs().max() > 1e-2


# ---------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_regional_compiled_training_equals_eager(tiny_checkpoints, tmp_path, monkeypatch, family="gemma3"):
    """The Trainer's layer and head regions (aot_eager: forward and backward graphs), with gradient
    checkpointing and packed rows, train the same weights as eager: one region per layer kind (Gemma 3's
    sliding layers with their RoPE, its full layer with the other) and the head. (Gemma 2's soft-capped
    attention's gradients equal transformers' in test_modeling.py.)"""
    from staticformers import Trainer, TrainingArguments
    from staticformers.training import step_functions as compiled

    g = torch.Generator().manual_seed(0)
    docs = [
        {"input_ids": torch.randint(1, 128, (int(n),), generator=g).tolist()}
        for n in torch.randint(3, 30, (24,), generator=g)
    ]
    runs = {}
    for name in ("eager", "regional"):
        model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints(family))
        if name == "regional":
            monkeypatch.setattr(compiled.StepFunction.__init__, "__defaults__", (True, compiled.PLAIN))
        args = TrainingArguments(
            output_dir=str(tmp_path / name),
            max_length=32,
            per_device_train_batch_size=4,
            max_steps=2,
            logging_steps=1,
            save_strategy="no",
            disable_tqdm=True,
            learning_rate=1e-3,
            seed=0,
            packing=True,
            gradient_checkpointing=name == "regional",
            torch_compile=name == "regional",
            torch_compile_backend="aot_eager" if name == "regional" else None,
        )
        trainer = Trainer(model=model, args=args, train_dataset=docs)
        trainer.train()
        runs[name] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if name == "regional":
            assert trainer.compile_stats()["train_graphs"] == 3
    for k in runs["eager"]:
        torch.testing.assert_close(runs["regional"][k], runs["eager"][k], rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# chunked prefill
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_a_long_prompt_in_chunks_gives_transformers_tokens(tiny_checkpoints, family):
    """70 tokens against a largest prompt bucket of 16: the rest runs in chunks of the extend step (its
    regions on Dynamo's eager backend), through the soft caps, the windows and both RoPE bases; the
    greedy tokens equal transformers' on the whole prompt."""
    from staticformers.generation.engines import compile_settings
    from staticformers.generation.generation_config import GenerationConfig
    from staticformers.generation.loop import GenerationLoop, GenerationRequest
    from loop_driver import run_loop

    path = tiny_checkpoints(family)
    model = AutoModelForCausalLM.from_pretrained(path)
    plan = ShapePlan(batch_sizes=[1], prompt_lengths=[16], kv_lengths=[96], max_model_len=96, extend_widths=((16, 1),))
    settings = compile_settings(model, GenerationConfig(), CompileConfig(backend="eager"))
    loop = GenerationLoop(engine_for(model, plan), settings, chunked_prefill=16)
    prompt = torch.randint(3, 128, (70,), generator=torch.Generator().manual_seed(5)).tolist()
    out = run_loop(loop, {0: [GenerationRequest(prompt, 10, request_id="long")]})
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.tensor([prompt])
    ref = hf.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert out["long"] == ref[0, 70:].tolist()
    assert loop.chunks == 4  # ceil((70 - 16) / 16)


def test_the_embedding_scale_is_rounded_without_tensors():
    """sqrt(hidden) rounded to each dtype as transformers' tensor of that dtype rounds it, in plain Python: the
    decoder computes it at construction, on the meta device, where a tensor cannot be read back (and a traced
    graph on torch_xla could not fold it)."""
    from staticformers.models.norm_variants import embedding_scale

    for hidden in (7, 64, 100, 640, 1152, 2304, 2560, 3840, 5376):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            want = float(torch.tensor(hidden**0.5, dtype=torch.float32).to(dtype))
            with torch.device("meta"):
                assert embedding_scale(hidden**0.5, dtype) == want, (hidden, dtype)
