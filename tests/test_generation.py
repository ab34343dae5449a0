"""Greedy parity with transformers.generate for every family, batches of mixed lengths, options,
output layout, streaming, stale weights, and one-sentence refusals that leave the engine intact.

Runs eagerly (`disable_compile=True`): the engine's host loop, cache and plan are the same code
whether or not the step functions are compiled (graph counting is in test_generation_compile.py).
"""

import pytest
import torch

from staticformers import AutoModelForCausalLM, GenerationConfig, ShapePlan
from staticformers.generation.engines import compile_stats, engine_for
from staticformers.generation.plan import PlanError
from tiny import FAMILIES

transformers = pytest.importorskip("transformers")

PLAN = ShapePlan(max_model_len=96, max_batch_size=4, min_prompt_length=8, min_kv_length=32)


def load_pair(path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ours = AutoModelForCausalLM.from_pretrained(path)
    engine_for(ours, PLAN)
    return hf, ours


def left_padded(lengths):
    """Random prompts of these lengths, left-padded to the longest: (ids, mask)."""
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n :] = torch.randint(3, 128, (n,))
        mask[i, width - n :] = 1
    return ids, mask


def hf_generate(hf, ids, mask=None, **kw):
    mask = torch.ones_like(ids) if mask is None else mask
    return hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=0, **kw)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_parity_single_prompts_around_bucket_edges(tiny_checkpoints, family):
    hf, ours = load_pair(tiny_checkpoints(family))
    torch.manual_seed(1)
    for length in (7, 8, 9, 16, 17):  # buckets 8, 16, 32
        ids = torch.randint(3, 128, (1, length))
        ref = hf_generate(hf, ids, max_new_tokens=12, eos_token_id=None)
        out = ours.generate(ids, max_new_tokens=12, do_sample=False, disable_compile=True, eos_token_id=None)
        assert torch.equal(out, ref), (family, length)


@pytest.mark.parametrize("family", ["qwen3", "llama", "mistral-window"])
def test_greedy_parity_left_padded_batches_and_split(tiny_checkpoints, family):
    hf, ours = load_pair(tiny_checkpoints(family))
    torch.manual_seed(2)
    ids, mask = left_padded([5, 20, 13, 1, 9, 17])  # 6 rows: split into 4 + 2 by the plan
    ref = hf_generate(hf, ids, mask, max_new_tokens=10, eos_token_id=None)
    out = ours.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=10,
        do_sample=False,
        disable_compile=True,
        pad_token_id=0,
        eos_token_id=None,
    )
    assert torch.equal(out, ref)


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "mistral-window"])
def test_greedy_parity_of_compiled_regions_on_padded_batches(tiny_checkpoints, family):
    """The CPU's regional steps (eager backend: Dynamo's graphs, no inductor), where a prompt's last
    position goes through the last layer as a decode step: the same tokens as transformers for
    left-padded rows, a sub-batch smaller than its bucket (7 rows: 4 + 3 in a bucket of 4), prompts on
    both sides of bucket edges and beyond the sliding window."""
    from staticformers import CompileConfig

    hf, ours = load_pair(tiny_checkpoints(family))
    torch.manual_seed(3)
    ids, mask = left_padded([5, 20, 13, 1, 9, 17, 8])
    width = ids.shape[1]
    ref = hf_generate(hf, ids, mask, max_new_tokens=8, eos_token_id=None)
    config = CompileConfig(backend="eager")
    out = ours.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=8,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        compile_config=config,
    )
    assert torch.equal(out, ref)
    one = ours.generate(
        input_ids=ids[:1, width - 5 :], max_new_tokens=1, do_sample=False, eos_token_id=None, compile_config=config
    )  # a prompt alone, no decode step after it
    assert torch.equal(one, ref[:1, width - 5 : width + 1])
    assert all(r["graphs"] <= r["functions"] for r in compile_stats(ours))


def test_eos_stops_per_sequence_and_pads(tiny_checkpoints):
    hf, ours = load_pair(tiny_checkpoints("llama"))
    torch.manual_seed(3)
    ids = torch.randint(3, 128, (3, 6))
    free = hf_generate(hf, ids, max_new_tokens=8, eos_token_id=None)
    eos = int(free[0, 6 + 2])  # row 0 emits it at its third new token
    ref = hf_generate(hf, ids, max_new_tokens=8, eos_token_id=[eos, 127])
    out = ours.generate(ids, max_new_tokens=8, eos_token_id=[eos, 127], pad_token_id=0, disable_compile=True)
    assert torch.equal(out, ref)
    assert (out[0, 6 + 3 :] == 0).all()


