"""config.json values of the wrong type or out of range: one sentence naming the key, never a model.

Each class of value gets its examples and the variants a reader would try next (a string, a bool,
zero, a negative, NaN/inf, null where a value is needed); a valid config of each family still loads.
"""

import json
import math

import pytest
import torch

from staticformers import AutoModelForCausalLM
from staticformers.models.model_config import ConfigError, ModelConfig

from tiny import hf_config, save_tiny

NAN, INF = float("nan"), float("inf")


def raw(family="qwen3", **changes):
    d = hf_config(family).to_dict()
    d.update(changes)
    return d


def refused(match, **changes):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(raw(**changes), source="cfg.json")


@pytest.mark.parametrize(
    "key",
    [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
    ],
)
@pytest.mark.parametrize("value", [True, False, 0, -16, 3.5, "64", [64], INF])
def test_integer_fields(key, value):
    refused(rf"cfg.json: {key}=.* must be a positive integer", **{key: value})


@pytest.mark.parametrize("key", ["vocab_size", "hidden_size", "max_position_embeddings"])
def test_required_integer_missing_or_null(key):
    refused(rf"cfg.json has no '{key}'", **{key: None})


def test_odd_head_dim_and_head_multiple():
    refused("head_dim=15 is odd", head_dim=15)
    refused("not a multiple of num_key_value_heads=3", num_key_value_heads=3)


@pytest.mark.parametrize("value", [-1, 0, NAN, INF, -INF, "1e-6", True, None, [1e-6]])
def test_rms_norm_eps(value):
    refused(r"rms_norm_eps=.* must be a (finite )?number", rms_norm_eps=value)


@pytest.mark.parametrize("theta", [0, -10000.0, 1.0, 0.5, NAN, INF, "10000", True])
def test_rope_theta_both_spellings(theta):
    refused(r"rope_theta=.* must be a (finite )?number", rope_parameters={"rope_type": "default", "rope_theta": theta})
    d = raw(rope_theta=theta)
    d.pop("rope_parameters")
    with pytest.raises(ConfigError, match=r"rope_theta=.* must be a (finite )?number"):
        ModelConfig.from_dict(d, source="cfg.json")


@pytest.mark.parametrize("value", ["default", 10000.0, ["rope_theta"], True])
def test_rope_parameters_must_be_an_object(value):
    refused(r"rope_parameters=.* must be a JSON object", rope_parameters=value)
    d = raw(rope_scaling=value)
    d.pop("rope_parameters")
    with pytest.raises(ConfigError, match=r"rope_scaling=.* must be a JSON object"):
        ModelConfig.from_dict(d, source="cfg.json")


@pytest.mark.parametrize(
    "params,match",
    [
        ({"rope_type": "linear", "factor": 0}, "factor=0 must be a finite number above 0"),
        ({"rope_type": "linear", "factor": "2"}, "factor='2' must be a number"),
        ({"rope_type": "linear", "factor": NAN}, "factor=nan"),
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": -64},
            "original_max_position_embeddings=-64",
        ),
        ({"rope_type": "yarn", "factor": 4.0, "beta_fast": -32}, "beta_fast=-32"),
        ({"rope_type": "yarn", "factor": 4.0, "attention_factor": INF}, "attention_factor=inf"),
        ({"rope_type": "yarn", "factor": 4.0, "truncate": "no"}, "truncate='no' must be true or false"),
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 4.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "high_freq_factor > low_freq_factor",
        ),
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": "4",
                "original_max_position_embeddings": 64,
            },
            "high_freq_factor='4' must be a number",
        ),
    ],
)
def test_rope_scaling_values(params, match):
    refused(match, rope_parameters={"rope_theta": 10000.0, **params})


@pytest.mark.parametrize("key", ["tie_word_embeddings", "attention_bias", "use_sliding_window"])
@pytest.mark.parametrize("value", ["false", "true", 0, 1, "no", []])
def test_booleans_are_json_booleans(key, value):
    refused(rf"{key}=.* must be true or false", **{key: value})


def test_llama_mlp_bias_string():
    with pytest.raises(ConfigError, match="mlp_bias='false' must be true or false"):
        ModelConfig.from_dict(raw("llama", mlp_bias="false"), source="cfg.json")


@pytest.mark.parametrize("value", [-3, 0, 2.5, "4096", True])
def test_sliding_window(value):
    with pytest.raises(ConfigError, match=r"sliding_window=.* must be a positive integer"):
        ModelConfig.from_dict(raw("mistral", sliding_window=value), source="cfg.json")


@pytest.mark.parametrize("key", ["eos_token_id", "bos_token_id", "pad_token_id"])
@pytest.mark.parametrize("value", [-1, 128, 10**9, "2", 2.0, True])
def test_token_ids_in_the_vocabulary(key, value):
    refused(rf"{key}=.* must be a token id.* from 0 to 127", **{key: value})


@pytest.mark.parametrize("value", [[1, -1], [], [1, "2"], [[1]]])
def test_eos_lists(value):
    refused(r"eos_token_id=.* must be a token id or a list of token ids", eos_token_id=value)


def test_other_checked_fields():
    refused(r"max_window_layers=-1 must be an integer of 0 or more", max_window_layers=-1)
    refused(r"layer_types has 1 entries for 2 layers", layer_types=["full_attention"])
    refused(r"layer_types holds 'local'", layer_types=["full_attention", "local"])
    refused(r"layer_types must be a list of strings", layer_types="full_attention")
    refused(r"hidden_act=1 must be a string", hidden_act=1)
    refused(r"architectures=.* must be a list", architectures=[1])
    refused(r"model_type=\['qwen3'\] must be a string", architectures=None, model_type=["qwen3"])


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2", "mistral-window", "llama3-scaled", "qwen3-yarn"])
def test_valid_configs_still_load(family):
    cfg = ModelConfig.from_dict(raw(family), source="cfg.json")
    assert cfg.rms_norm_eps > 0 and cfg.rope_theta > 1
    assert ModelConfig.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()


def test_from_pretrained_refuses_before_loading(tmp_path):
    """Through the public loader: the sentence names the file; lists of eos ids in range load."""
    path = save_tiny("qwen3", str(tmp_path / "m"))
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    for key, value, match in [
        ("rms_norm_eps", -1, "rms_norm_eps=-1"),
        ("tie_word_embeddings", "false", "tie_word_embeddings=.false. must be true or false"),
        ("eos_token_id", -1, "eos_token_id=-1"),
        ("hidden_size", True, "hidden_size=True"),
        ("rms_norm_eps", NAN, "rms_norm_eps=nan"),
    ]:
        (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(ConfigError, match=rf"config.json: {match}"):
            AutoModelForCausalLM.from_pretrained(path)
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "eos_token_id": [1, 2], "bos_token_id": 0}))
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.eos_token_id == [1, 2]
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert all(math.isfinite(v) for v in logits.flatten().tolist())
