"""LoRA under PEFT's names for the projections Phi-3 and GLM-4 store fused (`qkv_proj`, `gate_up_proj`),
which the model holds split (adapters/fused_targets.py): peft's adapters load and give peft's logits and
gradients, ours load in peft, and the split parts share one A."""

from __future__ import annotations

import pytest
import torch

from staticformers import AutoModelForCausalLM, LoraConfig
from staticformers.adapters.files import ADAPTER_WEIGHTS
from staticformers.adapters.lora_config import AdapterConfigError
from staticformers.adapters.lora import lora_modules
from tiny import build_hf_model
from tolerances import assert_close

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_thread")

TARGETS = {
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    "glm4": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"],
}


def ids(seed=0):
    return torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(seed))


def peft_adapter(family, folder, **config):
    hf = build_hf_model(family)
    torch.manual_seed(1)
    options = dict(r=4, lora_alpha=8, target_modules=TARGETS[family], init_lora_weights=False, lora_dropout=0.0)
    pm = peft.get_peft_model(hf, peft.LoraConfig(**{**options, **config})).eval()
    pm.save_pretrained(str(folder))
    return pm


@pytest.mark.parametrize("family", ["phi3", "glm4"])
def test_a_peft_adapter_on_fused_names_gives_peft_logits(tiny_checkpoints, tmp_path, family):
    pm = peft_adapter(family, tmp_path / "peft", rank_pattern={"gate_up_proj": 6})
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints(family))
    model.load_adapter(tmp_path / "peft")
    mlp = model.model.layers[0].mlp
    assert mlp.gate_proj.lora_A["default"] is mlp.up_proj.lora_A["default"]  # one A for the fused projection
    assert mlp.gate_proj.r["default"] == 6 and model.model.layers[0].self_attn.o_proj.r["default"] == 4
    x = ids()
    with torch.no_grad():
        expected = pm(x).logits
        assert_close(model(x).logits, expected)
        model.merge_and_unload()
        assert not lora_modules(model)
        assert_close(model(x).logits, expected)


def test_our_phi3_adapter_is_peft_s_and_trains_like_it(tiny_checkpoints, tmp_path):
    """Added under PEFT's names: the file holds qkv_proj's and gate_up_proj's A and whole B (as peft's file
    does), peft loads it with our logits, and one backward gives peft's gradients on A and B."""
    from safetensors import safe_open

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("phi3"))
    torch.manual_seed(2)
    model.add_adapter(LoraConfig(r=4, lora_alpha=16, target_modules=TARGETS["phi3"], init_lora_weights=False))
    attn = model.model.layers[1].self_attn
    assert attn.q_proj.lora_A["default"] is attn.k_proj.lora_A["default"] is attn.v_proj.lora_A["default"]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sum(".lora_A." in n for n in trainable) == 2 * 4  # per layer: qkv, o, gate_up, down
    model.save_pretrained(tmp_path / "ours")
    peft_adapter("phi3", tmp_path / "peft")
    shapes = {}
    for who in ("ours", "peft"):
        with safe_open(str(tmp_path / who / ADAPTER_WEIGHTS), "pt") as f:
            shapes[who] = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes["ours"] == shapes["peft"]
    assert shapes["ours"]["base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight"] == (128, 4)
    pm = peft.PeftModel.from_pretrained(build_hf_model("phi3"), str(tmp_path / "ours"), is_trainable=True)
    x = ids(seed=3)
    ours_loss = model(input_ids=x, labels=x)
    theirs = pm(input_ids=x, labels=x)
    assert_close(ours_loss.logits.detach(), theirs.logits.detach())
    ours_loss.loss.backward()
    theirs.loss.backward()
    grads = {
        n.replace("base_model.model.", "").replace(".default", ""): p.grad
        for n, p in pm.named_parameters()
        if p.grad is not None
    }
    assert_close(attn.q_proj.lora_A["default"].weight.grad, grads["model.layers.1.self_attn.qkv_proj.lora_A.weight"])
    split_b = torch.cat([getattr(attn, p).lora_B["default"].weight.grad for p in ("q_proj", "k_proj", "v_proj")])
    assert_close(split_b, grads["model.layers.1.self_attn.qkv_proj.lora_B.weight"])
    back = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("phi3"))
    back.load_adapter(tmp_path / "ours")
    with torch.no_grad():
        assert torch.equal(back(x).logits, model(x).logits)


