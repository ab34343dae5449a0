"""Generation with adapters, unmerged: the compiled engine runs a model with an active adapter; one batch mixes
rows of two adapters and of none (stacked weights and a per-row index), each row's greedy tokens equal to its
own model's solo run (the adapter merged into a copy); after warm-up nothing compiles, not even when another
adapter of the same rank is loaded (into the bank, or over a named adapter)."""

from __future__ import annotations

import pytest
import torch

from staticformers import AutoModelForCausalLM, CompileConfig, LoraConfig, ShapePlan
from staticformers.adapters.bank import AdapterBankError, bank_of
from staticformers.generation.engines import compile_settings, engine_for
from staticformers.generation.generation_config import GenerationConfig
from staticformers.generation.loop import GenerationLoop, GenerationRequest

from loop_driver import run_loop

pytestmark = pytest.mark.usefixtures("one_thread")

EAGER = CompileConfig(backend="eager")
ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PLAN = ShapePlan(batch_sizes=[1, 2, 4], prompt_lengths=[8, 16], kv_lengths=[32], max_model_len=32)


def prompts(lengths, seed=0, vocab=128):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def save_adapter(path, folder, seed, r):
    """An adapter with random A and B (a visible effect on every projection), saved."""
    model = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(seed)
    model.add_adapter(LoraConfig(r=r, lora_alpha=2 * r, target_modules=ALL7, init_lora_weights=False))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(4.0)  # large enough that greedy tokens differ from the base's
    model.save_pretrained(folder)
    return str(folder)


def solo(path, adapter, prompt, n):
    """Greedy tokens of one prompt on the base with `adapter` merged (None: the base), not compiled, alone."""
    model = AutoModelForCausalLM.from_pretrained(path)
    if adapter is not None:
        model.load_adapter(adapter)
        model.merge_and_unload()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, eos_token_id=None, disable_compile=True)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def adapters(tiny_checkpoints, tmp_path_factory):
    path = tiny_checkpoints("qwen3")
    root = tmp_path_factory.mktemp("adapters")
    return path, {
        "a": save_adapter(path, root / "a", 1, 4),
        "b": save_adapter(path, root / "b", 2, 8),
        "c": save_adapter(path, root / "c", 3, 4),
    }


@pytest.mark.slow
def test_a_mixed_batch_gives_each_row_its_own_models_tokens_and_compiles_nothing(adapters, monkeypatch):
    from torch._dynamo.utils import counters

    monkeypatch.setenv("STATICFORMERS_STRICT_SHAPES", "1")
    path, folders = adapters
    model = AutoModelForCausalLM.from_pretrained(path)
    model.load_adapter(folders["a"], adapter_name="a")
    model.load_adapter(folders["b"], adapter_name="b")  # rank 8 beside a's 4: zero-padded in the bank
    bank = model.enable_adapter_batching(max_adapters=3)
    engine = engine_for(model, PLAN)
    settings = compile_settings(model, GenerationConfig(), EAGER)
    engine.precompile(settings)
    rows = prompts([5, 12, 3, 9, 14, 7], seed=1)
    names = ["a", "__base__", "b", None, "b", "a"]  # None: the model as it is, its active adapter ("a")
    answers = [6, 9, 4, 8, 5, 7]
    expected = {
        i: solo(path, folders["a" if n is None else n] if n != "__base__" else None, rows[i], answers[i])
        for i, n in enumerate(names)
    }
    assert expected[0] != solo(path, None, rows[0], answers[0])  # the adapters change the tokens
    later = {
        "c": solo(path, folders["c"], rows[0], 6),
        "b": solo(path, folders["b"], rows[1], 6),
        0: solo(path, folders["c"], rows[2], 5),
    }
    counters.clear()  # the solo runs above compile their own models' graphs
    loop = GenerationLoop(engine, settings)
    got = run_loop(
        loop,
        {
            0: [GenerationRequest(rows[i], answers[i], request_id=i, adapter=names[i]) for i in range(4)],
            3: [GenerationRequest(rows[i], answers[i], request_id=i, adapter=names[i]) for i in (4, 5)],
        },
    )
    assert got == expected
    assert counters["stats"]["unique_graphs"] == 0

    # another adapter of rank <= the bank's, put into a free slot: in place, nothing compiles
    bank.load("c", folders["c"])
    got = run_loop(
        GenerationLoop(engine, settings),
        {
            0: [
                GenerationRequest(rows[0], 6, request_id="c", adapter="c"),
                GenerationRequest(rows[1], 6, request_id="b", adapter="b"),
            ]
        },
    )
    assert got == {"c": later["c"], "b": later["b"]}
    # loaded over named adapter "a" (same modules, same rank): its tensors and its bank slot, in place
    model.load_adapter(folders["c"], adapter_name="a")
    got = run_loop(GenerationLoop(engine, settings), {0: [GenerationRequest(rows[2], 5, request_id=0, adapter="a")]})
    assert got == {0: later[0]}
    assert counters["stats"]["unique_graphs"] == 0


