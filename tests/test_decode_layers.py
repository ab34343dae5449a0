"""decode_layers.py's `bf16_decode_layers`: a warm bf16 decode step's layers in one operator call.

Checked: a tiny model's decode steps run it once a step (the first, guarded one and a prefill's last row too, so
no decode step compiles a layer region), with the tokens and logits of the same loop with it turned off, for plain attention,
grouped KV heads, a sliding window, q/k norms per head (Qwen3) and q/k/v biases (Qwen2); the models, caches and
settings it leaves to the regions (norms over the whole projection or after the sub-layers, Gemma's norms, a mixture of experts, partial rotary, float32, block caches, LoRA, hooks, a wanted
gradient, other formulations, the switch); the keys and values it writes into the cache are the regions'; bad
input refused in one sentence."""

from __future__ import annotations

import pytest
import torch

from staticformers import AutoModelForCausalLM, CompileConfig, QuantizationConfig, ShapePlan
from staticformers.backends.cpu import decode_layers as d
from staticformers.backends.cpu import formulations as f
from staticformers.generation.engines import compile_settings, engine_for
from staticformers.generation.generation_config import GenerationConfig
from staticformers.generation.loop import GenerationLoop, GenerationRequest
from staticformers.models.kv_cache import KVCache

pytestmark = pytest.mark.usefixtures("one_thread", "kernel")
STREAM = f.CPUOps("kernel", "stream", "stream")
PAGED = f.CPUOps(
    "reduce", "stream", "stream"
)  # a block cache's decode formulation (the regions' attention reads the pool)
EAGER = CompileConfig(backend="eager")


@pytest.fixture(scope="module")
def kernel():
    """Built (or read from inductor's cache) when a test of this file runs, not when it is collected."""
    if not d.loaded():
        pytest.skip("the CPU kernels cannot be built here (no C++ compiler, or no AVX2/AVX-512 for inductor)")


def count_stacks(monkeypatch) -> list:
    """Patch the steps' builder: each built stack's calls are appended as (rows, first layer), a refused one
    appends nothing."""
    calls: list = []
    real = d.layers_stack

    def counting(model, cache, ops, x, start=0):
        stack = real(model, cache, ops, x, start)
        if stack is None:
            return None

        def counted(x, *rest):
            out = stack(x, *rest)
            if out is not None:
                calls.append((x.shape[0], start))
            return out

        return counted

    monkeypatch.setattr(d, "layers_stack", counting)
    return calls


def tokens(n: int, seed: int, vocab: int = 128) -> list:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture
def streaming_decode(monkeypatch):
    """Decode steps take the streaming formulation under the eager backend too (inductor picks it; compiling
    with inductor here would cost a real compile per shape), prefills the modules' own path."""
    from staticformers.backends import cpu

    monkeypatch.setattr(
        cpu.CPUStepBuilder,
        "ops",
        lambda self, kind, batch, settings, blocks=False: (
            (PAGED if blocks else STREAM) if kind == "decode" else f.PLAIN_CPU
        ),
    )


INT8 = QuantizationConfig("int8_weight_only")


