"""LoRA adapters against `peft` on transformers (the oracle): an adapter peft saved loads here and gives
peft's logits, one we save loads in peft and gives ours, for each family with adapters on every attention
and MLP projection; merged equals unmerged; switching, disabling, deleting and hot-swapping adapters;
every refusal one sentence, the model untouched after it."""

from __future__ import annotations

import json
import os

import pytest
import torch

from staticformers import AutoModelForCausalLM, LoraConfig
from staticformers.adapters.lora_config import AdapterConfigError
from staticformers.adapters.files import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterFileError
from staticformers.adapters.lora import LoraLinear, lora_modules
from tiny import build_hf_model
from tolerances import assert_close

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_thread")

ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FAMILIES = ["qwen3", "llama", "qwen2", "mistral"]


def ids(batch=2, length=11, seed=0, vocab=128):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def peft_adapter(family: str, folder, seed: int = 1, **config):
    """A peft model on transformers' twin of the tiny checkpoint, its adapter saved to `folder`."""
    hf = build_hf_model(family)
    torch.manual_seed(seed)
    options = dict(r=4, lora_alpha=8, target_modules=ALL7, init_lora_weights=False, lora_dropout=0.0)
    pm = peft.get_peft_model(hf, peft.LoraConfig(**{**options, **config})).eval()
    pm.save_pretrained(str(folder))
    return pm


@pytest.mark.parametrize("family", FAMILIES)
def test_a_peft_adapter_gives_peft_logits_and_merges_to_the_same(tiny_checkpoints, tmp_path, family):
    pm = peft_adapter(family, tmp_path / "peft")
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints(family))
    model.load_adapter(tmp_path / "peft")
    x = ids()
    with torch.no_grad():
        expected = pm(x).logits
        unmerged = model(x).logits
        assert_close(unmerged, expected)
        assert len(lora_modules(model)) == 2 * len(ALL7)
        model.merge_and_unload()
        assert not lora_modules(model) and all(type(m) is not LoraLinear for m in model.modules())
        assert_close(model(x).logits, unmerged)


@pytest.mark.parametrize("family", FAMILIES)
def test_our_adapter_loads_in_peft_with_our_logits(tiny_checkpoints, tmp_path, family):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints(family))
    torch.manual_seed(2)
    model.add_adapter(LoraConfig(r=4, lora_alpha=16, target_modules=ALL7, init_lora_weights=False))
    model.save_pretrained(tmp_path / "ours")
    assert sorted(os.listdir(tmp_path / "ours")) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    pm = peft.PeftModel.from_pretrained(build_hf_model(family), str(tmp_path / "ours")).eval()
    x = ids(seed=3)
    with torch.no_grad():
        assert_close(pm(x).logits, model(x).logits)


def test_our_files_hold_what_peft_writes(tiny_checkpoints, tmp_path):
    """Same tensor names and shapes, and the same values of every config field that changes the math."""
    from safetensors import safe_open

    peft_adapter("qwen3", tmp_path / "peft", r=8, lora_alpha=16, use_rslora=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"))
    model.add_adapter(LoraConfig(r=8, lora_alpha=16, target_modules=ALL7, use_rslora=True))
    model.save_pretrained(tmp_path / "ours")
    shapes = {}
    for who in ("peft", "ours"):
        with safe_open(str(tmp_path / who / ADAPTER_WEIGHTS), "pt") as f:
            shapes[who] = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes["ours"] == shapes["peft"]
    theirs, ours = (json.loads((tmp_path / who / ADAPTER_CONFIG).read_text()) for who in ("peft", "ours"))
    for key in (
        "peft_type",
        "r",
        "lora_alpha",
        "use_rslora",
        "bias",
        "lora_dropout",
        "fan_in_fan_out",
        "use_dora",
        "rank_pattern",
        "alpha_pattern",
    ):
        assert ours[key] == theirs[key], key
    assert sorted(ours["target_modules"]) == sorted(theirs["target_modules"])


def test_rank_and_alpha_patterns_and_rslora_both_ways(tiny_checkpoints, tmp_path):
    pm = peft_adapter(
        "llama",
        tmp_path / "peft",
        r=4,
        lora_alpha=8,
        use_rslora=True,
        rank_pattern={"down_proj": 2, "q_proj": 6},
        alpha_pattern={"v_proj": 3},
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("llama"))
    model.load_adapter(tmp_path / "peft")
    layer = model.model.layers[0]
    assert layer.mlp.down_proj.r["default"] == 2 and layer.self_attn.q_proj.r["default"] == 6
    x = ids(seed=4)
    with torch.no_grad():
        assert_close(model(x).logits, pm(x).logits)
    model.save_pretrained(tmp_path / "again")
    back = peft.PeftModel.from_pretrained(build_hf_model("llama"), str(tmp_path / "again")).eval()
    with torch.no_grad():
        assert_close(back(x).logits, pm(x).logits)


def test_a_new_adapter_is_initialised_as_peft_does_it(tiny_checkpoints):
    """Same seed, same weights: A Kaiming-uniform (after nn.Linear's own init, as PEFT draws it), B zero;
    the base frozen, the adapter trainable, logits unchanged until it trains."""
    hf = build_hf_model("qwen3")
    torch.manual_seed(7)
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=ALL7))
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"))
    x = ids(seed=5)
    with torch.no_grad():
        before = model(x).logits
    torch.manual_seed(7)
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=ALL7))
    theirs = {k.replace("base_model.model.", ""): v for k, v in pm.named_parameters() if "lora_" in k}
    ours = {k: v for k, v in model.named_parameters() if "lora_" in k}
    assert theirs.keys() == ours.keys()
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k
    assert all(p.requires_grad == ("lora_" in n) for n, p in model.named_parameters())
    with torch.no_grad():
        assert torch.equal(model(x).logits, before)


