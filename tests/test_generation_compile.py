"""Compiled graphs stay inside the plan: counted with Dynamo over random shapes (eager backend, fast),
zero on a second pass, a violation raises in strict mode; one real inductor test for batch-1 decode."""

import os

import pytest
import torch

from staticformers import AutoModelForCausalLM, CompileConfig, ShapePlan
from staticformers.compilation.compiler import ShapePlanViolation
from staticformers.generation.engines import engine_for
import tolerances as tol

EAGER = CompileConfig(backend="eager")
PLAN = ShapePlan(batch_sizes=[1, 2], prompt_lengths=[8, 16], kv_lengths=[32], max_model_len=32)


@pytest.fixture
def strict(monkeypatch):
    monkeypatch.setenv("STATICFORMERS_STRICT_SHAPES", "1")


@pytest.mark.parametrize("regional", [True, False])
def test_graphs_never_exceed_the_plan_and_second_pass_compiles_nothing(tiny_checkpoints, strict, regional):
    """Regions (the CPU default): a decode shape compiles prepare and one layer shared by both layers,
    a prefill shape the layer (its prepare runs eagerly), a batch bucket one head for all its shapes."""
    from torch._dynamo.utils import counters

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"))
    engine_for(model, PLAN)
    per_shape = {"prefill": 1, "decode": 2, "head": 1} if regional else {"prefill": 1, "decode": 1}
    config = CompileConfig(backend="eager", regional=regional)
    gen = torch.Generator().manual_seed(0)
    calls = [
        (int(torch.randint(1, 4, (1,), generator=gen)), int(torch.randint(1, 17, (1,), generator=gen)))
        for _ in range(10)
    ] + [(2, 16), (1, 3)]
    counters.clear()
    outs = [
        model.generate(torch.randint(3, 128, (b, n)), max_new_tokens=4, compile_config=config, eos_token_id=None)
        for b, n in calls
    ]
    first = counters["stats"]["unique_graphs"]
    assert 0 < first <= 4 * per_shape["prefill"] + 2 * per_shape["decode"] + 2 * per_shape.get("head", 0)
    assert PLAN.num_shapes == 6
    counters.clear()
    for (_, n), out in zip(calls, outs):
        again = model.generate(out[:, :n], max_new_tokens=4, compile_config=config, eos_token_id=None)
        assert torch.equal(again, out)
    assert counters["stats"]["unique_graphs"] == 0 and counters["frames"]["ok"] == 0
    stats = model.compile_stats()
    assert sum(s["graphs"] for s in stats) == first
    assert all(s["graphs"] == s["functions"] == per_shape[s["kind"]] for s in stats)
    assert {tuple(s["shape"]) for s in stats} <= {
        (1, 8),
        (1, 16),
        (2, 8),
        (2, 16),
        (1, 1, 32),
        (2, 1, 32),
        (1, 1),
        (2, 1),
    }
    assert any(s["kind"] == "head" for s in stats) == regional


def test_compiled_matches_eager(tiny_checkpoints):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("mistral-window"))
    engine_for(model, PLAN)
    ids = torch.randint(3, 128, (2, 11))
    a = model.generate(ids, max_new_tokens=6, compile_config=EAGER, eos_token_id=None)
    b = model.generate(ids, max_new_tokens=6, disable_compile=True, eos_token_id=None)
    c = model.generate(
        ids, max_new_tokens=6, compile_config=CompileConfig(backend="eager", regional=False), eos_token_id=None
    )
    assert torch.equal(a, b) and torch.equal(a, c)