def run(path: str, prompts: list, new: int, steps: list | None = None, quantization=None, blocks=None) -> dict:
    """Each prompt's (tokens, logits) from a bf16 model's loop (its weights quantized by `quantization`; on a pool of
    `blocks` blocks of 8 positions, else static caches), the prompts joining together; `steps` gets the engine's
    decode steps."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=quantization)
    plan = ShapePlan(batch_sizes=[1, 2, 4], prompt_lengths=[16, 32], kv_lengths=[64], extend_widths=((16, 1),))
    engine = engine_for(model, plan) if blocks else engine_for(model)
    settings = compile_settings(model, GenerationConfig(), EAGER)
    loop = GenerationLoop(engine, settings, kv_blocks=blocks, kv_block_size=8, chunked_prefill=16 if blocks else None)
    for i, p in enumerate(prompts):
        loop.add(GenerationRequest(p, new, request_id=i, output_logits=True))
    out: dict = {i: ([], []) for i in range(len(prompts))}
    with torch.no_grad():
        while not loop.idle:
            for event in loop.step():
                assert event.error is None, event.error
                out[event.request_id][0].append(event.token)
                out[event.request_id][1].append(event.logits.float())
    if steps is not None:
        steps += [g.step for k, g in engine.graphs.items() if k[0] == "decode" and g.settings.enabled]
    if blocks:
        assert loop.blocks_used == 0
    return {i: (t, torch.stack(logits)) for i, (t, logits) in out.items()}


@pytest.mark.parametrize("family", ["llama", "mistral-window", "qwen3", "qwen2"])
@pytest.mark.usefixtures("streaming_decode")
def test_every_decode_step_runs_every_layer_in_one_call_with_the_regions_tokens_and_logits(
    tiny_checkpoints, family, monkeypatch
):
    """Three prompts (5, 11 and 20 tokens) decoding 12 tokens together: every decode step is one call, the first
    (guarded) one included, and so is each prefill's last row (the last layer alone), so no decode step compiles
    a layer region; tokens and logits equal the loop's with the operator off, within bf16's rounding of a 2-layer
    model (RoPE rounded once where eager rounds three times), the tokens up to a near-tie (`same_greedy`). A tiny
    random model's logits barely move with its attention, so the keys and values are checked on their own below."""
    prompts = [tokens(5, 1), tokens(11, 2), tokens(20, 3)]
    path = tiny_checkpoints(family)
    calls = count_stacks(monkeypatch)
    steps: list = []
    fused = run(path, prompts, 12, steps)
    whole = [rows for rows, start in calls if start == 0]
    last = [rows for rows, start in calls if start == 1]  # the tiny models have 2 layers
    assert len(whole) >= 11 and set(whole) <= {1, 2, 4} and len(calls) == len(whole) + len(last)
    assert last  # the prompts' last rows (prompts prefilled together finish in one call)
    assert steps and all(step.stacked and step.graphs == 1 for step in steps)  # `prepare` alone
    assert all(p.graphs == 0 for step in steps for p in step.layer.values())
    monkeypatch.setenv("STATICFORMERS_DECODE_LAYERS", "0")
    before = len(calls)
    steps = []
    plain = run(path, prompts, 12, steps)
    assert len(calls) == before
    assert all(not step.stacked and step.graphs == 1 + len(step.layer) for step in steps)
    for i in range(len(prompts)):
        same_greedy(fused[i], plain[i])


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2"])
@pytest.mark.usefixtures("streaming_decode")
def test_an_int8_model_decodes_one_row_in_one_call_with_the_regions_tokens_and_logits(
    tiny_checkpoints, family, monkeypatch
):
    """Weight-only int8 projections (Qwen2's biases kept in bf16): a lone prompt's decode steps (one row, what the
    streaming int8 kernel takes) run every layer in one call, with the tokens and logits of the regions within
    bf16's rounding; two prompts together decode two rows, which the regions run (ATen's int8 kernel)."""
    path, prompt = tiny_checkpoints(family), [tokens(9, 6)]
    calls = count_stacks(monkeypatch)
    steps: list = []
    fused = run(path, prompt, 12, steps, INT8)
    assert [rows for rows, start in calls if start == 0] == [1] * 11 and (1, 1) in calls
    assert steps and all(step.stacked and step.graphs == 1 for step in steps)
    monkeypatch.setenv("STATICFORMERS_DECODE_LAYERS", "0")
    before = len(calls)
    plain = run(path, prompt, 12, None, INT8)
    assert len(calls) == before
    same_greedy(fused[0], plain[0])
    monkeypatch.delenv("STATICFORMERS_DECODE_LAYERS")
    steps = []
    run(path, [tokens(9, 6), tokens(4, 7)], 6, steps, INT8)
    assert len(calls) == before  # nor their prefill's last rows (two)
    assert steps and not any(step.stacked for step in steps)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.usefixtures("streaming_decode")
