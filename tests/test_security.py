"""No code from a file: a pickle payload (an object whose `__reduce__` runs `os.system` or `open`) in every
file staticformers reads, and a marker file that must never appear.

Files covered: DCP `.metadata` (alone and nested in valid metadata) and DCP byte values, `optimizer.pt`,
`scheduler.pt`, `rng_state.pth` (explicit resume and `resume_from_checkpoint=True`), a pickle
`pytorch_model.bin`, a pickle LoRA adapter `adapter_model.bin` (`load_adapter`, and a LoRA run's
checkpoint resumed), and precompiled artifacts in a cache folder (or as a file) that another user
could have written.
"""

import os
import pickle
import shutil
import stat
import warnings

import pytest
import torch

from staticformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

pytestmark = pytest.mark.usefixtures("one_thread")


class SystemPayload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class OpenPayload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


PAYLOADS = [SystemPayload, OpenPayload]


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "MARKER"
    yield path
    assert not path.exists(), "a payload ran"


def tiny_model(seed=0):
    cfg = AutoConfig.for_model(
        "qwen3",
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    )
    return AutoModelForCausalLM.from_config(cfg, seed=seed)


def docs():
    g = torch.Generator().manual_seed(0)
    return [
        {"input_ids": torch.randint(1, 64, (int(k),), generator=g).tolist()}
        for k in torch.randint(3, 30, (24,), generator=g)
    ]


def targs(path, **kw):
    return TrainingArguments(
        **{
            **dict(
                output_dir=str(path),
                max_length=32,
                per_device_train_batch_size=4,
                max_steps=2,
                save_steps=1,
                disable_tqdm=True,
                learning_rate=1e-3,
            ),
            **kw,
        }
    )


# ---- torch.distributed.checkpoint ---------------------------------------------------------------
@pytest.fixture
def dcp_folder(tmp_path):
    from staticformers.distributed.dcp_checkpoint import save_checkpoint

    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized, assuming ... a single process"
        save_checkpoint(str(tmp_path / "dcp"), model, opt, extra={"step": 1})
    return tmp_path / "dcp"


def load_dcp(folder):
    from staticformers.distributed.dcp_checkpoint import load_checkpoint

    model = tiny_model(seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_checkpoint(str(folder), model, opt), model


def test_dcp_round_trip_still_loads(dcp_folder):
    extra, model = load_dcp(dcp_folder)
    assert extra == {"step": 1}
    assert all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), load_dcp(dcp_folder)[1].state_dict().values())
    )


@pytest.mark.parametrize("payload", PAYLOADS)
def test_dcp_metadata_payload(dcp_folder, marker, payload):
    from staticformers.distributed.dcp_safety import UnsafeCheckpointError

    with open(dcp_folder / ".metadata", "wb") as f:
        pickle.dump(payload(marker), f)
    with pytest.raises(
        UnsafeCheckpointError,
        match=r"\.metadata is not plain torch.distributed.checkpoint metadata .*"
        r"refused without running anything",
    ):
        load_dcp(dcp_folder)


