"""Trainer: parity with transformers, learning, one graph per run, accumulation, clipping, bf16, NaN, saving."""

import importlib.util
import json
import math

import pytest
import torch

from staticformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments
from staticformers.training.checkpoint_folders import list_checkpoints
from staticformers.training.data import build_rows
from staticformers.training.optim import clip_grad_norm, no_decay_parameter_names
from staticformers.training.trainer import TrainingDivergedError
import tolerances as tol


pytestmark = pytest.mark.usefixtures("one_thread")


VOCAB = 64


def tiny_model(seed=0, **kw):
    cfg = AutoConfig.for_model(
        "qwen3",
        **{
            **dict(
                vocab_size=VOCAB,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                tie_word_embeddings=True,
            ),
            **kw,
        },
    )
    return AutoModelForCausalLM.from_config(cfg, seed=seed)


# three layers, the middle one attending within a sliding window of 8
WINDOW_LAYERS = dict(
    use_sliding_window=True,
    sliding_window=8,
    layer_types=["full_attention", "sliding_attention", "full_attention"],
    num_hidden_layers=3,
)


def random_docs(n=48, lo=3, hi=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        {"input_ids": torch.randint(1, VOCAB, (int(k),), generator=g).tolist()}
        for k in torch.randint(lo, hi, (n,), generator=g)
    ]


