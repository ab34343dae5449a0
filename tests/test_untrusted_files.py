"""Files from a checkpoint or tokenizer folder are untrusted: names stay inside the folder, headers are
checked as the safetensors library checks them, values are checked, and each refusal is one sentence
that names the file (and never echoes another file's bytes or size)."""

import json
import os
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from staticformers import AutoModelForCausalLM, AutoTokenizer
from staticformers.utils.contained_paths import OutsideFolderError
from staticformers.models.pretrained import CheckpointError

from tiny import save_tiny
from tokenizer_fixtures import build_qwen


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return save_tiny("qwen3", str(tmp_path_factory.mktemp("ckpt") / "qwen3"))


@pytest.fixture
def ckpt(qwen3, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(qwen3, path)
    return path


SECRET = b"root:x:0:0:secret-line-that-must-never-be-echoed\n" * 50


@pytest.fixture
def outside(tmp_path):
    """A file outside every checkpoint folder, like /etc/passwd."""
    (tmp_path / "outside").mkdir()
    target = tmp_path / "outside" / "evil.safetensors"
    target.write_bytes(SECRET)
    return target


def shard(ckpt, names):
    """Split model.safetensors into one shard per entry of `names` (a name may repeat) and write the index."""
    tensors = load_file(ckpt / "model.safetensors")
    os.remove(ckpt / "model.safetensors")
    keys = sorted(tensors)
    weight_map = {}
    half = len(keys) // 2
    save_file({k: tensors[k] for k in keys[:half]}, ckpt / "a.safetensors")
    save_file({k: tensors[k] for k in keys[half:]}, ckpt / "b.safetensors")
    for i, k in enumerate(keys):
        weight_map[k] = "a.safetensors" if i < half else "b.safetensors"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map, keys


def write_index(ckpt, weight_map):
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def assert_no_leak(err):
    text = str(err.value)
    assert "secret-line" not in text and str(len(SECRET)) not in text


@pytest.mark.parametrize(
    "name",
    ["../outside/evil.safetensors", "sub/../../outside/evil.safetensors", "ABSOLUTE", "..\\outside\\evil.safetensors"],
)
def test_index_names_outside_the_folder(ckpt, outside, name):
    weight_map, keys = shard(ckpt, None)
    weight_map[keys[0]] = str(outside) if name == "ABSOLUTE" else name
    write_index(ckpt, weight_map)
    with pytest.raises(CheckpointError, match=r"model.safetensors.index.json of .* names .* outside its folder") as err:
        AutoModelForCausalLM.from_pretrained(ckpt)
    assert_no_leak(err)


def test_symlinks_out_of_the_folder(ckpt, outside):
    weight_map, keys = shard(ckpt, None)
    os.symlink(outside, ckpt / "c.safetensors")
    weight_map[keys[0]] = "c.safetensors"
    write_index(ckpt, weight_map)
    with pytest.raises(
        CheckpointError, match=r"names 'c.safetensors', which is a symbolic link that resolves outside"
    ) as err:
        AutoModelForCausalLM.from_pretrained(ckpt)
    assert_no_leak(err)
    # a symlinked directory inside the folder that leads out of it
    os.symlink(outside.parent, ckpt / "sub")
    weight_map[keys[0]] = "sub/evil.safetensors"
    write_index(ckpt, weight_map)
    with pytest.raises(CheckpointError, match=r"names 'sub/evil.safetensors', which resolves outside"):
        AutoModelForCausalLM.from_pretrained(ckpt)


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "generation_config.json"])
def test_fixed_names_that_are_symlinks_out(ckpt, outside, name):
    if (ckpt / name).exists():
        os.remove(ckpt / name)
    os.symlink(outside, ckpt / name)
    with pytest.raises(
        OutsideFolderError, match=rf"names '{name}', which is a symbolic link that resolves outside"
    ) as err:
        AutoModelForCausalLM.from_pretrained(ckpt)
    assert_no_leak(err)


def test_symlinks_inside_the_folder_load(ckpt):
    os.rename(ckpt / "model.safetensors", ckpt / "real.safetensors")
    os.symlink("real.safetensors", ckpt / "model.safetensors")
    AutoModelForCausalLM.from_pretrained(ckpt)