def test_regions_with_mixed_windows_and_logits_match_the_whole_graph(strict):
    """A model mixing sliding-window and full layers gets one layer region per window; regional and
    whole-graph steps give the same logits (aot_eager: AOTAutograd's graphs, no inductor)."""
    from staticformers import AutoConfig
    from staticformers.generation.engine import CompileSettings, Engine

    cfg = AutoConfig.for_model(
        "qwen3",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        use_sliding_window=True,
        sliding_window=4,
        layer_types=["full_attention", "sliding_attention", "full_attention"],
    )
    model = AutoModelForCausalLM.from_config(cfg, seed=0)
    assert [layer.self_attn.window for layer in model.model.layers] == [None, 4, None]
    regional, whole = Engine(model, PLAN), Engine(model, PLAN)
    r_settings = CompileSettings(backend="aot_eager", regional=True)
    w_settings = CompileSettings(backend="aot_eager", regional=False)
    assert regional.steps.regional(r_settings) and not whole.steps.regional(w_settings)
    prompts = [torch.randint(3, 128, (7,)).tolist(), torch.randint(3, 128, (4,)).tolist()]
    with torch.no_grad():
        caches = [e.cache(2, 32) for e in (regional, whole)]
        out_r = regional.prefill(r_settings, prompts, caches[0], [1, 0])  # into slots 1 and 0
        out_w = whole.prefill(w_settings, prompts, caches[1], [1, 0])
        for a, b in zip(out_r, out_w):
            tol.assert_close(a, b)
        for a, b in zip(caches[0].keys + caches[0].values, caches[1].keys + caches[1].values):
            tol.assert_close(a[:, :, :7], b[:, :, :7])  # what the rows wrote
        tokens = torch.stack([out_r[0][1], out_r[0][0]]).view(2, 1)
        positions = torch.tensor([[4], [7]])
        steps = [
            e.decode(s, c, tokens, positions)
            for e, s, c in ((regional, r_settings, caches[0]), (whole, w_settings, caches[1]))
        ]
        tol.assert_close(steps[0][1], steps[1][1])
    rows = {(r["kind"], tuple(r["shape"])): r for r in regional.stats()}
    # the prefill's layer region per window of the layers but the last; decode: prepare + one per window
    assert rows["prefill", (2, 8)]["functions"] == 2 and rows["decode", (2, 1, 32)]["functions"] == 3
    assert rows["head", (2, 1)]["graphs"] == 1
    assert all(r["graphs"] == r["functions"] for r in rows.values())


def test_shape_outside_the_plan_raises_in_strict_mode(tiny_checkpoints, strict):
    from staticformers.generation.engine import CompileSettings, Engine

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"))
    engine = Engine(model, PLAN)
    graph = engine.step("decode", 1, 32, CompileSettings(backend="eager"))
    with pytest.raises(ShapePlanViolation, match="outside the plan"):
        engine._check(graph, (1, 1), torch.zeros(2, 1))


def test_warns_outside_strict_mode(tiny_checkpoints, monkeypatch):
    monkeypatch.delenv("STATICFORMERS_STRICT_SHAPES", raising=False)
    from staticformers.generation.engine import CompileSettings, Engine

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"))
    engine = Engine(model, PLAN)
    graph = engine.step("prefill", 1, 8, CompileSettings(enabled=False))
    with pytest.warns(RuntimeWarning, match="outside the plan"):
        engine._check(graph, (1, 8), torch.zeros(1, 9))


def test_replaced_weights_drop_graphs(tiny_checkpoints):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"))
    engine = engine_for(model, PLAN)
    ids = torch.randint(3, 128, (1, 5))
    model.generate(ids, max_new_tokens=2, disable_compile=True)
    assert engine.graphs
    model.to(torch.bfloat16)  # new tensors, new dtype: graphs and caches are rebuilt
    out = model.generate(ids, max_new_tokens=2, disable_compile=True)
    assert all(c.keys[0].dtype == torch.bfloat16 for c in engine.caches.values())
    assert out.shape == (1, 7)