def test_generate_with_adapter_names_batches_peft_style(adapters):
    path, folders = adapters
    model = AutoModelForCausalLM.from_pretrained(path)
    model.load_adapter(folders["a"], adapter_name="a")
    model.load_adapter(folders["b"], adapter_name="b")
    rows = prompts([6, 6, 6], seed=2)
    out = model.generate(
        torch.tensor(rows),
        adapter_names=["b", "__base__", "a"],
        max_new_tokens=5,
        eos_token_id=None,
        compile_config=EAGER,
    )
    assert out[0, 6:].tolist() == solo(path, folders["b"], rows[0], 5)
    assert out[1, 6:].tolist() == solo(path, None, rows[1], 5)
    assert out[2, 6:].tolist() == solo(path, folders["a"], rows[2], 5)
    with pytest.raises(AdapterBankError, match="adapter_names asks for 'zz'"):
        model.generate(torch.tensor(rows), adapter_names=["a", "zz", "a"], max_new_tokens=2)
    with pytest.raises(ValueError, match="one adapter name per row"):
        model.generate(torch.tensor(rows), adapter_names=["a"], max_new_tokens=2)


@pytest.mark.slow
def test_generate_runs_the_active_adapter_unmerged_and_follows_switches(adapters):
    """The engine with named adapters (no bank): the active one, disabled, another: each equals its merged model."""
    path, folders = adapters
    model = AutoModelForCausalLM.from_pretrained(path)
    model.load_adapter(folders["a"], adapter_name="a")
    model.load_adapter(folders["c"], adapter_name="c")
    prompt = prompts([7], seed=3)[0]

    def greedy():
        return model.generate(torch.tensor([prompt]), max_new_tokens=6, eos_token_id=None, compile_config=EAGER)[
            0, 7:
        ].tolist()

    assert greedy() == solo(path, folders["a"], prompt, 6)
    model.set_adapter("c")
    assert greedy() == solo(path, folders["c"], prompt, 6)
    model.disable_adapters()
    assert greedy() == solo(path, None, prompt, 6)


def test_requests_for_adapters_the_model_lacks_are_refused_before_any_work(adapters):
    path, folders = adapters
    model = AutoModelForCausalLM.from_pretrained(path)
    engine = engine_for(model, PLAN)
    loop = GenerationLoop(engine, compile_settings(model, GenerationConfig(), EAGER))
    with pytest.raises(ValueError, match="batches no adapters: load them and call model.enable_adapter_batching"):
        loop.add(GenerationRequest([1, 2, 3], 2, adapter="a"))
    model.load_adapter(folders["a"], adapter_name="a")
    bank = model.enable_adapter_batching()
    with pytest.raises(AdapterBankError, match="no adapter named 'nope' here \\(the adapters are 'a'\\)"):
        loop.add(GenerationRequest([1, 2, 3], 2, adapter="nope"))
    with pytest.raises(AdapterBankError, match="holds 1 adapter\\(s\\) \\('a'\\) and is full"):
        bank.load("c", folders["c"])
    assert loop.idle and bank_of(model) is bank
    small = model.enable_adapter_batching(max_adapters=2, max_rank=4)
    with pytest.raises(AdapterBankError, match="rank 8 .* more than the bank's 4"):
        small.load("b", folders["b"])


@pytest.mark.inductor
@pytest.mark.slow
def test_the_cpus_compiled_formulations_add_the_adapter(adapters):
    """Real inductor, the device's defaults: on the CPU a batch-1 decode computes its projections as weight-
    streaming reductions; a LoRA layer's base goes that way and its adapter is added: the merged model's tokens."""
    path, folders = adapters
    model = AutoModelForCausalLM.from_pretrained(path)
    model.load_adapter(folders["a"])
    prompt = prompts([9], seed=4)[0]
    out = model.generate(torch.tensor([prompt]), max_new_tokens=6, eos_token_id=None)
    assert out[0, 9:].tolist() == solo(path, folders["a"], prompt, 6)
    if model.device.type == "cpu":
        assert any(getattr(ops, "linears", None) == "reduce" for ops in engine_for(model).steps.memo.values())
