"""Constrained decoding in the loop and in `generate()`: a random tiny model's sampled answers match their
JSON schema, regex, choice or grammar (only the mask can make that true); a batch mixing constrained and free,
greedy and sampled, adapter and base rows gives each row what it gets alone and compiles nothing; a bad
schema, regex or grammar is refused in one sentence."""

from __future__ import annotations

import json
import re

import pytest
import torch

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from staticformers import AutoModelForCausalLM, AutoTokenizer, CompileConfig, LoraConfig, ShapePlan  # noqa: E402
from staticformers.generation.engines import compile_settings, engine_for  # noqa: E402
from staticformers.generation.constraints import StructuredOutputs, compiler_for  # noqa: E402
from staticformers.generation.generation_config import GenerationConfig  # noqa: E402
from staticformers.generation.loop import GenerationLoop, GenerationRequest  # noqa: E402
from staticformers.generation.sampling import SamplingParams  # noqa: E402

from loop_driver import run_loop  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["cat", "dog"]},
    },
    "required": ["ok", "n", "kind"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2}"
EAGER = CompileConfig(backend="eager")
PLAN = ShapePlan(batch_sizes=[1, 8], prompt_lengths=[16], kv_lengths=[64], max_model_len=64)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tiny import save_served

    folder = save_served("qwen3", tmp_path_factory.mktemp("structured"))
    return folder, AutoTokenizer.from_pretrained(folder)


def test_generate_samples_answers_that_match_each_rows_constraint(served):
    folder, tok = served
    model = AutoModelForCausalLM.from_pretrained(folder)
    prompt = tok("Answer:", return_tensors="pt")["input_ids"].repeat(8, 1)
    specs = (
        [{"json": SCHEMA}] * 3
        + [{"regex": REGEX}, {"choice": ["yes", "no", "maybe"]}] * 2
        + [StructuredOutputs(grammar='root ::= "(" [0-9] ("+" [0-9])* ")"')]
    )
    out = model.generate(
        prompt,
        max_new_tokens=40,
        do_sample=True,
        temperature=1.0,
        seed=7,
        structured_outputs=specs,
        tokenizer=tok,
        disable_compile=True,
    )
    texts = [tok.decode(row[prompt.shape[1] :], skip_special_tokens=True) for row in out]
    for text in texts[:3]:
        jsonschema.validate(json.loads(text), SCHEMA)
    for text in (texts[3], texts[5]):
        assert re.fullmatch(REGEX, text), text
    assert texts[4] in ("yes", "no", "maybe") and texts[6] in ("yes", "no", "maybe")
    assert re.fullmatch(r"\([0-9](\+[0-9])*\)", texts[7]), texts[7]
    free = model.generate(prompt[:1], max_new_tokens=12, do_sample=True, seed=7, disable_compile=True)
    assert not re.fullmatch(r"[{}\[\]\":, a-z0-9]*", tok.decode(free[0, prompt.shape[1] :]))  # free, it is not JSON


def test_bad_constraints_are_refused_in_one_sentence(served):
    folder, tok = served
    compiler = compiler_for(tok, len(tok))
    with pytest.raises(ValueError, match=r"structured_outputs\.regex is not valid: .*unclosed group"):
        compiler.compile(StructuredOutputs(regex="(a"))
    with pytest.raises(ValueError, match=r"structured_outputs\.json is not valid: .*objectx"):
        compiler.compile(StructuredOutputs(json={"type": "objectx"}))
    with pytest.raises(ValueError, match=r"structured_outputs\.grammar is not valid"):
        compiler.compile(StructuredOutputs(grammar="root ::= undefined_rule"))
    with pytest.raises(ValueError, match="exactly one of"):
        compiler.compile(StructuredOutputs(regex="a", choice=["a"]))
    model = AutoModelForCausalLM.from_pretrained(folder)
    with pytest.raises(ValueError, match="pass tokenizer="):
        model.generate(torch.tensor([[5, 6]]), max_new_tokens=2, structured_outputs={"regex": "a+"})
    loop = GenerationLoop(engine_for(model), compile_settings(model, GenerationConfig(), EAGER))
    with pytest.raises(ValueError, match="vocabulary of 999 ids"):
        loop.validate(
            GenerationRequest([5], 2, structured_outputs=compiler_for(tok, 999).compile(StructuredOutputs(regex="a+")))
        )