def test_targets_all_linear_regex_and_layers(tiny_checkpoints):
    from staticformers.adapters.lora import target_names

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("llama"))
    every = target_names(model, LoraConfig(target_modules="all-linear"))
    assert len(every) == 2 * 7 and "lm_head" not in every
    assert target_names(model, LoraConfig(target_modules=r".*\.1\.self_attn\.(q|v)_proj")) == [
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.self_attn.v_proj",
    ]
    assert target_names(
        model, LoraConfig(target_modules=ALL7, layers_to_transform=[0], exclude_modules=["down_proj"])
    ) == [
        f"model.layers.0.{n}"
        for n in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
        )
    ]
    assert target_names(model, LoraConfig()) == [
        f"model.layers.{i}.self_attn.{n}" for i in (0, 1) for n in ("q_proj", "v_proj")
    ]


def test_switching_disabling_and_deleting_adapters(tiny_checkpoints):
    path = tiny_checkpoints("qwen3")
    model = AutoModelForCausalLM.from_pretrained(path)
    x = ids(seed=6)
    with torch.no_grad():
        base = model(x).logits
        torch.manual_seed(1)
        model.add_adapter(LoraConfig(r=4, target_modules=ALL7, init_lora_weights=False), adapter_name="a")
        with_a = model(x).logits
        torch.manual_seed(2)
        model.add_adapter(LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False), adapter_name="b")
        assert model.active_adapters() == ["b"]
        with_b = model(x).logits
        model.set_adapter("a")
        assert torch.equal(model(x).logits, with_a)
        model.disable_adapters()
        assert torch.equal(model(x).logits, base)
        model.enable_adapters()
        assert torch.equal(model(x).logits, with_a)
        model.set_adapter(["a", "b"])  # summed, as PEFT does
        both = model(x).logits
        assert not torch.allclose(both, with_a) and not torch.allclose(both, with_b)
        model.delete_adapter("a")
        assert model.active_adapters() == ["b"] and list(model.peft_config) == ["b"]
        assert torch.equal(model(x).logits, with_b)
        assert type(model.model.layers[0].mlp.down_proj) is torch.nn.Linear  # only "a" was there
        model.unload()
        assert torch.equal(model(x).logits, base) and not lora_modules(model)


def test_loading_over_an_adapter_of_the_same_shapes_writes_in_place(tiny_checkpoints, tmp_path):
    peft_adapter("qwen3", tmp_path / "one", seed=1)
    two = peft_adapter("qwen3", tmp_path / "two", seed=2)
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"))
    model.load_adapter(tmp_path / "one")
    before = {n: (p, p.data_ptr()) for n, p in model.named_parameters()}
    model.load_adapter(tmp_path / "two")  # same name ("default"), same modules and ranks
    assert {n: (p, p.data_ptr()) for n, p in model.named_parameters()} == before
    x = ids(seed=8)
    with torch.no_grad():
        assert_close(model(x).logits, two(x).logits)
    peft_adapter("qwen3", tmp_path / "other", r=2)
    with pytest.raises(ValueError, match="other modules or with other ranks"):
        model.load_adapter(tmp_path / "other")


def test_from_pretrained_of_an_adapter_folder_loads_its_base(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints("mistral")
    model = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(3)
    model.add_adapter(LoraConfig(r=4, target_modules=ALL7, init_lora_weights=False))
    model.save_pretrained(tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())["base_model_name_or_path"] == path
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "adapter")
    x = ids(seed=9)
    with torch.no_grad():
        assert torch.equal(again(x).logits, model(x).logits)


# ---- refusals ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(bias="all"), "bias='all' trains the base layers' biases"),
        (dict(use_dora=True), "DoRA"),
        (dict(fan_in_fan_out=True), "Conv1D"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(init_lora_weights="pissa"), "PiSSA"),
        (dict(r=0), "r=0 must be a positive integer"),
        (dict(lora_dropout=1.0), r"lora_dropout=1.0 must be a number in \[0, 1\)"),
        (dict(target_modules=[]), "target_modules=\\[\\] must be a list of module names"),
    ],
)
def test_configs_we_cannot_honour_are_refused(kwargs, message):
    with pytest.raises(AdapterConfigError, match=message):
        LoraConfig(**kwargs)