def test_block_caches_decode_in_one_call_with_the_regions_tokens_and_logits(tiny_checkpoints, family, monkeypatch):
    """On a pool of 8-position blocks (prompts chunked, their blocks spread over the pool as rows join and leave),
    every decode step is one call that writes and reads each row's blocks through the table, with the tokens and
    logits of the regions (which write, gather and attend by reductions) within bf16's rounding."""
    prompts = [tokens(5, 1), tokens(23, 2), tokens(12, 3)]
    path = tiny_checkpoints(family)
    calls = count_stacks(monkeypatch)
    steps: list = []
    fused = run(path, prompts, 14, steps, blocks=24)
    assert len([c for c in calls if c[1] == 0]) >= 13
    decode = [step for step in steps if type(step.cache).__name__ == "BlockKVCache"]
    assert decode and all(step.stacked and step.graphs == 1 for step in decode)
    monkeypatch.setenv("STATICFORMERS_DECODE_LAYERS", "0")
    plain = run(path, prompts, 14, None, blocks=24)
    for i in range(len(prompts)):
        same_greedy(fused[i], plain[i])


@pytest.mark.usefixtures("streaming_decode")
def test_an_int8_model_on_block_caches_decodes_one_row_in_one_call(tiny_checkpoints, monkeypatch):
    """Weight-only int8 (Qwen2's biases kept) over a pool of 8-position blocks, one prompt chunked: every decode step
    and the last chunk's row run the one call through the table, with the regions' tokens and logits."""
    path, prompt = tiny_checkpoints("qwen2"), [tokens(23, 2)]
    calls = count_stacks(monkeypatch)
    steps: list = []
    fused = run(path, prompt, 14, steps, INT8, blocks=24)
    assert len([c for c in calls if c[1] == 0]) >= 13 and all(rows == 1 for rows, _ in calls)
    assert steps and all(step.stacked for step in steps if type(step.cache).__name__ == "BlockKVCache")
    monkeypatch.setenv("STATICFORMERS_DECODE_LAYERS", "0")
    same_greedy(fused[0], run(path, prompt, 14, None, INT8, blocks=24)[0])


def same_greedy(got: tuple, want: tuple, rtol: float = 2**-6, atol: float = 2**-7) -> None:
    """Two greedy runs' (tokens, logits) agree within bf16's rounding: the logits close up to and including the
    first token where they part, and there the two tokens' logits were within the tolerance of each other (a
    near-tie that two roundings may break either way); past it the contexts differ, so nothing is compared."""
    (tokens_got, logits_got), (tokens_want, logits_want) = got, want
    n = next((j for j, (a, b) in enumerate(zip(tokens_got, tokens_want)) if a != b), len(tokens_want))
    torch.testing.assert_close(logits_got[: n + 1], logits_want[: n + 1], rtol=rtol, atol=atol)
    if n < len(tokens_want):
        a, b = logits_want[n, tokens_want[n]], logits_want[n, tokens_got[n]]
        assert a - b <= 2 * (atol + rtol * a.abs()), (n, a, b)


