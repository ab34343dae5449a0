"""The features of the one decoder on the families added after the first four (tests/tiny.py: gemma2, gemma3, olmo2,
phi3, glm4, granite, smollm3, gpt-oss), each where no other file runs it on that family: seeded sampling, LoRA
against peft, the Trainer's losses against transformers trained alike, int8 weights, prompt-lookup speculation,
chunked prefill with prefix caching, and a served completion; and gpt-oss's "all-linear" LoRA, which leaves its router
out as peft does. Eager steps (`disable_compile`) wherever the feature allows (graphs are counted elsewhere); the
served completion runs served_greedy.py's regions on Dynamo's eager backend.

Covered elsewhere, so not here: greedy tokens and mixed-length batches (test_generation.py, test_gemma_olmo.py,
test_phi_glm_granite_smollm3.py, test_gpt_oss.py, test_moe_generation.py); LoRA on Gemma 3 and gpt-oss
(test_gemma_olmo.py, test_gpt_oss.py) and on Phi-3's and GLM-4's names (test_fused_lora.py); int8 on Gemma 3 and
OLMo 2 (test_quantization.py); speculation on every other family (test_speculative.py); chunked prefill and prefix
caching on Gemma 2 and gpt-oss (test_gemma_olmo.py, test_prefix_cache.py, test_gpt_oss.py); int8 Gemma 2 and
Phi-3 served (test_gemma_olmo.py, test_phi_glm_granite_smollm3.py)."""

from __future__ import annotations

import pytest
import torch

from staticformers import AutoModelForCausalLM, ShapePlan
from staticformers.generation.engines import compile_settings, engine_for
from staticformers.generation.generation_config import GenerationConfig
from staticformers.generation.loop import GenerationLoop, GenerationRequest
from tiny import build_hf_model
from family_checks import reference_losses
import tolerances as tol

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

NEW = ["gemma2", "gemma3", "olmo2", "phi3", "glm4", "granite", "smollm3", "gpt-oss"]
EAGER_RUN = GenerationConfig(disable_compile=True)


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def _tokens(n, seed):
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_greedy(hf, prompt, n):
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


# ---------------------------------------------------------------------------------------------
# seeded sampling (docs/generate.md: a seeded request draws the same tokens whatever shares its batch;
# generate(seed=s) gives row i the seed s + i)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", NEW)
def test_seeded_sampling_repeats_and_a_batch_row_draws_as_alone(tiny_checkpoints, family):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints(family))
    prompts = [_tokens(5, 1), _tokens(12, 2), _tokens(9, 3)]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width) >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    kw = dict(
        max_new_tokens=10,
        do_sample=True,
        temperature=1.5,
        top_k=40,
        disable_compile=True,
        eos_token_id=None,
        pad_token_id=0,
    )
    a, b, c = (model.generate(ids, attention_mask=mask, seed=s, **kw) for s in (5, 5, 6))
    assert torch.equal(a, b) and not torch.equal(a[:, width:], c[:, width:])
    alone = model.generate(torch.tensor([prompts[1]]), seed=6, **kw)  # row 1 of seed 5's batch samples with 5 + 1
    assert alone[0, len(prompts[1]) :].tolist() == a[1, width:].tolist()


# ---------------------------------------------------------------------------------------------
# LoRA against peft, both ways, on PEFT's names for each family's projections
# ---------------------------------------------------------------------------------------------
ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("family", ["gemma2", "olmo2", "granite", "smollm3"])
def test_lora_equals_peft_both_ways(tiny_checkpoints, tmp_path, family):
    from peft_both_ways import assert_lora_equals_peft_both_ways

    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(3))
    assert_lora_equals_peft_both_ways(tiny_checkpoints(family), family, ALL7, tmp_path, ids)


