"""from_pretrained / save_pretrained: round trips with transformers, sharding, dtypes, the Hub cache, refusals."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from staticformers import AutoModelForCausalLM
from staticformers.models.model_config import ConfigError
from staticformers.checkpoints.hub import CheckpointNotFoundError
from staticformers.models.pretrained import CheckpointError, parse_size
import tolerances as tol


def _ids(batch=2, seq=9):
    return torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(5))


def _copy(src, tmp_path, name="ckpt"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _with_config(src, tmp_path, **changes):
    """A copy of the checkpoint `src` whose config.json has `changes` set."""
    path = _copy(src, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2", "mistral", "qwen3-untied"])
def test_saved_checkpoint_loads_in_transformers_with_same_logits(family, tiny_checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM as HF

    ours = AutoModelForCausalLM.from_pretrained(tiny_checkpoints(family))
    ours.save_pretrained(tmp_path / "out")
    ref = HF.from_pretrained(tmp_path / "out").eval()
    ids = _ids()
    with torch.no_grad():
        tol.assert_close(ours(input_ids=ids).logits, ref(input_ids=ids).logits)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "rope_parameters" in config and "dtype" in config and "torch_dtype" not in config
    if ours.config.tie_word_embeddings:
        assert "lm_head.weight" not in load_file(tmp_path / "out" / "model.safetensors")


def test_sharded_save_and_load(tiny_checkpoints, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("llama"))
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    files = sorted(os.listdir(tmp_path / "sharded"))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 2 and "model.safetensors.index.json" in files and "model.safetensors" not in files
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "sharded")
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, back(input_ids=ids).logits, rtol=0, atol=0)
    from transformers import AutoModelForCausalLM as HF

    ref = HF.from_pretrained(tmp_path / "sharded").eval()
    with torch.no_grad():
        tol.assert_close(ref(input_ids=ids).logits, back(input_ids=ids).logits)
    # saving again unsharded removes the stale shards
    back.save_pretrained(tmp_path / "sharded")
    assert sorted(f for f in os.listdir(tmp_path / "sharded") if "safetensors" in f) == ["model.safetensors"]


def test_dtype_auto_keeps_checkpoint_dtype_and_conversion(tiny_checkpoints, tmp_path):
    fp32 = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"))
    fp32.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype="auto").dtype == torch.bfloat16
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32).dtype == torch.float32
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", torch_dtype="float16").dtype == torch.float16
    # no dtype in config.json: the weights' header decides
    cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    del cfg["dtype"]
    (tmp_path / "bf16" / "config.json").write_text(json.dumps(cfg))
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16


def test_transformers4_style_config_loads(tiny_checkpoints, tmp_path):
    path = _copy(tiny_checkpoints("llama3-scaled"), tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope
    cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    (path / "config.json").write_text(json.dumps(cfg))
    ours = AutoModelForCausalLM.from_pretrained(path)
    assert ours.config.rope_type == "llama3" and ours.config.rope_theta == 500000.0
    new = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("llama3-scaled"))
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, new(input_ids=ids).logits, rtol=0, atol=0)


def test_unknown_config_keys_round_trip(tiny_checkpoints, tmp_path):
    path = _with_config(tiny_checkpoints("qwen3"), tmp_path, my_custom_key={"a": 1})
    AutoModelForCausalLM.from_pretrained(path).save_pretrained(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["my_custom_key"] == {"a": 1}


def test_generation_config_round_trips(tiny_checkpoints, tmp_path):
    path = _copy(tiny_checkpoints("qwen3"), tmp_path)
    (path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [3, 4], "temperature": 0.7, "do_sample": True, "top_k": 20})
    )
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.generation_config.eos_token_id == [3, 4] and model.generation_config.top_k == 20
    model.save_pretrained(tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert saved["eos_token_id"] == [3, 4] and saved["temperature"] == 0.7


def test_loads_offline_from_hub_cache(tiny_checkpoints, tmp_path, monkeypatch):
    """A Hub id resolves from the local cache with local_files_only=True (no network here)."""
    repo = tmp_path / "hub" / "models--tiny--qwen3"
    snap = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny_checkpoints("qwen3"), snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123456789abcdef0123456789abcdef01234567")
    model = AutoModelForCausalLM.from_pretrained("tiny/qwen3", cache_dir=str(tmp_path / "hub"), local_files_only=True)
    assert model.config.architecture == "Qwen3ForCausalLM"
    with pytest.raises(CheckpointNotFoundError, match="not in the local Hub cache"):
        AutoModelForCausalLM.from_pretrained("tiny/absent", cache_dir=str(tmp_path / "hub"), local_files_only=True)


def test_meta_init_leaves_nothing_on_meta(tiny_checkpoints):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"), dtype="bfloat16", device_map="cpu")
    assert all(not t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert model.lm_head.weight is model.model.embed_tokens.weight


# ---- refusals: one sentence naming the thing ---------------------------------------------------
def test_refuses_pickle_checkpoint(tiny_checkpoints, tmp_path):
    path = _copy(tiny_checkpoints("qwen3"), tmp_path)
    os.rename(path / "model.safetensors", path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*never unpickles.*safetensors"):
        AutoModelForCausalLM.from_pretrained(path)


def test_refuses_folder_without_weights(tiny_checkpoints, tmp_path):
    path = _copy(tiny_checkpoints("qwen3"), tmp_path)
    os.remove(path / "model.safetensors")
    with pytest.raises(CheckpointNotFoundError, match="no model.safetensors"):
        AutoModelForCausalLM.from_pretrained(path)


def test_refuses_missing_shard(tiny_checkpoints, tmp_path):
    AutoModelForCausalLM.from_pretrained(tiny_checkpoints("llama")).save_pretrained(
        tmp_path / "s", max_shard_size="40KB"
    )
    shard = sorted(f for f in os.listdir(tmp_path / "s") if f.endswith(".safetensors"))[1]
    os.remove(tmp_path / "s" / shard)
    with pytest.raises(CheckpointNotFoundError, match=f"Shard {shard}.*missing"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "s")


def test_refuses_corrupt_header(tiny_checkpoints, tmp_path):
    path = _copy(tiny_checkpoints("qwen3"), tmp_path)
    (path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match=r"model\.safetensors is not a readable safetensors file"):
        AutoModelForCausalLM.from_pretrained(path, dtype="float32")


def test_refuses_missing_and_unexpected_weights(tiny_checkpoints, tmp_path):
    path = _copy(tiny_checkpoints("qwen3"), tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"lacks 1 weight.*model\.layers\.1\.mlp\.up_proj\.weight"):
        AutoModelForCausalLM.from_pretrained(path)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(128, 64)
    tensors["model.layers.0.mystery.weight"] = torch.zeros(3)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"does not use: model\.layers\.0\.mystery\.weight"):
        AutoModelForCausalLM.from_pretrained(path)


def test_refuses_shape_mismatch(tiny_checkpoints, tmp_path):
    path = _with_config(tiny_checkpoints("qwen3"), tmp_path, intermediate_size=96)
    with pytest.raises(CheckpointError, match=r"mlp\.\w+_proj\.weight.*has shape.*config\.json implies"):
        AutoModelForCausalLM.from_pretrained(path)


def test_refuses_unsupported_architecture(tiny_checkpoints, tmp_path):
    path = _with_config(tiny_checkpoints("qwen3"), tmp_path, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ConfigError, match=r"GPT2LMHeadModel.*supported are Qwen3ForCausalLM, LlamaForCausalLM"):
        AutoModelForCausalLM.from_pretrained(path)


def test_refuses_unsupported_rope_and_bad_json(tiny_checkpoints, tmp_path):
    path = _with_config(
        tiny_checkpoints("qwen3"), tmp_path, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e6, "factor": 4.0}
    )
    with pytest.raises(ConfigError, match=r"RoPE scaling 'dynamic' is not supported"):
        AutoModelForCausalLM.from_pretrained(path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json is not valid JSON"):
        AutoModelForCausalLM.from_pretrained(path)


def test_refuses_bad_arguments(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints("qwen3")
    with pytest.raises(ConfigError, match=r"dtype='int7' is not a dtype"):
        AutoModelForCausalLM.from_pretrained(path, dtype="int7")
    with pytest.raises(ValueError, match='A quantization_config dict needs "quant_type"'):
        AutoModelForCausalLM.from_pretrained(path, quantization_config={})
    with pytest.raises(CheckpointNotFoundError, match="has no config.json: it is not a complete checkpoint"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(CheckpointNotFoundError, match="is not a folder"):
        AutoModelForCausalLM.from_pretrained(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="max_shard_size='lots' is not a size"):
        parse_size("lots")
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 * 2**20 and parse_size(7) == 7


def test_refuses_unavailable_device(tiny_checkpoints):
    with pytest.raises(RuntimeError, match=r"'neuron' is not available here: install torch-neuronx"):
        AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"), device_map="neuron")


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_saved_weights_get_the_umask_permissions_like_every_other_file(tiny_checkpoints, tmp_path, umask):
    """safetensors' own writer leaves 0600 (a private temporary file renamed): others on a shared machine
    could not read the model. Every file save_pretrained writes, sharded or not, gets 0666 less the umask."""
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"))
    old = os.umask(umask)
    try:
        model.save_pretrained(tmp_path / "one")
        model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    finally:
        os.umask(old)
    for folder in ("one", "sharded"):
        modes = {name: os.stat(tmp_path / folder / name).st_mode & 0o777 for name in os.listdir(tmp_path / folder)}
        assert set(modes.values()) == {0o666 & ~umask}, modes
    assert sum(n.endswith(".safetensors") for n in os.listdir(tmp_path / "sharded")) > 1