@pytest.mark.usefixtures("streaming_decode")
def test_a_step_that_ran_the_one_call_runs_its_regions_while_the_switch_is_off(tiny_checkpoints, monkeypatch):
    """The switch turned off between two calls of a warm step (what a global hook does too; the loop's steps run
    without a gradient): the step compiles and runs its layer regions from then on, with the greedy tokens of a run
    that never used the one call; turned on again, the one call runs again."""
    path, prompt = tiny_checkpoints("llama"), tokens(9, 5)
    calls = count_stacks(monkeypatch)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    engine = engine_for(model)
    loop = GenerationLoop(engine, compile_settings(model, GenerationConfig(), EAGER))
    loop.add(GenerationRequest(prompt, 24, request_id=0))
    got: list = []
    with torch.no_grad():
        while not loop.idle:
            if len(got) in (3, 15):  # off after 3 tokens, on again after 15
                monkeypatch.setenv("STATICFORMERS_DECODE_LAYERS", "0" if len(got) == 3 else "1")
                seen = len(calls)
            for event in loop.step():
                assert event.error is None, event.error
                got.append(event.token)
            if 3 < len(got) <= 15:
                assert len(calls) == seen, len(got)
    (step,) = [g.step for k, g in engine.graphs.items() if k[0] == "decode" and g.settings.enabled]
    assert step.stacked and all(p.graphs == 1 for p in step.layer.values())  # compiled when the switch went off
    assert len(calls) > seen  # on again: the one call
    monkeypatch.setenv("STATICFORMERS_DECODE_LAYERS", "0")
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    want = plain.generate(torch.tensor([prompt]), max_new_tokens=24, compile_config=EAGER, do_sample=False)
    assert got == want[0, len(prompt) :].tolist()


def stack_for(model, cache=None, ops=STREAM, rows: int = 1):
    cache = cache if cache is not None else KVCache.for_model(model, rows, 32)
    return d.layers_stack(model, cache, ops, torch.zeros(rows, 1, model.config.hidden_size, dtype=model.dtype))


@pytest.mark.parametrize(
    "family, overrides",
    [
        ("olmo2", {}),  # q/k norms over the whole projection, norms after the sub-layers
        ("gemma3", {}),  # Gemma's offset norms and sandwich norms, local RoPE tables
        ("gemma2", {}),  # offset norms, soft caps, sandwich norms
        ("mixtral", {}),  # a mixture of experts
        ("llama", {"partial_rotary_factor": 0.5}),
        ("granite", {}),  # residual and attention multipliers
    ],
)
def test_models_whose_layers_are_not_the_operators_math_run_their_regions(tiny_checkpoints, family, overrides):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints(family, **overrides), dtype=torch.bfloat16)
    with torch.no_grad():
        assert stack_for(model) is None


def test_caches_inputs_and_settings_the_operator_does_not_take_run_the_regions(tiny_checkpoints, monkeypatch):
    """float32 weights, a float32 cache, a latent block pool, a pool whose window layers are a group of their own, linears or attention other than `"stream"` and `"kernel"`
    (`"reduce"` on a block cache),
    too many rows, a hook, a LoRA projection, a wanted gradient and `STATICFORMERS_DECODE_LAYERS=0`: None."""
    from staticformers.adapters.lora import LoraLinear
    from staticformers.models.block_kv_cache import BlockKVCache, KVBlocks

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("llama"), dtype=torch.bfloat16)
    c = model.config
    with torch.no_grad():
        assert stack_for(model) is not None
        full = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("llama"))
        assert stack_for(full) is None
        fp32_cache = KVCache(c.num_hidden_layers, 1, c.num_key_value_heads, 32, c.head_dim, torch.float32, "cpu")
        assert stack_for(model, fp32_cache) is None
        pool = KVBlocks(c.num_hidden_layers, 4, 16, c.num_key_value_heads, c.head_dim, torch.bfloat16, "cpu")
        assert stack_for(model, BlockKVCache(pool, 1, 32), ops=PAGED) is not None
        assert stack_for(model, BlockKVCache(pool, 1, 32)) is None  # a block cache's regions attend by reductions
        latent = KVBlocks(c.num_hidden_layers, 4, 16, 1, c.head_dim, torch.bfloat16, "cpu", latent=c.head_dim // 2)
        assert stack_for(model, BlockKVCache(latent, 1, 32), ops=PAGED) is None
        grouped = KVBlocks(
            c.num_hidden_layers, 4, 16, c.num_key_value_heads, c.head_dim, torch.bfloat16, "cpu", window=((1,), 2)
        )
        assert stack_for(model, BlockKVCache(grouped, 1, 32), ops=PAGED) is None  # a window group's second table
        assert stack_for(model, ops=f.CPUOps("kernel", "reduce", "reduce")) is None
        assert stack_for(model, ops=f.CPUOps("reduce", "stream", "stream")) is None
        assert stack_for(model, rows=f.BF16_GEMV_MAX_ROWS + 1) is None
        attn = model.model.layers[1].self_attn
        handle = attn.register_forward_hook(lambda m, i, o: o)
        assert stack_for(model) is None
        handle.remove()
        real = attn.v_proj
        attn.v_proj = LoraLinear(real)
        assert stack_for(model) is None
        attn.v_proj = real
        monkeypatch.setenv("STATICFORMERS_DECODE_LAYERS", "0")
        assert stack_for(model) is None
        monkeypatch.delenv("STATICFORMERS_DECODE_LAYERS")
        assert stack_for(model) is not None
    with torch.enable_grad():
        assert stack_for(model) is None


def test_int8_layers_the_operator_does_not_take_run_the_regions(tiny_checkpoints):
    """Weight-only int8: one row runs it; two rows (past the streaming int8 kernel's one), a layer left in bf16 among
    int8 ones (each layer one kind or the other, the operator takes one kind for all), a layer's attention in bf16 and
    every layer's down projection in bf16: None."""
    path = tiny_checkpoints("llama")
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=INT8)
        assert stack_for(model) is not None
        assert stack_for(model, rows=2) is None
        attention = [f"layers.1.self_attn.{p}_proj" for p in "qkvo"]
        for kept in (attention + [f"layers.1.mlp.{p}_proj" for p in ("gate", "up", "down")], attention, ["down_proj"]):
            config = QuantizationConfig("int8_weight_only", modules_to_not_convert=[*kept, "lm_head"])
            mixed = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=config)
            assert stack_for(mixed) is None


