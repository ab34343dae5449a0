"""What a GPU runs, checked on every device this machine has: logits and greedy tokens against
transformers for every family in float32 and bfloat16, generation with the compiled engine's
whole-model graphs (counted, none on a second pass), CUDA graphs, and the Trainer's compiled step.

Each test takes the `device` fixture (tests/conftest.py): its "cuda" variant is marked `cuda` and is
skipped without an NVIDIA GPU (`pytest -m cuda` runs those alone; `bench/device_check.sh` does), its
"cpu" variant runs in `make test`. The two share the test body, the engine path and the assertions,
so a CUDA test has at least run here; only the compile backend differs: inductor on CUDA, Dynamo's
eager/aot_eager backends on the CPU (the same graphs traced, without inductor's 10-20 s a graph).

Tolerances (from what the arithmetic promises, relative to the logits' scale, about 1 on these models):
- float32, `FP32_TOL` = 1e-4: kernels on another device sum in another order; an n-term fp32 sum moves
  by about n * 2^-24 of its terms' magnitude (~1e-5 for n = 128, the longest dot product here), a
  few matmuls deep.
- bfloat16, `BF16_TOL` = 4 ulps (4 * 2^-7): the logits are rounded to bf16 (half an ulp) and each
  intermediate that a different kernel rounds to bf16 at another point moves them by about one ulp of
  their scale; four allows a few such roundings over two layers, and nothing like a wrong weight,
  mask or position, which moves logits by a good fraction of their scale.
- Greedy tokens must be equal, except where transformers' own two best logits (recomputed on the
  common prefix) are within twice the tolerance: there either token is the argmax within rounding.
"""

from __future__ import annotations

import pytest
import torch

from staticformers import AutoModelForCausalLM, CompileConfig, ShapePlan, Trainer, TrainingArguments
from tiny import FAMILIES

from family_checks import reference_losses

transformers = pytest.importorskip("transformers")

FP32_TOL = 1e-4
BF16_TOL = 4 * torch.finfo(torch.bfloat16).eps
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def tolerance(dtype: torch.dtype) -> float:
    return BF16_TOL if dtype == torch.bfloat16 else FP32_TOL


def graph_backend(device: torch.device) -> str:
    """The backend of tests that prove compiled execution: inductor on a GPU, aot_eager on the CPU."""
    return "inductor" if device.type == "cuda" else "aot_eager"


def load_pair(path: str, dtype: torch.dtype, device: torch.device):
    ours = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=str(device))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return ours, theirs