def test_options_from_generation_config_and_min_new_tokens(tiny_checkpoints):
    hf, ours = load_pair(tiny_checkpoints("qwen3"))
    ids = torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(4))
    free = hf_generate(hf, ids, max_new_tokens=6, eos_token_id=None)
    eos = int(free[0, 10])
    ref = hf_generate(hf, ids, max_new_tokens=6, eos_token_id=eos, min_new_tokens=3, repetition_penalty=1.4)
    cfg = GenerationConfig(
        max_new_tokens=6,
        eos_token_id=eos,
        pad_token_id=0,
        min_new_tokens=3,
        repetition_penalty=1.4,
        disable_compile=True,
    )
    out = ours.generate(ids, generation_config=cfg)
    assert torch.equal(out, ref)


def test_sampling_reproducible_with_seed(tiny_checkpoints):
    _, ours = load_pair(tiny_checkpoints("qwen3"))
    ids = torch.randint(3, 128, (2, 7))
    kw = dict(
        max_new_tokens=8,
        do_sample=True,
        temperature=0.8,
        top_k=20,
        top_p=0.9,
        min_p=0.02,
        disable_compile=True,
        eos_token_id=None,
    )
    a, b, c = (ours.generate(ids, seed=s, **kw) for s in (5, 5, 6))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_output_on_input_device_and_streamer(tiny_checkpoints):
    _, ours = load_pair(tiny_checkpoints("qwen3"))
    seen = []

    class Recorder:
        def put(self, value):
            seen.append(value.tolist())

        def end(self):
            seen.append("end")

    ids = torch.randint(3, 128, (1, 5))
    out = ours.generate(ids, max_new_tokens=4, streamer=Recorder(), disable_compile=True, eos_token_id=None)
    assert out.device == ids.device and out.shape == (1, 9)
    assert seen[0] == ids.tolist() and seen[-1] == "end"
    assert [s[0] for s in seen[1:-1]] == out[0, 5:].tolist()


def test_plan_entries_reuse_caches(tiny_checkpoints):
    _, ours = load_pair(tiny_checkpoints("qwen3"))
    engine = engine_for(ours)
    for n in (3, 5, 7):
        ours.generate(torch.randint(3, 128, (1, n)), max_new_tokens=3, disable_compile=True)
    caches = dict(engine.caches)
    assert len(caches) == 1  # one (batch 1, KV 32) cache, reused
    ours.generate(torch.randint(3, 128, (1, 4)), max_new_tokens=3, disable_compile=True)
    assert all(engine.caches[k] is v for k, v in caches.items())
    (cache,) = caches.values()
    assert cache.keys[0].dtype == ours.dtype and cache.keys[0].device == ours.device


def test_weights_changed_by_training_are_used(tiny_checkpoints):
    _, ours = load_pair(tiny_checkpoints("qwen3"))
    ids = torch.randint(3, 128, (1, 6))
    before = ours.generate(ids, max_new_tokens=5, disable_compile=True, eos_token_id=None)
    with torch.no_grad():
        for p in ours.parameters():
            p.mul_(-1.5)  # an optimizer step, in place
    after = ours.generate(ids, max_new_tokens=5, disable_compile=True, eos_token_id=None)
    ref = ours.generate(ids, max_new_tokens=5, disable_compile=True, eos_token_id=None)
    assert not torch.equal(before, after) and torch.equal(after, ref)
    expect = [ours(torch.cat([ids, after[:, 6 : 6 + i]], 1)).logits[0, -1].argmax().item() for i in range(5)]
    assert after[0, 6:].tolist() == expect