def twin_caches(model, rows: int) -> list:
    """Two static caches of `rows` rows and 32 positions, filled alike at random (seed 0)."""
    torch.manual_seed(0)
    caches = [KVCache.for_model(model, rows, 32) for _ in range(2)]
    for i in range(model.config.num_hidden_layers):
        for t in (caches[0].keys[i], caches[0].values[i]):
            t.normal_()
        caches[1].keys[i].copy_(caches[0].keys[i])
        caches[1].values[i].copy_(caches[0].values[i])
    return caches


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2"])
def test_the_cache_holds_the_keys_and_values_the_regions_write(tiny_checkpoints, family):
    """One decode step of two rows at positions 6 and 9 over caches filled alike: the operator writes each row's
    keys and values at its position, as the model's layers (the regions' code) do, within bf16's rounding, and
    nothing else in the cache changes; the hidden states agree the same way."""
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints(family), dtype=torch.bfloat16)
    caches = twin_caches(model, 2)
    before = [k.clone() for k in caches[0].keys]
    ids, positions = torch.tensor([[7], [40]]), torch.tensor([[6], [9]])
    with torch.no_grad():
        decoder = model.model
        x, cos, sin, masks = decoder.prepare(ids, None, positions, caches[0].layer_views()[0])
        stacked = stack_for(model, caches[0], rows=2)(x, cos, sin, masks, positions)
        h = x
        for layer, kv in zip(decoder.layers, caches[1].layer_views()):
            h = layer(h, cos, sin, masks, kv, positions, STREAM)
    torch.testing.assert_close(stacked.float(), h.float(), rtol=2**-6, atol=2**-6)
    for i in range(model.config.num_hidden_layers):

        def written(t):
            return torch.stack([t[0, :, 6], t[1, :, 9]])

        # the first layer's values are its projection's (and its bias's), bit for bit (a later layer's input already
        # differs by rounding); keys: eager rounds RoPE's two products and their sum, the operator (as inductor)
        # their sum once, so some differ by a bf16 unit or two of the terms
        values = written(caches[0].values[i]), written(caches[1].values[i])
        assert i > 0 or torch.equal(*values)
        torch.testing.assert_close(values[0].float(), values[1].float(), rtol=2**-6, atol=2**-5)
        assert torch.equal(caches[0].values[i][0, :, :6], caches[1].values[i][0, :, :6])  # nothing else written
        ours, theirs = written(caches[0].keys[i]), written(caches[1].keys[i])
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=2**-6, atol=2**-5)
        assert i > 0 or (ours == theirs).float().mean() >= 0.5
        changed = (caches[0].keys[i] != before[i]).any(-1)  # [rows, heads, positions]
        assert changed[0, :, 6].all() and changed[1, :, 9].all()
        changed[0, :, 6] = changed[1, :, 9] = False
        assert not changed.any()


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2"])
def test_an_int8_stack_computes_the_layers_int8_projections_and_mlp(tiny_checkpoints, family):
    """One int8 row through the operator and through the model's own layers (their int8 projections through the same
    streaming kernel): the outputs agree within bf16's rounding. A tiny model's layers barely move their input, and
    a gated SiLU of small gates is nearly bilinear (a gate's scale traded for an up's went unseen), so o_proj's, the
    gate's and down's scales are raised 16x and the input is random: the layers move it by more than its size."""
    path = tiny_checkpoints(family)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=INT8)
    for layer in model.model.layers:
        for linear in (layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.down_proj):
            linear.weight_scale.data.mul_(16)
    caches = twin_caches(model, 1)
    ids, positions = torch.tensor([[7]]), torch.tensor([[6]])
    with torch.no_grad():
        decoder = model.model
        x, cos, sin, masks = decoder.prepare(ids, None, positions, caches[0].layer_views()[0])
        x = torch.randn_like(x)
        stacked = stack_for(model, caches[0])(x, cos, sin, masks, positions)
        h = x
        for layer, kv in zip(decoder.layers, caches[1].layer_views()):
            h = layer(h, cos, sin, masks, kv, positions, STREAM)
    assert (h - x).float().abs().mean() > x.float().abs().mean()
    torch.testing.assert_close(stacked.float(), h.float(), rtol=2**-6, atol=2**-4)
    for i in range(model.config.num_hidden_layers):
        torch.testing.assert_close(caches[0].values[i].float(), caches[1].values[i].float(), rtol=2**-6, atol=2**-5)
        torch.testing.assert_close(caches[0].keys[i].float(), caches[1].keys[i].float(), rtol=2**-6, atol=2**-5)