def left_padded(lengths: list[int], device: torch.device, seed: int = 0, vocab: int = 128):
    """Random prompts of these lengths left-padded to the longest: (ids, mask) on `device`."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n :] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, width - n :] = 1
    return ids.to(device), mask.to(device)


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    scale = float(ref.float().abs().max())
    torch.testing.assert_close(ours.float(), ref.float(), rtol=0, atol=tolerance(dtype) * max(scale, 1.0))


def assert_greedy_agrees(
    theirs, ours_out: torch.Tensor, ref_out: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype
) -> None:
    """Our greedy tokens equal transformers', or part at a near-tie of transformers' own logits."""
    assert ours_out.shape == ref_out.shape and ours_out.device == ref_out.device
    prompt = mask.shape[1]
    for row in range(ours_out.shape[0]):
        differ = (ours_out[row] != ref_out[row]).nonzero().flatten().tolist()
        if not differ:
            continue
        t = differ[0]
        assert t >= prompt, f"row {row}: the prompt came back changed at position {t}"
        prefix = ref_out[row : row + 1, :t]
        prefix_mask = torch.cat([mask[row : row + 1], torch.ones_like(prefix[:, prompt:])], dim=1)
        with torch.no_grad():
            logits = theirs(input_ids=prefix, attention_mask=prefix_mask).logits[0, -1].float()
        gap = float(logits.max() - logits[ours_out[row, t]])
        scale = max(float(logits.abs().max()), 1.0)
        assert gap <= 2 * tolerance(dtype) * scale, (
            f"row {row}: token {t - prompt} differs ({int(ours_out[row, t])} vs {int(ref_out[row, t])}) and transformers' "
            f"logits for them are {gap:.4g} apart, more than rounding ({2 * tolerance(dtype) * scale:.4g})"
        )


# ---------------------------------------------------------------------------------------------
# logits and greedy tokens, every family, both precisions
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_and_greedy_tokens_match_transformers(tiny_checkpoints, device, family, dtype):
    """A left-padded batch: logits at every real position, then 10 greedy tokens through the engine
    (Dynamo's graphs run by the eager backend: each device's own graph layout, no inductor)."""
    if device.type == "cpu" and dtype == torch.float32 and family != "qwen3":
        pytest.skip("float32 on the CPU: test_modeling.py and test_generation.py prove every family already")
    ours, theirs = load_pair(tiny_checkpoints(family), dtype, device)
    assert ours.device == device and ours.dtype == dtype
    ids, mask = left_padded([12, 8, 5], device, seed=1)
    with torch.no_grad():
        a = ours(input_ids=ids, attention_mask=mask).logits
        b = theirs(input_ids=ids, attention_mask=mask).logits
    assert a.device == device
    real = mask.bool()
    assert_logits_close(a[real], b[real], dtype)

    ref = theirs.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None
    )
    out = ours.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=10,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        compile_config=CompileConfig(backend="eager"),
    )
    assert out.device == ids.device
    assert_greedy_agrees(theirs, out, ref, mask, dtype)


# ---------------------------------------------------------------------------------------------
# the compiled engine: whole-model graphs, counted, none on a second pass
# ---------------------------------------------------------------------------------------------
PLAN = ShapePlan(batch_sizes=[2], prompt_lengths=[16], kv_lengths=[32], max_model_len=32)


@pytest.fixture
def strict(monkeypatch):
    """A shape outside the plan raises instead of warning."""
    monkeypatch.setenv("STATICFORMERS_STRICT_SHAPES", "1")


@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_whole_model_graphs_once_per_shape_and_tokens_match(tiny_checkpoints, device, dtype, strict):
    """Two calls (a left-padded pair and a single prompt) share one bucket: one prefill and one decode
    graph, compiled by inductor on a GPU; a second pass over both compiles nothing and gives the same
    tokens, which match transformers'."""
    from torch._dynamo.utils import counters

    backend = graph_backend(device)
    ours, theirs = load_pair(tiny_checkpoints("qwen3"), dtype, device)
    config = CompileConfig(backend=backend, regional=False)
    pair = left_padded([16, 9], device, seed=2)
    single = left_padded([5], device, seed=3)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)

    counters.clear()
    outs = [
        ours.generate(input_ids=ids, attention_mask=mask, compile_config=config, shape_plan=PLAN, **kw)
        for ids, mask in (pair, single)
    ]
    assert counters["stats"]["unique_graphs"] == 2
    stats = sorted(ours.compile_stats(), key=lambda s: s["kind"])
    assert [(s["kind"], tuple(s["shape"]), s["graphs"], s["backend"]) for s in stats] == [
        ("decode", (2, 1, 32), 1, backend),
        ("prefill", (2, 16), 1, backend),
    ]
    calls = {s["kind"]: s["calls"] for s in stats}

    counters.clear()
    again = [
        ours.generate(input_ids=ids, attention_mask=mask, compile_config=config, shape_plan=PLAN, **kw)
        for ids, mask in (pair, single)
    ]
    assert counters["stats"]["unique_graphs"] == 0 and counters["frames"]["ok"] == 0
    after = {s["kind"]: s for s in ours.compile_stats()}
    assert all(after[k]["graphs"] == 1 and after[k]["calls"] == 2 * calls[k] for k in calls)
    for (ids, mask), out, out2 in zip((pair, single), outs, again):
        assert torch.equal(out, out2)
        ref = theirs.generate(input_ids=ids, attention_mask=mask, **kw)
        assert_greedy_agrees(theirs, out, ref, mask, dtype)


@pytest.mark.cuda
def test_reduce_overhead_decodes_through_cuda_graphs(tiny_checkpoints, strict):
    """`CompileConfig(mode="reduce-overhead")` reaches inductor (CUDA graphs) and every graph is
    captured: none skipped (a KV cache written in place must be a static input for that); the tokens
    match transformers' and a second pass compiles nothing and gives the same tokens."""
    from torch._dynamo.utils import counters

    device = torch.device("cuda", 0)
    ours, theirs = load_pair(tiny_checkpoints("qwen3"), torch.bfloat16, device)
    ids, mask = left_padded([16, 11], device, seed=4)
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    graphs = CompileConfig(regional=False, mode="reduce-overhead")
    counters.clear()
    out = ours.generate(input_ids=ids, compile_config=graphs, shape_plan=PLAN, **kw)
    assert counters["inductor"]["cudagraph_skips"] == 0, "inductor skipped CUDA graphs (its log says why)"
    assert_greedy_agrees(theirs, out, theirs.generate(input_ids=ids, **kw), mask, torch.bfloat16)
    counters.clear()
    assert torch.equal(ours.generate(input_ids=ids, compile_config=graphs, shape_plan=PLAN, **kw), out)
    assert counters["stats"]["unique_graphs"] == 0