def test_gpt_oss_all_linear_is_peft_s_and_its_router_is_refused(tiny_checkpoints, tmp_path):
    """gpt-oss's router is `mlp.router` in transformers and no linear layer there: peft's "all-linear" adapts the
    attention projections only, and so does ours (peft loads it with our logits); naming the router is refused in
    one sentence. (Explicit attention targets against peft: test_gpt_oss.py.)"""
    peft = pytest.importorskip("peft")
    from staticformers import LoraConfig
    from staticformers.adapters.lora_config import AdapterConfigError

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("gpt-oss"))
    with pytest.raises(
        AdapterConfigError,
        match=r"^target_modules entry 'gate' matches no projection of this model: "
        r"use names among k_proj, o_proj, q_proj, v_proj \(or \"all-linear\"\)\.$",
    ):
        model.add_adapter(LoraConfig(target_modules=["q_proj", "gate"]))
    torch.manual_seed(2)
    model.add_adapter(LoraConfig(r=4, lora_alpha=16, target_modules="all-linear", init_lora_weights=False))
    model.save_pretrained(tmp_path)
    back = peft.PeftModel.from_pretrained(build_hf_model("gpt-oss"), str(tmp_path)).eval()
    theirs = peft.get_peft_model(build_hf_model("gpt-oss"), peft.LoraConfig(r=4, target_modules="all-linear"))
    leaves = lambda m: sorted({n.rsplit(".", 1)[-1] for n, x in m.named_modules() if hasattr(x, "lora_A")})  # noqa: E731
    assert leaves(back) == leaves(theirs) == leaves(model) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        tol.assert_close(back(ids).logits, model(ids).logits)


# ---------------------------------------------------------------------------------------------
# the Trainer against transformers trained alike
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", NEW)
def test_trainer_steps_lose_what_transformers_loses(tiny_checkpoints, tmp_path, family):
    """Two eager steps on one batch of four right-padded rows (each step sees the same rows): the logged losses
    are transformers' before each of its steps (the second after one AdamW update, so gradients count too)."""
    from staticformers import Trainer, TrainingArguments
    from staticformers.training.data import build_rows

    path = tiny_checkpoints(family)
    g = torch.Generator().manual_seed(5)
    docs = [{"input_ids": torch.randint(3, 128, (int(n),), generator=g).tolist()} for n in (24, 17, 30, 9)]
    steps, lr = 2, 3e-3
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_length=32,
        max_steps=steps,
        learning_rate=lr,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(model=AutoModelForCausalLM.from_pretrained(path), args=args, train_dataset=docs)
    trainer.train()
    ours = [e["loss"] for e in trainer.state.log_history if "loss" in e and "train_loss" not in e]
    ref = reference_losses(
        path, build_rows(docs, None, max_length=32, packing=False).batch(list(range(4))), steps, lr, torch.device("cpu")
    )
    assert len(ours) == steps and ref[1] != ref[0]
    # logged losses are rounded to 6 decimals
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref), rtol=tol.FP32_TRAINED, atol=2e-6)


# ---------------------------------------------------------------------------------------------
# int8 weights (test_quantization.py's promise: every quantized weight within half a step of its row's
# scale, what stays exact stays exact, logits within the int8 bound)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["gemma2", "phi3", "glm4", "granite", "smollm3", "gpt-oss"])
def test_int8_weights_within_the_bound(tiny_checkpoints, family):
    from staticformers import QuantizationConfig
    from staticformers.models.moe import Experts
    from staticformers.models.quantization import QuantLinear, dequantize

    path = tiny_checkpoints(family)
    ref = AutoModelForCausalLM.from_pretrained(path)
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=QuantizationConfig("int8_weight_only"))
    checked = 0
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            pairs = [(before[f"{name}.weight"], m.weight, m.weight_scale)]
        elif isinstance(m, Experts) and m.quantized:
            pairs = [
                (before[f"{name}.gate_up_proj"], m.gate_up_proj, m.gate_up_proj_scale),
                (before[f"{name}.down_proj"], m.down_proj, m.down_proj_scale),
            ]
        else:
            continue
        for w, qw, scale in pairs:
            assert qw.dtype == torch.int8 and scale.shape == (*w.shape[:-1], 1)
            assert ((w.float() - dequantize(qw, scale, torch.float32)).abs() <= scale.float() / 2 * (1 + 1e-6)).all()
            checked += 1
    sparse = sum(ref.config.layer_is_sparse(i) for i in range(ref.config.num_hidden_layers))
    assert checked == 7 * ref.config.num_hidden_layers - sparse  # a sparse layer: 4 projections, 2 expert stacks
    params = dict(model.named_parameters())
    exact = [
        k for k in before if "embed" in k or "norm" in k or ".mlp.gate." in k or "sinks" in k or k == "lm_head.weight"
    ]
    assert exact and all(torch.equal(params[k], before[k]) for k in exact if k in params)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tol.assert_close(model(ids).logits, ref(ids).logits, rel=0.1)