def test_split_names_are_refused_on_phi3(tiny_checkpoints):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("phi3"))
    with pytest.raises(
        AdapterConfigError,
        match=r"'q_proj' matches no projection of this model: use names among "
        r"down_proj, gate_up_proj, o_proj, qkv_proj",
    ):
        model.add_adapter(LoraConfig(target_modules=["q_proj", "v_proj"]))
    assert not lora_modules(model)
    model.add_adapter(LoraConfig(target_modules="all-linear"))
    assert len(lora_modules(model)) == 2 * 7  # every split part adapted


def test_phi3_lora_training_checkpoints_resume_exactly(tiny_checkpoints, tmp_path):
    """The Trainer's checkpoints hold PEFT's fused names; resuming splits them back over the parts (A shared)."""
    from staticformers import Trainer, TrainingArguments

    g = torch.Generator().manual_seed(0)
    docs = [{"input_ids": torch.randint(3, 128, (16,), generator=g).tolist()} for _ in range(24)]

    def run(out, resume=None):
        model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("phi3"))
        torch.manual_seed(1)
        model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS["phi3"]))
        args = TrainingArguments(
            output_dir=str(out),
            max_length=16,
            per_device_train_batch_size=4,
            max_steps=4,
            logging_steps=1,
            save_strategy="steps",
            save_steps=2,
            disable_tqdm=True,
            learning_rate=1e-2,
            seed=0,
            report_to=[],
        )
        trainer = Trainer(model=model, args=args, train_dataset=docs)
        trainer.train(resume_from_checkpoint=resume)
        return model, trainer

    whole, t1 = run(tmp_path / "whole")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "whole" / "checkpoint-2" / ADAPTER_WEIGHTS), "pt") as f:
        assert "base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight" in set(f.keys())
    resumed, t2 = run(tmp_path / "again", resume=str(tmp_path / "whole" / "checkpoint-2"))
    for (n, a), (_, b) in zip(whole.named_parameters(), resumed.named_parameters()):
        assert torch.equal(a, b), n
    attn = resumed.model.layers[0].self_attn
    assert attn.q_proj.lora_A["default"] is attn.v_proj.lora_A["default"]
    assert [h["loss"] for h in t2.state.log_history if "grad_norm" in h] == [
        h["loss"] for h in t1.state.log_history if "grad_norm" in h
    ]


def test_phi3_adapters_batched_from_files_give_each_row_its_models_tokens(tiny_checkpoints, tmp_path):
    """The server's path: two PEFT adapters on fused names read into the adapter bank (split over the parts),
    one batch mixing them and the base: each row's greedy tokens equal its merged model's alone."""
    from loop_driver import run_loop
    from staticformers.adapters.bank import bank_for_files
    from staticformers.generation.engines import compile_settings, engine_for
    from staticformers.generation.generation_config import GenerationConfig
    from staticformers.generation.loop import GenerationLoop, GenerationRequest

    path = tiny_checkpoints("phi3")
    folders = {}
    for name, seed in (("a", 1), ("b", 2)):
        pm = peft_adapter("phi3", tmp_path / name, r=4 if name == "a" else 8)
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_B" in n:
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
        pm.save_pretrained(str(tmp_path / name))
        folders[name] = str(tmp_path / name)
    rows = torch.randint(3, 128, (3, 6), generator=torch.Generator().manual_seed(4))

    def solo(adapter, row):
        model = AutoModelForCausalLM.from_pretrained(path)
        if adapter is not None:
            model.load_adapter(folders[adapter])
            model.merge_and_unload()
        return model.generate(row[None], max_new_tokens=6, eos_token_id=None, disable_compile=True)[0, 6:].tolist()

    model = AutoModelForCausalLM.from_pretrained(path)
    bank_for_files(model, folders)
    loop = GenerationLoop(engine_for(model), compile_settings(model, GenerationConfig(disable_compile=True)))
    names = ["a", None, "b"]
    got = run_loop(
        loop, {0: [GenerationRequest(rows[i].tolist(), 6, request_id=i, adapter=names[i]) for i in range(3)]}
    )
    expected = {i: solo(names[i], rows[i]) for i in range(3)}
    assert expected[0] != solo(None, rows[0]) and expected[2] != solo(None, rows[2])  # the adapters change tokens
    assert got == expected