@pytest.mark.parametrize(
    "call,match",
    [
        (dict(input_ids=torch.randint(3, 128, (1, 97))), "more than the largest prompt bucket"),
        (dict(input_ids=torch.randint(3, 128, (1, 60)), max_new_tokens=50), "exceed max_model_len=96"),
        (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), "The prompt is empty"),
        (
            dict(input_ids=torch.ones(2, 3, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]])),
            r"empty for sequence\(s\) \[1\]",
        ),
        (dict(input_ids=torch.ones(1, 3, dtype=torch.long), do_sample=True, temperature=0.0), "temperature=0.0"),
        (dict(input_ids=torch.ones(1, 3, dtype=torch.long), do_sample=True, top_p=1.2), "top_p=1.2"),
        (dict(input_ids=torch.ones(1, 3, dtype=torch.long), max_new_tokens=0), "max_new_tokens=0"),
        (dict(input_ids=torch.ones(1, 3, dtype=torch.long), cache_implementation="dynamic"), "always static"),
        (dict(input_ids=torch.full((1, 3), 500)), "outside the vocabulary"),
        (dict(input_ids=torch.ones(1, 3, dtype=torch.long), num_beams=4), "does not know: num_beams"),
    ],
)
def test_bad_input_one_sentence_engine_intact(tiny_checkpoints, call, match):
    _, ours = load_pair(tiny_checkpoints("qwen3"))
    engine = engine_for(ours)
    ok = torch.randint(3, 128, (1, 5))
    first = ours.generate(ok, max_new_tokens=3, disable_compile=True, eos_token_id=None)
    state = (dict(engine.caches), len(engine.graphs), engine.plan)
    with pytest.raises((ValueError, TypeError), match=match) as err:
        ours.generate(disable_compile=True, **call)
    assert "\n" not in str(err.value)
    assert (dict(engine.caches), len(engine.graphs), engine.plan) == state
    assert torch.equal(ours.generate(ok, max_new_tokens=3, disable_compile=True, eos_token_id=None), first)


def test_device_not_here_is_refused():
    from staticformers.backends.devices import DeviceUnavailableError, resolve_device

    with pytest.raises((DeviceUnavailableError, ValueError), match="not"):
        resolve_device("cuda:7" if not torch.cuda.is_available() else "cuda:99")


def test_plan_error_is_value_error():
    assert issubclass(PlanError, ValueError)
    assert compile_stats(torch.nn.Linear(1, 1)) == []


def test_repetition_penalty_on_a_batch_smaller_than_its_bucket(tiny_checkpoints):
    """3 rows run in the batch-4 bucket: per-row sampler state must follow the bucket, as the logits do."""
    hf, ours = load_pair(tiny_checkpoints("qwen3"))
    torch.manual_seed(4)
    ids = torch.randint(3, 128, (3, 6))
    ref = hf_generate(hf, ids, max_new_tokens=8, eos_token_id=None, repetition_penalty=1.3)
    out = ours.generate(
        ids,
        max_new_tokens=8,
        do_sample=False,
        repetition_penalty=1.3,
        disable_compile=True,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert torch.equal(out, ref)


def test_graphs_dropped_for_new_weights_free_their_caches(tiny_checkpoints):
    import gc
    import weakref

    from staticformers import CompileConfig

    _, ours = load_pair(tiny_checkpoints("qwen3"))
    ids = torch.randint(3, 128, (2, 6))
    eager = CompileConfig(backend="eager")
    ours.generate(ids, max_new_tokens=4, compile_config=eager, eos_token_id=None)
    old = [weakref.ref(c) for c in engine_for(ours).caches.values()]
    with torch.no_grad():
        for p in ours.parameters():
            p.data = p.data.clone()  # new tensors (as after a dtype round trip): graphs and caches are dropped
    ours.generate(ids, max_new_tokens=4, compile_config=eager, eos_token_id=None)
    gc.collect()
    assert old and all(r() is None for r in old)
    assert any(row["retired"] for row in compile_stats(ours))


def test_generation_inside_an_autocast_region_computes_in_the_models_dtype(tiny_checkpoints):
    """An enclosing `torch.autocast` is switched off for the steps (the static cache holds the model's
    dtype): the tokens are those of a call outside it."""
    _, ours = load_pair(tiny_checkpoints("qwen3"))
    ids = torch.randint(3, 128, (2, 9))
    want = ours.generate(ids, max_new_tokens=5, disable_compile=True, eos_token_id=None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = ours.generate(ids, max_new_tokens=5, disable_compile=True, eos_token_id=None)
    assert torch.equal(got, want)