def save_adapter(path, folder):
    model = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(3)
    model.add_adapter(
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    )
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(4.0)
    model.save_pretrained(folder)
    return str(folder)


@pytest.mark.slow
def test_a_mixed_batch_gives_each_row_its_solo_tokens_and_compiles_nothing(served, tmp_path, monkeypatch):
    from torch._dynamo.utils import counters

    monkeypatch.setenv("STATICFORMERS_STRICT_SHAPES", "1")
    folder, tok = served
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.load_adapter(save_adapter(folder, tmp_path / "a"), adapter_name="a")
    model.enable_adapter_batching(max_adapters=2)
    engine = engine_for(model, PLAN)
    settings = compile_settings(model, GenerationConfig(), EAGER)
    engine.precompile(settings)
    compiler = compiler_for(tok, model.config.vocab_size)
    schema, regex = compiler.compile(StructuredOutputs(json=SCHEMA)), compiler.compile(StructuredOutputs(regex=REGEX))
    eos = (tok.eos_token_id,)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, len(tok), (n,), generator=gen).tolist() for n in (5, 9, 3, 12, 7, 6, 10)]

    def request(i):
        sampled = SamplingParams(do_sample=True, temperature=1.0, seed=100 + i, eos_token_ids=eos)
        greedy = SamplingParams(eos_token_ids=eos)
        kinds = [
            (schema, greedy, None),
            (schema, sampled, None),
            (None, greedy, None),
            (None, sampled, None),
            (regex, sampled, "a"),
            (None, greedy, "a"),
            (regex, greedy, "__base__"),
        ]
        grammar, params, adapter = kinds[i]
        return GenerationRequest(prompts[i], 48, params, request_id=i, adapter=adapter, structured_outputs=grammar)

    alone = {i: run_loop(GenerationLoop(engine, settings), {0: [request(i)]})[i] for i in range(7)}
    jsonschema.validate(json.loads(tok.decode(alone[1], skip_special_tokens=True)), SCHEMA)
    assert re.fullmatch(REGEX, tok.decode(alone[4], skip_special_tokens=True))
    counters.clear()
    together = run_loop(
        GenerationLoop(engine, settings), {0: [request(i) for i in range(4)], 2: [request(i) for i in range(4, 7)]}
    )
    assert together == alone
    assert counters["stats"]["unique_graphs"] == 0


def test_a_grammar_that_waits_for_a_token_leaves_the_tokens_before_it_free(served):
    """What a reasoning parser asks (`Grammar.waiting_for("</think>")`): up to and including the token the row
    is free, as if unconstrained; after it, the grammar holds."""
    folder, tok = served
    model = AutoModelForCausalLM.from_pretrained(folder)
    engine = engine_for(model, PLAN)
    settings = compile_settings(model, GenerationConfig(), EAGER)
    params = SamplingParams(do_sample=True, temperature=1.0, seed=11)
    free = run_loop(GenerationLoop(engine, settings), {0: [GenerationRequest([5, 6, 7], 40, params, request_id=0)]})[0]
    k = 4
    while free[k] in free[:k]:  # the first occurrence of the token at k is where the grammar starts
        k += 1
    grammar = compiler_for(tok, model.config.vocab_size).compile(StructuredOutputs(regex=REGEX)).waiting_for(free[k])
    params = SamplingParams(do_sample=True, temperature=1.0, seed=11)
    got = run_loop(
        GenerationLoop(engine, settings),
        {0: [GenerationRequest([5, 6, 7], 40, params, request_id=0, structured_outputs=grammar)]},
    )[0]
    assert got[: k + 1] == free[: k + 1]
    assert re.fullmatch(REGEX, tok.decode(got[k + 1 :], skip_special_tokens=True))