@pytest.mark.parametrize(
    "weight_map,match",
    [
        ({"model.embed_tokens.weight": 3}, r"maps weight 'model.embed_tokens.weight' to 3, not to a shard file name"),
        ({"model.embed_tokens.weight": None}, r"to None, not to a shard"),
        ({"model.embed_tokens.weight": ["a.safetensors"]}, r"not to a shard"),
        ("a.safetensors", r'has no "weight_map" object'),
        ({}, r'has no "weight_map" object'),
    ],
)
def test_malformed_index(ckpt, weight_map, match):
    shard(ckpt, None)
    write_index(ckpt, weight_map)
    with pytest.raises(CheckpointError, match=match):
        AutoModelForCausalLM.from_pretrained(ckpt)
    (ckpt / "model.safetensors.index.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=r"index.json should hold a JSON object"):
        AutoModelForCausalLM.from_pretrained(ckpt)


# ---- safetensors headers -------------------------------------------------------------------------
def raw_file(path, header, data):
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def header_of(path):
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def test_header_checks_match_the_safetensors_library(ckpt):
    """Each broken header is refused by safetensors itself and by us, with a sentence naming the file."""
    from safetensors import safe_open

    header, data = header_of(ckpt / "model.safetensors")
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    first, second = names[0], names[1]
    size0 = header[first]["data_offsets"][1]

    def variant(change):
        h = json.loads(json.dumps(header))
        extra = change(h)
        return h, data + (extra or b"")

    cases = {
        "overlap": lambda h: h[second].update(data_offsets=[size0 - 4, h[second]["data_offsets"][1] - 4]),
        "gap": lambda h: (
            [h[n].update(data_offsets=[h[n]["data_offsets"][0] + 4, h[n]["data_offsets"][1] + 4]) for n in names[1:]]
            and b"\0" * 4
        ),
        "trailing bytes": lambda h: b"\0" * 16,
        "truncated": lambda h: h[names[-1]].update(
            data_offsets=[h[names[-1]]["data_offsets"][0], h[names[-1]]["data_offsets"][1] + 4]
        ),
        "bad dtype": lambda h: h[first].update(dtype="F7"),
        "negative shape": lambda h: h[first].update(shape=[-1, 64]),
        "string shape": lambda h: h[first].update(shape=["128", 64]),
        "bool offsets": lambda h: h[first].update(data_offsets=[False, size0]),
        "size mismatch": lambda h: h[first].update(shape=[64, 64]),
        "metadata not strings": lambda h: h.update(__metadata__={"format": 1}),
    }
    for change in cases.values():
        h, d = variant(change)
        raw_file(ckpt / "model.safetensors", h, d)
        with pytest.raises(Exception):  # noqa: B017 (safetensors raises several types)
            with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
                [f.get_tensor(k) for k in f.keys()]
        with pytest.raises(
            CheckpointError,
            match=r"model.safetensors is not a readable safetensors file \(.*\): "
            r"re-download or re-save it\.$",
        ):
            AutoModelForCausalLM.from_pretrained(ckpt)
    # the same name twice in the header
    blob = json.dumps(header).encode()
    dup = blob[:-1] + b', "' + first.encode() + b'": ' + json.dumps(header[first]).encode() + b"}"
    (ckpt / "model.safetensors").write_bytes(struct.pack("<Q", len(dup)) + dup + data)
    with pytest.raises(CheckpointError, match=rf"names tensor '{first}' twice"):
        AutoModelForCausalLM.from_pretrained(ckpt)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
def test_integer_weights_are_refused(ckpt, dtype):
    tensors = load_file(ckpt / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(
        CheckpointError,
        match=rf"Weight {name} in model.safetensors is stored as "
        rf"{str(dtype).removeprefix('torch.')}, .* floating point",
    ):
        AutoModelForCausalLM.from_pretrained(ckpt)


# ---- a stored head under a tied config: transformers keeps it -------------------------------------
def test_stored_head_with_a_tied_config_is_kept_as_transformers_does(tmp_path, caplog):
    import transformers

    path = save_tiny("qwen3-untied", str(tmp_path / "m"))
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    ref = transformers.AutoModelForCausalLM.from_pretrained(path)
    ours = AutoModelForCausalLM.from_pretrained(path)
    assert "NOT tied" in caplog.text
    assert ours.lm_head.weight.data_ptr() != ours.model.embed_tokens.weight.data_ptr()
    x = torch.tensor([[1, 5, 9, 30, 2]])
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, ref(x).logits, rtol=1e-4, atol=1e-5)
    # the same values stored twice: tied, as transformers does, and no warning
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, tmp_path / "m" / "model.safetensors")
    caplog.clear()
    tied = AutoModelForCausalLM.from_pretrained(path)
    assert "NOT tied" not in caplog.text
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()