# ---------------------------------------------------------------------------------------------
# speculation, chunked prefill and prefix caching through the generation loop
# ---------------------------------------------------------------------------------------------
def _run(loop, arrivals):
    """request id -> (tokens, the raw logits each was chosen from, [n, vocab])."""
    from loop_driver import run_loop_events

    return {
        rid: ([e.token for e in events], torch.stack([e.logits for e in events]))
        for rid, events in run_loop_events(loop, arrivals).items()
    }


def _assert_same_runs(got, want):
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in want.items()}
    for k in want:
        tol.assert_close(got[k][1], want[k][1])


@pytest.mark.parametrize("family", ["gemma3", "olmo2"])  # the others: test_speculative.py
def test_prompt_lookup_greedy_equals_greedy_without(tiny_checkpoints, family):
    """Prompts that repeat a span (lookup hits) and random ones, joining at different steps."""
    from staticformers.generation.speculative.prompt_lookup import PromptLookup
    from staticformers.generation.speculative.step import Speculator

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints(family))
    engine, settings = engine_for(model), compile_settings(model, EAGER_RUN)
    span = _tokens(9, 4)
    prompts = [span * 3 + span[:4], _tokens(23, 5), _tokens(6, 6) + span * 2]

    def arrivals():
        return {
            0: [GenerationRequest(p, 12, request_id=i, output_logits=True) for i, p in enumerate(prompts[:2])],
            2: [GenerationRequest(prompts[2], 8, request_id=2, output_logits=True)],
        }

    plain = _run(GenerationLoop(engine, settings), arrivals())
    spec = Speculator(PromptLookup(3))
    _assert_same_runs(_run(GenerationLoop(engine, settings, speculator=spec), arrivals()), plain)
    assert spec.num_steps > 0 and spec.num_accepted_tokens > 0  # runs of proposals kept, through the verify step


@pytest.mark.parametrize("family", ["gemma3", "olmo2", "phi3", "glm4", "granite", "smollm3"])
def test_chunked_prefill_and_prefix_caching_give_transformers_tokens(tiny_checkpoints, family):
    """A 70-token prompt against a largest prompt bucket of 32 (its rest in chunks of 16 through the extend step),
    then a prompt sharing its first 40 tokens (5 cached blocks copied in): transformers' greedy tokens for both, and
    transformers' logits over each whole sequence at every position a token was chosen (several of these tiny models
    repeat one token, which alone would prove little)."""
    path = tiny_checkpoints(family)
    model = AutoModelForCausalLM.from_pretrained(path)
    engine = engine_for(
        model,
        ShapePlan(
            batch_sizes=[1, 2], prompt_lengths=[16, 32], kv_lengths=[128], max_model_len=128, extend_widths=((16, 1),)
        ),
    )
    shared = _tokens(40, 7)
    long, second = shared + _tokens(30, 8), shared + [5, 9, 11]
    loop = GenerationLoop(
        engine, compile_settings(model, EAGER_RUN), chunked_prefill=16, prefix_caching=True, prefix_block_size=8
    )
    out = _run(
        loop,
        {
            0: [GenerationRequest(long, 8, request_id="long", output_logits=True)],
            12: [GenerationRequest(second, 8, request_id="second", output_logits=True)],
        },
    )
    assert loop.chunks > 0 and loop.prefix.hits >= 40
    hf = _hf(path)
    for rid, prompt in (("long", long), ("second", second)):
        tokens, logits = out[rid]
        assert tokens == _hf_greedy(hf, prompt, 8)
        with torch.no_grad():
            want = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
        tol.assert_close(logits, want)


# ---------------------------------------------------------------------------------------------
# the server
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "family", ["gemma3", "olmo2", "glm4", "granite", "smollm3", "gpt-oss", "deepseek-v3", "qwen3_5", "qwen3-next"]
)
def test_a_served_completion_is_the_models_greedy_text(tmp_path, family):
    pytest.importorskip("openai")
    from served_greedy import assert_served_completion_is_greedy
    from staticformers import AutoTokenizer
    from tiny import save_served

    folder = save_served(family, tmp_path, positions=128)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert_served_completion_is_greedy(model, tok, folder, "Hello there, this is a longer prompt", 8)