def test_a_choice_of_thousands_of_strings_constrains_every_token(served):
    """llguidance refuses a parser row of more than 2000 items when the first token is masked ("Current row
    has 4760 items"), so a `choice` is one terminal: 4,759 strings answer one of them, whole."""
    folder, tok = served
    choices = [f"item{i}" for i in range(4759)]
    model = AutoModelForCausalLM.from_pretrained(folder)
    prompt = tok("Answer:", return_tensors="pt")["input_ids"]
    out = model.generate(
        prompt,
        max_new_tokens=12,
        do_sample=True,
        temperature=1.0,
        seed=3,
        structured_outputs=[{"choice": choices}],
        tokenizer=tok,
        disable_compile=True,
    )
    assert tok.decode(out[0, prompt.shape[1] :], skip_special_tokens=True) in choices


def test_without_llguidance_a_constraint_is_refused_in_one_sentence(served, monkeypatch):
    import sys

    folder, _ = served
    monkeypatch.setitem(sys.modules, "llguidance", None)  # as if not installed
    fresh = AutoTokenizer.from_pretrained(folder)  # no compiler cached for it
    with pytest.raises(
        ValueError,
        match=r"^Constrained decoding needs the llguidance package, which is not installed: "
        r"pip install 'staticformers\[structured\]'\.$",
    ):
        compiler_for(fresh, len(fresh))


def test_unpack_reads_bit_v_and_31_of_word_v_shift_5():
    from staticformers.generation.constraints import unpack

    mask = torch.randint(-(2**31), 2**31 - 1, (3, 5), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    want = torch.tensor([[(int(mask[r, v >> 5]) >> (v & 31)) & 1 for v in range(150)] for r in range(3)]).bool()
    assert torch.equal(unpack(mask, 150, torch.device("cpu")), want)


def test_a_speculating_loop_decodes_constrained_rows_exactly_and_speculates_the_free_ones(served):
    """A row with a grammar proposes nothing and takes its one token per step at position 0 under its mask,
    drawing what a decode step draws, so constrained rows are exactly what they are without speculation;
    free rows of the same steps speculate (with prompt lookup, greedy output is the output without it)."""
    from staticformers.generation.speculative.prompt_lookup import PromptLookup
    from staticformers.generation.speculative.step import Speculator

    folder, tok = served
    model = AutoModelForCausalLM.from_pretrained(folder)
    engine = engine_for(model, PLAN)
    settings = compile_settings(model, GenerationConfig(), EAGER)
    schema = compiler_for(tok, model.config.vocab_size).compile(StructuredOutputs(json=SCHEMA))
    eos = (tok.eos_token_id,)
    repeated = [5, 6, 7, 8] * 3

    def requests():
        sampled = SamplingParams(do_sample=True, temperature=1.0, seed=3, eos_token_ids=eos)
        return [
            GenerationRequest(repeated, 40, sampled, request_id=0, structured_outputs=schema),
            GenerationRequest(repeated, 24, SamplingParams(eos_token_ids=eos), request_id=1),
        ]

    plain = run_loop(GenerationLoop(engine, settings), {0: requests()[:1], 1: requests()[1:]})
    spec = Speculator(PromptLookup(3))
    fast = run_loop(GenerationLoop(engine, settings, speculator=spec), {0: requests()[:1], 1: requests()[1:]})
    assert fast == plain
    jsonschema.validate(json.loads(tok.decode(fast[0], skip_special_tokens=True)), SCHEMA)
    alone = run_loop(GenerationLoop(engine, settings, speculator=Speculator(PromptLookup(3))), {0: requests()[1:]})
    assert alone[1] == plain[1]