# ---- tokenizer folders ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen_tokenizer(tmp_path_factory):
    return build_qwen(tmp_path_factory.mktemp("tok") / "qwen")


@pytest.fixture
def tok_folder(qwen_tokenizer, tmp_path):
    shutil.copytree(qwen_tokenizer, tmp_path / "tok")
    return tmp_path / "tok"


@pytest.mark.parametrize(
    "name", ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"]
)
def test_tokenizer_files_that_are_symlinks_out(tok_folder, outside, name):
    target = tok_folder / name
    if target.exists():
        os.remove(target)
    os.symlink(outside, target)
    with pytest.raises(
        OutsideFolderError, match=rf"names '{name}', which is a symbolic link that resolves outside"
    ) as err:
        AutoTokenizer.from_pretrained(tok_folder)
    assert_no_leak(err)


def test_chat_template_dir_symlinks_and_subfolder(tok_folder, outside):
    (tok_folder / "chat_templates").mkdir()
    os.symlink(outside, tok_folder / "chat_templates" / "tool.jinja")
    with pytest.raises(OutsideFolderError, match=r"chat_templates/tool.jinja"):
        AutoTokenizer.from_pretrained(tok_folder)
    with pytest.raises(OutsideFolderError, match=r"subfolder names '../outside'"):
        AutoTokenizer.from_pretrained(tok_folder, subfolder="../outside")


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"model_max_length": -5}, r"model_max_length=-5 must be a positive integer"),
        ({"model_max_length": 0}, r"model_max_length=0"),
        ({"model_max_length": "512"}, r"model_max_length='512'"),
        ({"model_max_length": True}, r"model_max_length=True"),
        ({"clean_up_tokenization_spaces": "false"}, r"clean_up_tokenization_spaces='false' must be true or false"),
        ({"padding_side": "middle"}, r"padding_side must be 'left' or 'right'"),
        ({"model_input_names": "input_ids"}, r"model_input_names='input_ids' must be a list"),
        ({"added_tokens_decoder": {"x": {"content": "a"}}}, r"added_tokens_decoder\['x'\] must map a token id"),
        ({"chat_template": [{"name": "default"}]}, r"chat_template, as a list, must hold"),
        ({"chat_template": 5}, r"chat_template must be a string"),
    ],
)
def test_tokenizer_config_values(tok_folder, changes, match):
    path = tok_folder / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**config, **changes}))
    with pytest.raises(ValueError, match=match):
        AutoTokenizer.from_pretrained(tok_folder)
    if "model_max_length" in changes:  # an override is checked the same way
        path.write_text(json.dumps(config))
        with pytest.raises(ValueError, match=match):
            AutoTokenizer.from_pretrained(tok_folder, model_max_length=changes["model_max_length"])


# ---- sampling options, from a call or from generation_config.json ----------------------------------
@pytest.mark.parametrize(
    "key,value",
    [
        ("temperature", "0.7"),
        ("temperature", float("nan")),
        ("temperature", True),
        ("top_p", "0.9"),
        ("min_p", float("inf")),
        ("repetition_penalty", "1.1"),
        ("do_sample", "true"),
    ],
)
def test_sampling_options_of_the_wrong_type(ckpt, key, value):
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    prompt = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match=rf"{key}={value!r} must be (a finite number|True or False)"):
        model.generate(prompt, max_new_tokens=2, disable_compile=True, **{"do_sample": True, key: value})
    (ckpt / "generation_config.json").write_text(json.dumps({"do_sample": True, key: value}))
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    with pytest.raises(ValueError, match=rf"{key}=.* must be (a finite number|True or False)"):
        model.generate(prompt, max_new_tokens=2, disable_compile=True)