# ---------------------------------------------------------------------------------------------
# the Trainer's compiled step against transformers
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_trainer_steps_follow_transformers(tiny_checkpoints, device, dtype, tmp_path):
    """Four compiled steps on one batch of four rows (each step sees the same rows): float32 losses equal
    transformers' trained alike; bfloat16 (bf16 compute, fp32 master weights) follows the same float32
    trajectory within bf16 rounding. One graph per region (a layer shared by both layers, the head)."""
    from staticformers.training.data import build_rows

    path = tiny_checkpoints("qwen3")
    g = torch.Generator().manual_seed(5)
    docs = [{"input_ids": torch.randint(3, 128, (int(n),), generator=g).tolist()} for n in (24, 17, 30, 9)]
    steps, lr = 4, 3e-3
    backend = graph_backend(device)
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
        bf16=dtype == torch.bfloat16,
        torch_compile=True,
        torch_compile_backend=backend,
        use_cpu=device.type == "cpu",
        seed=0,
    )
    model = AutoModelForCausalLM.from_pretrained(path)
    trainer = Trainer(model=model, args=args, train_dataset=docs)
    assert trainer.args.device == device
    trainer.train()
    ours = [e["loss"] for e in trainer.state.log_history if "loss" in e and "train_loss" not in e]
    rows = build_rows(docs, None, max_length=32, packing=False)
    ref = reference_losses(path, rows.batch(list(range(4))), steps, lr, device)
    assert len(ours) == steps and ref[-1] < ref[0]
    # logged losses are rounded to 6 decimals. bf16: the loss (~4.8) is a mean of token losses, each moved by
    # at most twice the largest logit error (BF16_TOL at a logit scale of ~1): within 2 bf16 ulps of the loss
    rtol = 2 * torch.finfo(torch.bfloat16).eps if dtype == torch.bfloat16 else FP32_TOL
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref), rtol=rtol, atol=2e-6)
    stats = trainer.compile_stats()
    assert (stats["backend"], stats["train_graphs"]) == (backend, 2)


# ---------------------------------------------------------------------------------------------
# serving on the device
# ---------------------------------------------------------------------------------------------
def test_server_completions_on_device(tmp_path, device):
    """The OpenAI-compatible server on the device (inductor whole-model graphs on a GPU, eager regions on
    the CPU), through the `openai` client: greedy text streamed and not equals `generate()` on that device,
    and nothing compiles after the first requests."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from pathlib import Path

    from staticformers import AutoTokenizer
    from staticformers.serving.server import ServeOptions, Server, build_loop, build_state
    from tiny import build_hf_model
    from tokenizer_fixtures import build_qwen

    folder = Path(tmp_path) / "served"
    build_qwen(folder)
    tok = AutoTokenizer.from_pretrained(str(folder))
    build_hf_model(
        "qwen3", vocab_size=len(tok), max_position_embeddings=128, eos_token_id=tok.eos_token_id
    ).save_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), device_map=str(device))
    options = ServeOptions(
        model=str(folder), served_model_name="tiny", max_batch_size=2, device=str(device), backend=graph_backend(device)
    )
    plan = ShapePlan(batch_sizes=[2], prompt_lengths=[16], kv_lengths=[64], max_model_len=64)
    prompt = "for x in"
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    want = model.generate(
        ids,
        max_new_tokens=8,
        do_sample=False,
        eos_token_id=None,
        shape_plan=plan,
        compile_config=CompileConfig(backend=graph_backend(device)),
    )
    want = tok.decode(want[0, ids.shape[1] :], skip_special_tokens=True)
    with Server(build_state(model, tok, build_loop(model, options, plan=plan), options)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=300, max_retries=0)
        kw = dict(model="tiny", prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        assert client.completions.create(**kw).choices[0].text == want
        graphs = sum(r["graphs"] for r in model.compile_stats())
        assert "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True)) == want
        assert sum(r["graphs"] for r in model.compile_stats()) == graphs