def test_a_block_pool_holds_the_keys_and_values_the_regions_write(tiny_checkpoints):
    """One decode step of two rows at positions 6 and 13 over a pool of 4-position blocks, the rows' blocks scattered
    (row 0: 5, 2; row 1: 7, 1, 3, 6) and the pool filled at random: the operator writes each row's keys and values into
    the block and offset of its position, as the layers' own code does through the table (`write_and_gather`), and
    nothing else; it attends over each row's blocks, so the hidden states agree within bf16's rounding."""
    from staticformers.models.block_kv_cache import BlockKVCache, KVBlocks

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("llama"), dtype=torch.bfloat16)
    c = model.config
    torch.manual_seed(0)
    pools = [
        KVBlocks(c.num_hidden_layers, 8, 4, c.num_key_value_heads, c.head_dim, torch.bfloat16, "cpu") for _ in "ab"
    ]
    for i in range(c.num_hidden_layers):
        pools[0].keys[i].normal_(), pools[0].values[i].normal_()
        pools[1].keys[i].copy_(pools[0].keys[i]), pools[1].values[i].copy_(pools[0].values[i])
    caches = [BlockKVCache(pool, 2, 16) for pool in pools]
    for cache in caches:
        cache.write_table({0: [5, 2], 1: [7, 1, 3, 6]})
    before = [k.clone() for k in pools[0].keys]
    ids, positions = torch.tensor([[7], [40]]), torch.tensor([[6], [13]])
    with torch.no_grad():
        decoder = model.model
        x, cos, sin, masks = decoder.prepare(ids, None, positions, caches[0].layer_views()[0])
        stacked = stack_for(model, caches[0], PAGED, rows=2)(x, cos, sin, masks, positions)
        h = x
        for layer, kv in zip(decoder.layers, caches[1].layer_views()):
            h = layer(h, cos, sin, masks, kv, positions, PAGED)
    torch.testing.assert_close(stacked.float(), h.float(), rtol=2**-6, atol=2**-6)
    for i in range(c.num_hidden_layers):
        # row 0's position 6: block 2, offset 2; row 1's position 13: block 6, offset 1
        for got, want in ((pools[0].values[i], pools[1].values[i]), (pools[0].keys[i], pools[1].keys[i])):
            torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2**-5)
        assert i > 0 or torch.equal(pools[0].values[i], pools[1].values[i])
        changed = (pools[0].keys[i] != before[i]).any(-1)  # [blocks, offsets, heads]
        assert changed[2, 2].all() and changed[6, 1].all()
        changed[2, 2] = changed[6, 1] = False
        assert not changed.any()


