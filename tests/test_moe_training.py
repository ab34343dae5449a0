"""The Trainer on a mixture of experts with the load-balancing loss: the loss is transformers', compiled
regions (one per layer kind, and the head) train as eager does with a fixed graph count, packing works,
and a resumed run is bit-identical (its checkpoints hold the Hub's one-tensor-per-expert layout)."""

from __future__ import annotations

import pytest
import torch

from staticformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments
from staticformers.training.data import build_rows
import tolerances as tol

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64


def tiny_moe(seed=0, **kw):
    """Qwen3-MoE: a sparse, a dense, a sparse layer; 4 experts, top-2, the aux loss on."""
    cfg = AutoConfig.for_model(
        "qwen3_moe",
        **{
            **dict(
                vocab_size=VOCAB,
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=3,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                mlp_only_layers=[1],
                norm_topk_prob=True,
                output_router_logits=True,
                router_aux_loss_coef=0.05,
            ),
            **kw,
        },
    )
    return AutoModelForCausalLM.from_config(cfg, seed=seed)


def docs(n=40, seed=0, lo=3, hi=30):
    g = torch.Generator().manual_seed(seed)
    return [
        {"input_ids": torch.randint(1, VOCAB, (int(k),), generator=g).tolist()}
        for k in torch.randint(lo, hi, (n,), generator=g)
    ]


def args_for(path, **kw):
    base = dict(
        output_dir=str(path),
        max_length=32,
        per_device_train_batch_size=4,
        max_steps=4,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        learning_rate=2e-3,
        seed=0,
    )
    return TrainingArguments(**{**base, **kw})


def losses(trainer):
    return [e["loss"] for e in trainer.state.log_history if "loss" in e and "train_loss" not in e]


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_the_trainer_loss_is_transformers_loss_with_the_aux_loss(tmp_path):
    import transformers

    model = tiny_moe()
    model.save_pretrained(tmp_path / "ckpt")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    assert theirs.config.output_router_logits and theirs.config.router_aux_loss_coef == 0.05
    rows = build_rows(docs(8, seed=3), None, max_length=24, packing=False)
    batch = rows.batch(list(range(8)))
    trainer = Trainer(model=model, args=args_for(tmp_path, max_length=24))
    n = torch.tensor(int((batch["labels"][:, 1:] != -100).sum()))
    loss = trainer.compute_loss(model.train(), batch, n)
    with torch.no_grad():  # the Trainer passes no attention mask: padding takes part in the aux loss, as here
        ref = theirs(input_ids=batch["input_ids"], position_ids=batch.get("position_ids"), labels=batch["labels"])
    assert ref.aux_loss is not None
    assert float(loss.detach()) == pytest.approx(float(ref.loss), rel=tol.FP32_REORDERED)


@pytest.mark.parametrize("packing", [False, True])
def test_compiled_regions_train_as_eager_with_a_fixed_graph_count(tmp_path, packing):
    """Per role: the sparse layer's region, the dense layer's, the head: three graphs whatever the data."""
    runs = {}
    for compiled in (False, True):
        model = tiny_moe()
        args = args_for(
            tmp_path / str(compiled),
            max_steps=4,
            torch_compile=compiled,
            packing=packing,
            torch_compile_backend="aot_eager" if compiled else None,
            eval_strategy="steps",
            eval_steps=2,
        )
        trainer = Trainer(model=model, args=args, train_dataset=docs(48, lo=2, hi=60), eval_dataset=docs(10, seed=5))
        trainer.train()
        runs[compiled] = (losses(trainer), weights(model))
        if compiled:
            stats = trainer.compile_stats()
            assert (stats["train_graphs"], stats["eval_graphs"]) == (3, 3), stats
            names = sorted(f.name for f in trainer.train_step.functions.values())
            assert names == ["head_loss_train", "layer_forward_routed_train", "layer_forward_routed_train_moe"]
    assert runs[True][0] == pytest.approx(runs[False][0], rel=tol.FP32_TRAINED)
    for k, v in runs[False][1].items():
        torch.testing.assert_close(runs[True][1][k], v, rtol=1e-4, atol=1e-5)


def test_the_aux_loss_moves_the_router(tmp_path):
    """With the coefficient the routers get the balancing gradient; without it they train differently."""
    trained = {}
    for coef in (0.0, 0.5):
        model = tiny_moe(router_aux_loss_coef=coef)
        Trainer(model=model, args=args_for(tmp_path / str(coef), max_steps=2), train_dataset=docs()).train()
        trained[coef] = model.model.layers[0].mlp.gate.weight.detach().clone()
    assert not torch.allclose(trained[0.0], trained[0.5])


def test_resume_is_bit_identical(tmp_path):
    extra = dict(
        max_steps=6,
        save_strategy="steps",
        save_steps=3,
        packing=True,
        torch_compile=True,
        torch_compile_backend="aot_eager",
    )
    full = tiny_moe()
    reference = Trainer(model=full, args=args_for(tmp_path / "full", **extra), train_dataset=docs())
    reference.train()
    names = set()
    from safetensors import safe_open

    with safe_open(str(tmp_path / "full" / "checkpoint-3" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in names  # the Hub's layout
    resumed_model = tiny_moe(seed=1)  # other initial weights: everything comes from the checkpoint
    resumed = Trainer(model=resumed_model, args=args_for(tmp_path / "full", **extra), train_dataset=docs())
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-3"))
    assert losses(resumed)[-3:] == losses(reference)[-3:]
    for k, v in weights(full).items():
        assert torch.equal(weights(resumed_model)[k], v), k
