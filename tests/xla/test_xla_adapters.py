"""Adapter rows on XLA: a batch mixing a LoRA adapter's rows with the base model's gives each row the tokens
of its own model (the adapter merged, on the CPU), and once warm a second pass compiles nothing."""

from __future__ import annotations

import pytest

pytest.importorskip("torch_xla", reason="torch_xla is not installed here: `make test-xla` runs these in its own venv")

import torch  # noqa: E402

from staticformers import AutoModelForCausalLM, LoraConfig  # noqa: E402
from staticformers.generation.engines import compile_settings, engine_for  # noqa: E402
from staticformers.backends.xla import runtime  # noqa: E402
from staticformers.generation.generation_config import GenerationConfig  # noqa: E402
from staticformers.generation.loop import GenerationLoop, GenerationRequest  # noqa: E402

from xla_support import plan  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def cpu_tokens(path, adapter, prompt, n):
    model = AutoModelForCausalLM.from_pretrained(path)
    if adapter is not None:
        model.load_adapter(adapter)
        model.merge_and_unload()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, eos_token_id=None, disable_compile=True)
    return out[0, len(prompt) :].tolist()


def test_mixed_adapter_rows_on_xla(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints("qwen3")
    source = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(1)
    source.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))
    with torch.no_grad():
        for n, p in source.named_parameters():
            if "lora_B" in n:
                p.mul_(4.0)
    source.save_pretrained(str(tmp_path / "a"))
    adapter = str(tmp_path / "a")

    model = AutoModelForCausalLM.from_pretrained(path, device_map="xla")
    model.load_adapter(adapter, adapter_name="a")
    model.enable_adapter_batching(max_adapters=2)
    engine = engine_for(model, plan())
    loop = GenerationLoop(engine, compile_settings(model, GenerationConfig()))
    prompts = [[5, 9, 11], [7, 3, 8, 21, 4], [30, 2], [12, 13, 14, 15]]
    names = ["a", "__base__", "a", "__base__"]
    want = [cpu_tokens(path, adapter if n == "a" else None, p, 6) for p, n in zip(prompts, names)]
    assert want[0] != cpu_tokens(path, None, prompts[0], 6)  # the adapter changes the tokens

    def run():
        for i, (p, n) in enumerate(zip(prompts, names)):
            loop.add(GenerationRequest(p, 6, request_id=i, adapter=n))
        out: dict = {}
        while not loop.idle:
            for e in loop.step():
                assert e.error is None, e.error
                out.setdefault(e.request_id, []).append(e.token)
        return [out[i] for i in range(len(prompts))]

    assert run() == want
    before = runtime.counters()
    assert run() == want
    assert (runtime.counters() - before).uncached_compiles == 0