@pytest.mark.inductor
def test_inductor_batch1_fast_decode_matches_eager(tiny_checkpoints, tmp_path, monkeypatch, strict):
    """Real inductor compile of the prefill and the batch-1 matrix-vector decode; the on-disk cache
    lands under STATICFORMERS_CACHE."""
    import staticformers.compilation.compiler as sc

    monkeypatch.setenv("STATICFORMERS_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(sc, "_ENABLED_FOR", None)
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"))
    engine_for(model, ShapePlan(batch_sizes=[1], prompt_lengths=[8], kv_lengths=[32], max_model_len=32))
    ids = torch.randint(3, 128, (1, 8))
    want = model.generate(ids, max_new_tokens=8, disable_compile=True, eos_token_id=None)
    got = model.generate(ids, max_new_tokens=8, compile_config=CompileConfig(backend="inductor"), eos_token_id=None)
    assert torch.equal(got, want)
    decode = [g.step for k, g in engine_for(model).graphs.items() if k[0] == "decode" and g.settings.enabled]
    assert decode and decode[0].ops.linears == "reduce"  # the batch-1 weight-streaming formulation
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].startswith(str(tmp_path))
    assert any(p.is_dir() for p in (tmp_path / "inductor").iterdir())
    # a second model (as in a new process) loads every region from its precompiled artifact: no trace
    from torch._dynamo.utils import counters

    traced, saved = counters["stats"]["unique_graphs"], len(os.listdir(tmp_path / "precompiled"))
    again = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"))
    engine_for(again, ShapePlan(batch_sizes=[1], prompt_lengths=[8], kv_lengths=[32], max_model_len=32))
    out = again.generate(ids, max_new_tokens=8, compile_config=CompileConfig(backend="inductor"), eos_token_id=None)
    assert torch.equal(out, want) and counters["stats"]["unique_graphs"] == traced
    rows = [r for r in again.compile_stats() if r["graphs"]]
    assert saved == 4 and sum(r["graphs"] for r in rows) == 4  # prefill layer, decode prepare + layer, head
    # `staticformers compile` (Engine.precompile) warms the decode from its first layer, a prompt's last
    # position warms it from its last: either way the artifacts are the same ones
    from staticformers.generation.engines import compile_settings
    from staticformers.generation.generation_config import GenerationConfig

    for p in (tmp_path / "precompiled").iterdir():
        p.unlink()
    ahead = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"))
    engine = engine_for(ahead, ShapePlan(batch_sizes=[1], prompt_lengths=[8], kv_lengths=[32], max_model_len=32))
    engine.precompile(compile_settings(ahead, GenerationConfig(), CompileConfig(backend="inductor")))
    assert len(os.listdir(tmp_path / "precompiled")) == 4
    traced = counters["stats"]["unique_graphs"]
    later = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"))
    engine_for(later, ShapePlan(batch_sizes=[1], prompt_lengths=[8], kv_lengths=[32], max_model_len=32))
    out = later.generate(ids, max_new_tokens=8, compile_config=CompileConfig(backend="inductor"), eos_token_id=None)
    assert torch.equal(out, want) and counters["stats"]["unique_graphs"] == traced
    assert len(os.listdir(tmp_path / "precompiled")) == 4


def test_every_warmed_step_runs_the_compiled_regions(tiny_checkpoints, strict):
    """After the first step, regions run through Dynamo's run-only mode without guards: each step must
    still execute the compiled graphs (a backend that counts its graphs' calls), never eager code."""
    import torch._dynamo

    runs = {}

    def counting(gm, example_inputs):
        key = len(runs)
        runs[key] = 0

        def run(*args):
            runs[key] += 1
            return gm.forward(*args)

        return run

    torch._dynamo.register_backend(counting, "sf_test_counting")
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"))
    engine_for(model, ShapePlan(batch_sizes=[1], prompt_lengths=[8], kv_lengths=[32], max_model_len=32))
    ids = torch.randint(3, 128, (1, 6))
    want = model.generate(ids, max_new_tokens=7, disable_compile=True, eos_token_id=None)
    got = model.generate(
        ids, max_new_tokens=7, compile_config=CompileConfig(backend="sf_test_counting"), eos_token_id=None
    )
    assert torch.equal(got, want)
    # graphs in order of compilation: prefill layer (every layer but the last), then what the prompt's
    # last position runs through the last layer, the decode's: prepare, layer, the batch's head (shared
    # by prefill and decode); then six decode steps
    layers = model.config.num_hidden_layers
    assert list(runs.values()) == [layers - 1, 1 + 6, 1 + 6 * layers, 1 + 6]


@pytest.mark.parametrize("how", ["deleted", "inserted"])
def test_layers_removed_or_inserted_are_seen(tiny_checkpoints, how):
    """`del layers[i]` and `ModuleList.insert` edit the submodule dicts without registering anything:
    the fingerprint still sees the tree change and drops the graphs built for the old one."""
    import copy

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"))
    engine = engine_for(model, PLAN)
    model.generate(torch.randint(3, 128, (1, 5)), max_new_tokens=2, compile_config=CompileConfig(backend="eager"))
    assert engine.graphs
    if how == "deleted":
        del model.model.layers[1]
    else:
        model.model.layers.insert(0, copy.deepcopy(model.model.layers[0]))
    engine.check_weights()
    assert not engine.graphs and not engine.caches