def test_bad_input_is_refused_in_one_sentence(tiny_checkpoints):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("llama"), dtype=torch.bfloat16)
    cache = KVCache.for_model(model, 1, 32)
    with torch.no_grad():
        decoder = model.model
        x, cos, sin, masks = decoder.prepare(torch.tensor([[7]]), None, torch.tensor([[3]]), cache.layer_views()[0])
        stack = stack_for(model, cache)
        with pytest.raises(RuntimeError, match="position 40 is outside the cache"):
            stack(x, cos, sin, masks, torch.tensor([[40]]))
        from staticformers.models.block_kv_cache import BlockKVCache, KVBlocks

        c = model.config
        pool = KVBlocks(c.num_hidden_layers, 4, 16, c.num_key_value_heads, c.head_dim, torch.bfloat16, "cpu")
        paged = BlockKVCache(pool, 1, 32)
        paged.write_table({0: [1, 99]})
        with pytest.raises(RuntimeError, match="the block table names block 99, outside the pool's 5"):
            stack_for(model, paged, PAGED)(x, cos, sin, masks, torch.tensor([[3]]))
        attn = decoder.layers[1].self_attn
        attn.q_proj = torch.nn.Linear(c.hidden_size, c.head_dim, bias=False, dtype=torch.bfloat16)  # one query head
        with pytest.raises(RuntimeError, match="layer 1 has 1 query heads, which must be a multiple of its 2 KV heads"):
            stack_for(model, cache)(x, cos, sin, masks, torch.tensor([[3]]))
        layer = decoder.layers[0]
        with pytest.raises(RuntimeError, match="every list must hold one tensor per layer"):
            torch.ops.staticformers.bf16_decode_layers(
                x.view(1, -1), cos.view(1, -1), sin.view(1, -1), torch.tensor([3]), [masks[None]],
                [layer.input_layernorm.weight], [], [], [], [], [], [], [], [], [], [], [], [], [], [], [], [],
                None, 1e-5, 0.125,
            )  # fmt: skip


@pytest.mark.inductor
def test_inductor_compiled_steps_take_the_one_call(tiny_checkpoints, monkeypatch):
    """Under the default compile (inductor, which picks the streaming formulation itself), warm decode steps run
    the one call, and the greedy tokens equal the regions'."""
    path, ids = tiny_checkpoints("llama"), torch.tensor([tokens(7, 4)])
    calls = count_stacks(monkeypatch)

    def greedy():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        return model.generate(ids, max_new_tokens=8, do_sample=False)

    fused = greedy()
    assert len(calls) >= 5
    monkeypatch.setenv("STATICFORMERS_DECODE_LAYERS", "0")
    before = len(calls)
    assert torch.equal(fused, greedy()) and len(calls) == before