def counting_docs(n=64, seed=0):
    """A learnable task: each document counts up from a random start (mod VOCAB)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        start, k = int(torch.randint(1, VOCAB, (1,), generator=g)), int(torch.randint(6, 20, (1,), generator=g))
        out.append({"input_ids": [(start + i) % (VOCAB - 1) + 1 for i in range(k)]})
    return out


def args_for(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path),
        max_length=32,
        per_device_train_batch_size=4,
        max_steps=4,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        learning_rate=1e-3,
        seed=0,
    )
    return TrainingArguments(**{**base, **kw})


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_loss_equals_transformers_for_the_same_model_and_batch(tiny_checkpoints, tmp_path):
    import transformers

    path = tiny_checkpoints("qwen3")
    ours = AutoModelForCausalLM.from_pretrained(path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    rows = build_rows(random_docs(8, seed=3), None, max_length=24, packing=False)
    batch = rows.batch(list(range(8)))
    trainer = Trainer(model=ours, args=args_for(tmp_path, max_length=24))
    n = torch.tensor(int((batch["labels"][:, 1:] != -100).sum()))
    loss = trainer.compute_loss(ours.train(), batch, n)
    mask = (batch["labels"] != -100).long()
    with torch.no_grad():
        ref = theirs(input_ids=batch["input_ids"], attention_mask=mask, labels=batch["labels"]).loss
    assert float(loss.detach()) == pytest.approx(float(ref), rel=tol.FP32_REORDERED)  # a loss near ln(64) = 4.2


def test_a_tiny_model_learns_and_logs(tmp_path):
    model = tiny_model()
    args = args_for(
        tmp_path,
        max_steps=40,
        logging_steps=10,
        learning_rate=3e-3,
        packing=True,
        eval_strategy="steps",
        eval_steps=20,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=2,
    )
    trainer = Trainer(model=model, args=args, train_dataset=counting_docs(), eval_dataset=counting_docs(16, seed=9))
    out = trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e and "train_loss" not in e]
    assert len(losses) == 4 and losses[-1] < 0.5 * losses[0], losses
    evals = [e for e in trainer.state.log_history if "eval_loss" in e]
    assert len(evals) == 2 and evals[-1]["eval_perplexity"] == pytest.approx(math.exp(evals[-1]["eval_loss"]))
    assert out.global_step == 40 and out.metrics["train_padding_waste"] < 0.2
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert len(lines) == len(trainer.state.log_history) and lines[-1]["train_runtime"] > 0
    if importlib.util.find_spec("matplotlib"):  # the plot extra (tests/test_loss_curve.py checks the picture)
        assert (tmp_path / "loss_curve.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert model.model.embed_tokens.weight.dtype == torch.float32


def test_a_fixed_set_of_graphs_over_mixed_lengths(tmp_path):
    """Per role: one graph for the decoder layer (shared by every layer with the same attention
    window) and one for the head, whatever the document lengths."""
    cases = ((False, "eager", {}, 2), (True, "aot_eager", {}, 2), (True, "eager", WINDOW_LAYERS, 3))
    for i, (packing, backend, kw, expected) in enumerate(cases):
        model = tiny_model(**kw)
        args = args_for(
            tmp_path / str(i),
            max_steps=6,
            torch_compile=True,
            torch_compile_backend=backend,
            packing=packing,
            eval_strategy="steps",
            eval_steps=3,
            gradient_accumulation_steps=2,
        )
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=random_docs(64, lo=2, hi=70),
            eval_dataset=random_docs(10, lo=2, hi=50, seed=5),
        )
        trainer.train()
        trainer.evaluate()
        stats = trainer.compile_stats()
        assert (stats["train_graphs"], stats["eval_graphs"]) == (expected, expected), (kw, stats)
        assert stats["backend"] == backend


def test_regional_and_whole_graph_compile_train_alike(tmp_path, monkeypatch):
    """The two compile layouts (layer + head regions, or one graph) and eager give the same weights,
    with gradient checkpointing too, on a model whose layers mix full and sliding-window attention."""
    from staticformers.training import step_functions as compiled

    runs = {}
    for name, regional, checkpointing in (("eager", None, False), ("regional", True, True), ("whole", False, False)):
        if regional is not None:
            monkeypatch.setattr(compiled.StepFunction.__init__, "__defaults__", (regional, compiled.PLAIN))
        model = tiny_model(**WINDOW_LAYERS)
        args = args_for(
            tmp_path / name,
            max_steps=3,
            torch_compile=regional is not None,
            torch_compile_backend="aot_eager" if regional is not None else None,
            gradient_checkpointing=checkpointing,
            packing=True,
        )
        trainer = Trainer(model=model, args=args, train_dataset=random_docs())
        trainer.train()
        runs[name] = weights(model)
        if regional is not None:
            assert trainer.compile_stats()["train_graphs"] == (3 if regional else 1)
    for name in ("regional", "whole"):
        for k in runs["eager"]:
            torch.testing.assert_close(runs[name][k], runs["eager"][k], rtol=1e-4, atol=1e-5)


def test_compiled_step_matches_eager(tmp_path):
    runs = {}
    for compiled in (False, True):
        model = tiny_model()
        args = args_for(
            tmp_path / str(compiled),
            max_steps=3,
            torch_compile=compiled,
            torch_compile_backend="aot_eager" if compiled else None,
        )
        Trainer(model=model, args=args, train_dataset=random_docs()).train()
        runs[compiled] = weights(model)
    for k in runs[False]:
        torch.testing.assert_close(runs[True][k], runs[False][k], rtol=1e-4, atol=1e-5)


def test_gradient_accumulation_equals_the_larger_batch(tmp_path):
    runs = {}
    for bs, ga in ((8, 1), (4, 2), (2, 4)):
        model = tiny_model()
        args = args_for(
            tmp_path / f"{bs}",
            per_device_train_batch_size=bs,
            gradient_accumulation_steps=ga,
            max_steps=2,
            max_grad_norm=0.5,
        )
        trainer = Trainer(model=model, args=args, train_dataset=random_docs(32))
        trainer.train()
        runs[(bs, ga)] = (weights(model), [e["loss"] for e in trainer.state.log_history if "grad_norm" in e])
    ref_w, ref_loss = runs[(8, 1)]
    for key in ((4, 2), (2, 4)):
        w, loss = runs[key]
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        for k in ref_w:
            torch.testing.assert_close(w[k], ref_w[k], rtol=1e-5, atol=1e-5)


def test_clipping_and_no_decay_groups(tmp_path):
    model = tiny_model()
    skip = no_decay_parameter_names(model)
    assert "model.norm.weight" in skip and "model.layers.0.self_attn.q_norm.weight" in skip
    assert "model.layers.0.mlp.up_proj.weight" not in skip and "model.embed_tokens.weight" not in skip
    trainer = Trainer(
        model=model,
        args=args_for(tmp_path, max_steps=1, max_grad_norm=1e-3, weight_decay=0.1),
        train_dataset=random_docs(),
    )
    before = weights(model)
    trainer.train()
    groups = trainer.optimizer.param_groups
    assert sorted(g["weight_decay"] for g in groups) == [0.0, 0.1]
    norm = trainer.state.log_history[0]["grad_norm"]
    assert norm > 1e-3  # the raw norm is logged; the update used the clipped one
    g = [torch.full((3,), 3.0), torch.full((4,), 4.0)]
    raw = clip_grad_norm(g, max_norm=1.0)
    assert float(raw) == pytest.approx(math.sqrt(27 + 64))
    assert float(torch.linalg.vector_norm(torch.cat(g))) == pytest.approx(1.0, rel=1e-5)
    assert any(not torch.equal(before[k], v) for k, v in weights(model).items())


def test_bf16_trains_bf16_weights_with_fp32_master(tmp_path):
    model = tiny_model()
    seen = {}

    class Spy(Trainer):
        def compute_loss(self, model, batch, n):
            seen["dtype"] = model.model.layers[0].mlp.up_proj.weight.dtype
            seen["master"] = self.master.master[1].dtype
            return super().compute_loss(model, batch, n)

    ref = tiny_model()
    Trainer(model=ref, args=args_for(tmp_path / "fp32", max_steps=5), train_dataset=counting_docs()).train()
    trainer = Spy(model=model, args=args_for(tmp_path / "bf16", max_steps=5, bf16=True), train_dataset=counting_docs())
    out = trainer.train()
    assert seen == {"dtype": torch.bfloat16, "master": torch.float32}
    assert (
        model.model.layers[0].mlp.up_proj.weight.dtype == torch.float32
    )  # back to its dtype, holding the master values
    assert math.isfinite(out.training_loss)
    diff = max(float((a - b).abs().max()) for a, b in zip(weights(model).values(), weights(ref).values()))
    assert diff < 2e-2  # bf16 follows the fp32 run closely


def test_nan_stops_with_the_step_and_keeps_the_good_checkpoint(tmp_path):
    class Poisoned(Trainer):
        def compute_loss(self, model, batch, n):
            loss = super().compute_loss(model, batch, n)
            return loss * float("nan") if self.state.global_step == 2 else loss

    model = tiny_model()
    trainer = Poisoned(
        model=model,
        args=args_for(tmp_path, max_steps=6, save_strategy="steps", save_steps=1),
        train_dataset=random_docs(),
    )
    with pytest.raises(TrainingDivergedError, match="step 3") as err:
        trainer.train()
    assert "checkpoint-2" in str(err.value)
    assert [s for s, _ in list_checkpoints(str(tmp_path))] == [1, 2]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_bf16_master_weights_start_from_the_fp32_values(tmp_path):
    """bf16=True on an fp32 model: the master copies start from the fp32 weights, not their bf16 rounding,
    so a run whose updates vanish (lr 1e-30) gives back exactly the weights it was handed."""
    model = tiny_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    Trainer(
        model=model, args=args_for(tmp_path, bf16=True, max_steps=1, learning_rate=1e-30), train_dataset=random_docs()
    ).train()
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, before[n]), n


def test_after_divergence_no_nan_gradient_is_left_and_resume_trains(tmp_path):
    class Poisoned(Trainer):
        poison_at = 2

        def compute_loss(self, model, batch, n):
            loss = super().compute_loss(model, batch, n)
            return loss * float("nan") if self.state.global_step == self.poison_at else loss

    model = tiny_model()
    trainer = Poisoned(
        model=model,
        args=args_for(tmp_path, max_steps=5, save_strategy="steps", save_steps=1),
        train_dataset=random_docs(),
    )
    with pytest.raises(TrainingDivergedError):
        trainer.train()
    assert all(p.grad is None for p in model.parameters())
    trainer.poison_at = -1  # the data is fixed: resuming as the message advises trains to the end
    assert trainer.train(resume_from_checkpoint=True).global_step == 5


def test_evaluate_uses_the_dataset_it_is_given(tmp_path):
    """Rows are cached by dataset identity: a freed dataset whose id() is reused never answers for another."""
    cases = ((1, 16), (2, 8), (3, 12))
    expected = [
        Trainer(model=tiny_model(), args=args_for(tmp_path), train_dataset=random_docs()).evaluate(
            random_docs(n=n, seed=seed)
        )["eval_loss"]
        for seed, n in cases
    ]
    trainer = Trainer(model=tiny_model(), args=args_for(tmp_path), train_dataset=random_docs())
    got, ids = [], set()
    for seed, n in cases:  # each dataset is freed before the next is built: CPython hands out the same id
        data = random_docs(n=n, seed=seed)
        ids.add(id(data))
        got.append(trainer.evaluate(data)["eval_loss"])
        del data
    # the same computation in the same process: equal to an ulp or two; another dataset's loss differs by 1e-2
    assert got == pytest.approx(expected, rel=4 * tol.EPS32)


def test_saved_model_loads_in_transformers(tmp_path):
    import transformers

    model = tiny_model()
    trainer = Trainer(model=model, args=args_for(tmp_path, max_steps=2, bf16=True), train_dataset=random_docs())
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "final")).eval()
    ids = torch.randint(1, VOCAB, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, model.eval()(ids).logits, rtol=1e-4, atol=1e-4)


def test_refusals(tmp_path):
    with pytest.raises(ValueError, match="needs a model"):
        Trainer(args=args_for(tmp_path))
    with pytest.raises(ValueError, match="needs an eval_dataset"):
        Trainer(model=tiny_model(), args=args_for(tmp_path, eval_strategy="steps"), train_dataset=random_docs())
    with pytest.raises(ValueError, match="train_dataset"):
        Trainer(model=tiny_model(), args=args_for(tmp_path)).train()
    with pytest.raises(ValueError, match="fewer than gradient_accumulation_steps"):
        Trainer(
            model=tiny_model(), args=args_for(tmp_path, gradient_accumulation_steps=8), train_dataset=random_docs(8)
        ).train()
    with pytest.raises(ValueError, match="no complete checkpoint"):
        Trainer(model=tiny_model(), args=args_for(tmp_path), train_dataset=random_docs()).train(
            resume_from_checkpoint=True
        )