@pytest.mark.parametrize("how", ["parameter", "module", "in_place_data"])
def test_weights_replaced_on_a_module_are_seen(tiny_checkpoints, how):
    """The engine's fingerprint reads the modules' own parameter dicts (and walks the module tree again
    after any module registration): a parameter or module swapped in, or new data behind a parameter,
    drops the graphs instead of running them on the old weights."""
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"))
    engine = engine_for(model, PLAN)
    ids = torch.randint(3, 128, (1, 5))
    before = model.generate(ids, max_new_tokens=3, compile_config=CompileConfig(backend="eager"), eos_token_id=None)
    assert engine.graphs
    mlp = model.model.layers[0].mlp
    if how == "parameter":
        mlp.down_proj.weight = torch.nn.Parameter(torch.zeros_like(mlp.down_proj.weight))
    elif how == "module":
        fresh = torch.nn.Linear(mlp.down_proj.in_features, mlp.down_proj.out_features, bias=False)
        torch.nn.init.zeros_(fresh.weight)
        mlp.down_proj = fresh
    else:
        mlp.down_proj.weight.data = torch.zeros_like(mlp.down_proj.weight)
    engine.check_weights()
    assert not engine.graphs  # dropped: rebuilt on demand for the new weights
    after = model.generate(ids, max_new_tokens=3, compile_config=CompileConfig(backend="eager"), eos_token_id=None)
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=3, disable_compile=True, eos_token_id=None)
    assert torch.equal(after, want) and before.shape == after.shape


def test_forward_hooks_added_or_removed_after_warm_up_are_honoured(tiny_checkpoints, strict):
    """Warmed steps skip Dynamo's guards, which would have seen a new hook: the engine sees it instead and
    rebuilds its graphs, whole-model while hooks are set (a layer graph shared by every layer cannot
    carry one layer's hook), so compiled steps give what the model with its hook gives eagerly."""
    from staticformers.backends.cpu.regions import RegionalDecode, RegionalPrefill

    Regions = (RegionalDecode, RegionalPrefill)

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"))
    engine = engine_for(model, PLAN)
    ids = torch.randint(3, 128, (2, 6))
    config = CompileConfig(backend="eager")
    for _ in range(2):  # warmed
        plain = model.generate(ids, max_new_tokens=6, compile_config=config, eos_token_id=None)
    assert all(isinstance(g.step, Regions) for g in engine.graphs.values())
    handle = model.model.layers[0].mlp.register_forward_hook(lambda m, args, out: out.flip(-1) * 20)
    want = model.generate(ids, max_new_tokens=6, disable_compile=True, eos_token_id=None)
    assert not torch.equal(want, plain)
    hooked = model.generate(ids, max_new_tokens=6, compile_config=config, eos_token_id=None)
    assert torch.equal(hooked, want)
    assert not any(isinstance(g.step, Regions) for g in engine.graphs.values())
    handle.remove()
    again = model.generate(ids, max_new_tokens=6, compile_config=config, eos_token_id=None)
    assert torch.equal(plain, again)
    assert all(isinstance(g.step, Regions) for g in engine.graphs.values())


@pytest.mark.parametrize(
    "layer_types", [["full_attention"], ["sliding_attention", "sliding_attention", "full_attention"]]
)
def test_prefill_warms_when_only_the_last_layer_has_its_window(strict, layer_types):
    """A prefill continued by its decode runs the layer regions of all layers but the last: a window only
    the last layer has (or a one-layer model) must not keep the step off its warmed path."""
    from staticformers import AutoConfig

    cfg = AutoConfig.for_model(
        "qwen3",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        use_sliding_window=True,
        sliding_window=4,
        layer_types=layer_types,
    )
    model = AutoModelForCausalLM.from_config(cfg, seed=0)
    engine = engine_for(model, PLAN)
    ids = torch.randint(3, 128, (1, 6))
    want = model.generate(ids, max_new_tokens=3, disable_compile=True, eos_token_id=None)
    for _ in range(3):
        got = model.generate(ids, max_new_tokens=3, compile_config=CompileConfig(backend="eager"), eos_token_id=None)
        assert torch.equal(got, want)
    (prefill,) = [g.step for k, g in engine.graphs.items() if k[0] == "prefill" and g.settings.enabled]
    assert "prefill" in prefill._warm  # the prefill ran warmed
    (decode,) = [g.step for k, g in engine.graphs.items() if k[0] == "decode" and g.settings.enabled]
    # the prefill's first call traced the decode's regions for the last layer on the way: its time includes
    # each of theirs (nested intervals of one monotonic clock; not their sum, which may count a nested one twice)
    traced = [decode.prepare.first_call_seconds, decode.layer[model.model.layers[-1].kind].first_call_seconds]
    assert min(traced) > 0 and prefill.first_call_seconds >= max(traced)