@pytest.mark.parametrize("payload", PAYLOADS)
def test_dcp_payload_nested_in_valid_metadata(dcp_folder, marker, payload):
    from staticformers.distributed.dcp_safety import UnsafeCheckpointError

    with open(dcp_folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own file, trusted here, to build the attack
    metadata.planner_data = {"model.x": payload(marker)}
    with open(dcp_folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(UnsafeCheckpointError, match=r"is not part of DCP metadata"):
        load_dcp(dcp_folder)


def test_dcp_storage_outside_the_folder(dcp_folder, tmp_path):
    from staticformers.distributed.dcp_safety import UnsafeCheckpointError

    with open(dcp_folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    first = next(iter(metadata.storage_data))
    metadata.storage_data[first].relative_path = "../../outside.distcp"
    with open(dcp_folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(UnsafeCheckpointError, match=r"names '../../outside.distcp', a path outside its folder"):
        load_dcp(dcp_folder)


@pytest.mark.parametrize("payload", PAYLOADS)
def test_dcp_byte_value_payload(tmp_path, marker, payload):
    """A non-tensor value (an optimizer's lr) is a pickle inside a .distcp file: PyTorch's default planner
    reads it with weights_only=False; ours does not."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from staticformers.distributed.dcp_safety import UnsafeCheckpointError

    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    optim_sd["param_groups"][0]["lr"] = payload(marker)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path / "dcp"))
    with pytest.raises(
        UnsafeCheckpointError, match=r"'optim.param_groups.0.lr' in the DCP checkpoint is not plain data"
    ):
        load_dcp(tmp_path / "dcp")


# ---- the Trainer's state files ------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained") / "run"
    Trainer(model=tiny_model(), args=targs(out), train_dataset=docs()).train()
    return out


@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt", "rng_state.pth"])
@pytest.mark.parametrize("payload", PAYLOADS)
@pytest.mark.parametrize("auto", [False, True], ids=["explicit", "resume-true"])
def test_state_file_payloads(trained, tmp_path, marker, name, payload, auto):
    from staticformers.training.state_files import CorruptCheckpointError

    out = tmp_path / "run"
    shutil.copytree(trained, out)
    for step in (1, 2):
        torch.save(payload(marker), out / f"checkpoint-{step}" / name)
    with pytest.raises(CorruptCheckpointError, match=rf"{name}.*(nothing in it was run|can be resumed from)"):
        Trainer(model=tiny_model(), args=targs(out, max_steps=3), train_dataset=docs()).train(
            resume_from_checkpoint=True if auto else str(out / "checkpoint-2")
        )


@pytest.mark.parametrize("payload", PAYLOADS)
def test_pickle_weights_are_never_unpickled(tmp_path, marker, payload):
    from staticformers.models.pretrained import CheckpointError

    model = tiny_model()
    model.config.save_pretrained(str(tmp_path / "m"))
    torch.save(payload(marker), tmp_path / "m" / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="never unpickles"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "m")


@pytest.mark.parametrize("payload", PAYLOADS)
def test_pickle_adapters_are_never_unpickled(tmp_path, marker, payload):
    from staticformers import LoraConfig
    from staticformers.adapters.files import AdapterFileError

    model = tiny_model()
    model.add_adapter(LoraConfig())
    model.save_pretrained(tmp_path / "a")
    os.remove(tmp_path / "a" / "adapter_model.safetensors")
    torch.save(payload(marker), tmp_path / "a" / "adapter_model.bin")
    with pytest.raises(AdapterFileError, match="only a pickle adapter .* never unpickles"):
        tiny_model().load_adapter(tmp_path / "a")


@pytest.mark.parametrize("payload", PAYLOADS)
def test_a_lora_checkpoint_with_a_pickle_adapter_is_never_unpickled(tmp_path, marker, payload):
    from staticformers import LoraConfig
    from staticformers.training.state_files import CorruptCheckpointError

    def lora_model():
        model = tiny_model()
        torch.manual_seed(0)
        model.add_adapter(LoraConfig(target_modules="all-linear"))
        return model

    out = tmp_path / "run"
    Trainer(model=lora_model(), args=targs(out), train_dataset=docs()).train()
    ckpt = out / "checkpoint-2"
    os.remove(ckpt / "adapter_model.safetensors")
    torch.save(payload(marker), ckpt / "adapter_model.bin")
    with pytest.raises(CorruptCheckpointError, match="never unpickles"):
        Trainer(model=lora_model(), args=targs(out, max_steps=3), train_dataset=docs()).train(
            resume_from_checkpoint=str(ckpt)
        )


# ---- precompiled artifacts ------------------------------------------------------------------------
def write_artifact(folder, payload):
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "layer-0123456789abcdef.bin")
    with open(path, "wb") as f:
        pickle.dump(payload, f)
    return path


@pytest.mark.parametrize("payload", PAYLOADS)
@pytest.mark.parametrize("where", ["root-group-writable", "folder-world-writable", "file-group-writable", "symlink"])
def test_precompiled_artifacts_another_user_could_write(tmp_path, marker, payload, where, caplog):
    from staticformers.backends.cpu import precompiled

    root = tmp_path / "cache"
    folder = root / precompiled.FOLDER
    path = write_artifact(str(folder), payload(marker))
    os.chmod(root, 0o700)
    os.chmod(folder, 0o700)
    os.chmod(path, 0o600)
    if where == "root-group-writable":
        os.chmod(root, 0o770)
    elif where == "folder-world-writable":
        os.chmod(folder, 0o777)
    elif where == "file-group-writable":
        os.chmod(path, 0o660)
    else:
        real = write_artifact(str(tmp_path / "elsewhere"), payload(marker))
        os.remove(path)
        os.symlink(real, path)
    assert precompiled.load(path) is None
    assert "is not unpickled" in caplog.text or "are not unpickled" in caplog.text
    assert "chmod go-w" in caplog.text or "symbolic link" in caplog.text


def test_cache_safety_sentences(tmp_path):
    from staticformers.compilation.cache_safety import problem, trusted_file

    (tmp_path / "c").mkdir(mode=0o700)
    os.chmod(tmp_path / "c", 0o777)
    why = problem(str(tmp_path / "c"), is_folder=True)
    assert why.startswith(f"The cache folder {tmp_path / 'c'} is writable by other users (mode 777)")
    assert f"chmod go-w {tmp_path / 'c'}" in why and "STATICFORMERS_CACHE" in why
    os.chmod(tmp_path / "c", 0o700)
    (tmp_path / "c" / "x.bin").write_bytes(b"")
    os.chmod(tmp_path / "c" / "x.bin", 0o600)
    assert trusted_file(str(tmp_path / "c" / "x.bin"), folders_up=1)


def test_our_own_cache_is_private(tmp_path, monkeypatch):
    """The folders and artifacts staticformers creates pass its own check, whatever the umask."""
    from staticformers.compilation import cache_safety

    old = os.umask(0o002)
    try:
        cache_safety.make_private_folder(str(tmp_path / "root" / "precompiled"))
        path = tmp_path / "root" / "precompiled" / "a.bin"
        path.write_bytes(b"x")
        cache_safety.drop_group_write(str(path))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "root" / "precompiled").st_mode) == 0o700
    assert not stat.S_IMODE(os.stat(path).st_mode) & 0o022
    os.chmod(tmp_path / "root", 0o700)
    assert cache_safety.trusted_file(str(path))


def test_unsafe_cache_root_is_not_given_to_inductor(tmp_path, monkeypatch, caplog):
    from staticformers.compilation import compiler as sf_compile

    root = tmp_path / "shared-cache"
    root.mkdir()
    os.chmod(root, 0o777)
    monkeypatch.setenv("STATICFORMERS_CACHE", str(root))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setattr(sf_compile, "_ENABLED_FOR", None)
    sf_compile.enable_persistent_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    assert f"The cache folder {root} is writable by other users" in caplog.text


def test_dcp_metadata_symlinked_out_of_the_folder(dcp_folder, tmp_path):
    from staticformers.distributed.dcp_safety import UnsafeCheckpointError

    os.rename(dcp_folder / ".metadata", tmp_path / "elsewhere.metadata")
    os.symlink(tmp_path / "elsewhere.metadata", dcp_folder / ".metadata")
    with pytest.raises(
        UnsafeCheckpointError, match=r"names '.metadata', which is a symbolic link that resolves outside"
    ):
        load_dcp(dcp_folder)