@pytest.mark.parametrize(
    "targets, message",
    [
        (["qproj"], "entry 'qproj' matches no projection of this model: use names among .*down_proj"),
        (["lm_head"], "the output head or the embedding"),
        ("nothing_matches", "selects no projection"),
    ],
)
def test_targets_that_match_nothing_are_refused_and_nothing_changes(tiny_checkpoints, targets, message):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"))
    with pytest.raises(AdapterConfigError, match=message):
        model.add_adapter(LoraConfig(target_modules=targets))
    assert not lora_modules(model) and all(p.requires_grad for p in model.parameters())


def _edit_config(folder, **changes):
    path = folder / ADAPTER_CONFIG
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _rewrite_weights(folder, edit):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / ADAPTER_WEIGHTS))
    edit(tensors)
    save_file(tensors, str(folder / ADAPTER_WEIGHTS))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda f: _edit_config(f, peft_type="PREFIX_TUNING"), "peft_type='PREFIX_TUNING' is not LoRA"),
        (lambda f: _edit_config(f, use_dora=True), "DoRA"),
        (lambda f: _edit_config(f, layer_replication=[[0, 1]]), "layer_replication=.*PEFT feature"),
        (lambda f: _edit_config(f, r=8), "with r=8 in adapter_config.json"),
        (lambda f: (f / ADAPTER_CONFIG).write_text("{not json"), "is not valid JSON"),
        (lambda f: os.remove(f / ADAPTER_CONFIG), "has no adapter_config.json"),
        (lambda f: os.remove(f / ADAPTER_WEIGHTS), "has no adapter_model.safetensors"),
        (lambda f: (f / ADAPTER_WEIGHTS).write_bytes(b"\x00" * 12), "adapter_model.safetensors"),
        (
            lambda f: _rewrite_weights(f, lambda t: t.update({"base_model.model.lm_head.weight": torch.zeros(2, 2)})),
            "not the lora_A or lora_B weight",
        ),
        (
            lambda f: _rewrite_weights(f, lambda t: t.pop("base_model.model.model.layers.0.mlp.up_proj.lora_B.weight")),
            "has lora_A but no lora_B for model.layers.0.mlp.up_proj",
        ),
        (
            lambda f: _rewrite_weights(
                f, lambda t: t["base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight"].fill_(float("nan"))
            ),
            "NaN or infinite",
        ),
        (
            lambda f: _rewrite_weights(
                f,
                lambda t: t.update({"base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight": torch.zeros(4, 32)}),
            ),
            "trained on another model",
        ),
        (
            lambda f: _edit_config(f, target_modules=["nope_proj"]),
            r"adapter_model.safetensors: its adapter_config.json does not fit this model: target_modules entry 'nope_proj' "
            r"matches no projection",
        ),
        (
            lambda f: _edit_config(f, target_modules=["q_proj"]),
            r"has weights for model.layers.0.mlp.down_proj and \d+ more, which its adapter_config.json does not target "
            r"\(target_modules=\['q_proj'\]\): the config and the weights disagree; fix the config\.$",
        ),
        (
            lambda f: _edit_config(f, rank_pattern={"q_proj(": 8}),
            r"rank_pattern key 'q_proj\(' is not a regular expression \(missing \), unterminated subpattern",
        ),
    ],
)
def test_damaged_or_foreign_adapter_folders_are_refused_and_nothing_changes(
    tiny_checkpoints, tmp_path, damage, message
):
    peft_adapter("qwen3", tmp_path / "a")
    damage(tmp_path / "a")
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"))
    with pytest.raises((AdapterFileError, AdapterConfigError), match=message):
        model.load_adapter(tmp_path / "a")
    assert not lora_modules(model) and not getattr(model, "peft_config", None)


def test_an_adapter_for_a_module_this_model_lacks_is_refused(tiny_checkpoints, tmp_path):
    peft_adapter("qwen3", tmp_path / "a")
    _rewrite_weights(
        tmp_path / "a",
        lambda t: t.update(
            {
                "base_model.model.model.layers.5.mlp.up_proj.lora_A.weight": torch.zeros(4, 64),
                "base_model.model.model.layers.5.mlp.up_proj.lora_B.weight": torch.zeros(128, 4),
            }
        ),
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"))
    with pytest.raises(AdapterFileError, match="model.layers.5.mlp.up_proj, which is not a projection"):
        model.load_adapter(tmp_path / "a")


def test_adapter_methods_without_an_adapter_say_so(tiny_checkpoints):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"))
    for call in (lambda: model.set_adapter("x"), model.disable_adapters, model.merge_and_unload, model.active_adapters):
        with pytest.raises(ValueError, match="this model has none: add one with model.add_adapter"):
            call()
    model.add_adapter(LoraConfig())
    with pytest.raises(ValueError, match="has an adapter named 'default' already"):
        model.add_adapter(LoraConfig())
    with pytest.raises(ValueError, match="no adapter named 'nope'"):
        model.set_adapter("nope")
    with pytest.raises(ValueError, match="adapter_name='a b' must be"):
        model.add_adapter(LoraConfig(), adapter_name="a b")
