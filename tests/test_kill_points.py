"""A process killed (SIGKILL) at each named point inside the checkpoint writer (`fault_points.py`) never
loses a checkpoint: the last good one loads (tokenizer included), `resume_from_checkpoint=True`
continues bit-identically, and leftovers are recovered or removed, never deleted while they are the
only copy. `save_pretrained` into a folder that holds a model leaves, at every point, a folder that
loads exactly the old model or exactly the new one.

Each kill happens in a forked child of this process (no second import of torch), stopped by the
fault point itself with SIGKILL, which no `finally` sees.
"""

import os
import shutil
import signal
import sys

import pytest
import torch

from staticformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments
from staticformers.utils.fault_points import ENV
from staticformers.training import checkpoint_folders as ckpt

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "darwin", reason="needs fork"),
]


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


def tokenizer():
    from tokenizers import Tokenizer, models

    return Tokenizer(models.WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))


def args(path, **kw):
    return TrainingArguments(
        **{
            **dict(
                output_dir=str(path),
                max_length=32,
                per_device_train_batch_size=4,
                max_steps=4,
                save_steps=1,
                save_total_limit=2,
                disable_tqdm=True,
                learning_rate=1e-3,
                seed=0,
                warmup_steps=1,
                weight_decay=0.01,
            ),
            **kw,
        }
    )


def train(out, resume=None, seed=0, **kw):
    model = tiny_model(seed)
    Trainer(model=model, args=args(out, **kw), train_dataset=docs(), processing_class=tokenizer()).train(
        resume_from_checkpoint=resume
    )
    return model


def killed_at(point, work):
    """Run `work()` in a forked child with the fault point set; assert it died of SIGKILL there."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.environ[ENV] = point
            work()
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(3)  # reached only when the point was not
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"{point} was not reached ({status})"


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return weights(train(tmp_path_factory.mktemp("ref") / "run"))


def assert_loadable_checkpoints(out):
    found = ckpt.list_checkpoints(str(out))
    assert found, "no checkpoint left"
    for _, path in found:
        AutoModelForCausalLM.from_pretrained(path)
        assert os.path.isfile(os.path.join(path, "tokenizer.json")), f"{path} lacks its tokenizer"
        assert ckpt.verify_checkpoint(path) is None


POINTS = [
    "checkpoint:files-written:2",
    "checkpoint:before-rename:2",
    "checkpoint:renamed:2",
    "checkpoint:rotating:1",
    "save_pretrained:weights-staged:2",
    "save_pretrained:weights-replaced:3",
]


@pytest.mark.parametrize("point", POINTS)
def test_kill_during_a_save(tmp_path, reference, point):
    out = tmp_path / "run"
    killed_at(point, lambda: train(out))
    assert_loadable_checkpoints(out)
    resumed = train(out, resume=True, seed=7)
    assert all(torch.equal(v, reference[k]) for k, v in resumed.state_dict().items())
    assert not [n for n in os.listdir(out) if n.startswith(".")], os.listdir(out)  # leftovers handled
    assert [s for s, _ in ckpt.list_checkpoints(str(out))] == [3, 4]


def test_kill_between_the_renames_of_a_resave(tmp_path, reference, caplog):
    """Re-saving an existing step: killed after the old folder moved aside and before the new one moved in,
    the old folder is the only copy; it is renamed back, never deleted."""
    out = tmp_path / "run"
    train(out, save_total_limit=None)
    before = (out / "checkpoint-3" / "model.safetensors").read_bytes()
    killed_at(
        "checkpoint:old-moved-aside:1", lambda: train(out, resume=str(out / "checkpoint-2"), save_total_limit=None)
    )
    names = os.listdir(out)
    assert "checkpoint-3" not in names and any(n.startswith(".old-checkpoint-3-") for n in names)
    assert ckpt.recover_leftovers(str(out))[0].startswith(f"recovered {out / 'checkpoint-3'} from .old-checkpoint-3-")
    assert (out / "checkpoint-3" / "model.safetensors").read_bytes() == before
    assert_loadable_checkpoints(out)
    resumed = train(out, resume=str(out / "checkpoint-3"), seed=7, save_total_limit=None)
    assert all(torch.equal(v, reference[k]) for k, v in resumed.state_dict().items())


def test_a_killed_resave_is_recovered_by_the_next_save(tmp_path):
    out = tmp_path / "run"
    train(out, save_total_limit=None)
    killed_at(
        "checkpoint:old-moved-aside:1", lambda: train(out, resume=str(out / "checkpoint-2"), save_total_limit=None)
    )
    train(out, resume=str(out / "checkpoint-1"), save_total_limit=None, max_steps=2)  # saves step 2 only
    assert [s for s, _ in ckpt.list_checkpoints(str(out))] == [1, 2, 3, 4]
    assert not [n for n in os.listdir(out) if n.startswith(".")]


# ---- save_pretrained into a folder that holds a model ---------------------------------------------
def save(model, folder, shard):
    model.save_pretrained(str(folder), max_shard_size="30KB" if shard else "5GB")


def loads_as(folder):
    return weights(AutoModelForCausalLM.from_pretrained(str(folder)))


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "old_sharded,new_sharded,point,expect",
    [
        (False, False, "save_pretrained:weights-staged", "old"),
        (False, False, "save_pretrained:weights-replaced", "new"),
        (True, False, "save_pretrained:weights-replaced", "old"),  # the old index still wins until it is removed
        (True, False, "save_pretrained:weights-committed", "new"),
        (False, True, "save_pretrained:index-written", "new"),
        (True, True, "save_pretrained:weights-staged", "old"),
        (True, True, "save_pretrained:index-on-temporaries", "new"),  # same shard names: the index names the new files
        (True, True, "save_pretrained:index-written", "new"),
    ],
    ids=lambda v: str(v),
)
def test_save_pretrained_over_an_existing_model(tmp_path, old_sharded, new_sharded, point, expect):
    folder = tmp_path / "model"
    old, new = tiny_model(seed=1), tiny_model(seed=2)
    save(old, folder, old_sharded)
    (folder / "tokenizer.json").write_text("{}")  # a file of the user's: kept
    killed_at(point, lambda: save(new, folder, new_sharded))
    assert same(loads_as(folder), weights(old if expect == "old" else new))
    assert (folder / "tokenizer.json").read_text() == "{}"
    # the next save over the debris gives the newest model and no leftovers
    newest = tiny_model(seed=3)
    save(newest, folder, new_sharded)
    assert same(loads_as(folder), weights(newest))
    assert not [n for n in os.listdir(folder) if n.startswith(".")], os.listdir(folder)
    if old_sharded != new_sharded:
        stale = "model.safetensors.index.json" if not new_sharded else "model.safetensors"
        assert stale not in os.listdir(folder)


def test_save_pretrained_writes_with_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        save(tiny_model(), tmp_path / "m", shard=False)
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "m" / "model.safetensors").st_mode & 0o777 == 0o644


def test_transformers_loads_after_an_interrupted_save(tmp_path):
    import transformers

    folder = tmp_path / "model"
    save(tiny_model(seed=1), folder, True)
    killed_at("save_pretrained:index-on-temporaries", lambda: save(tiny_model(seed=2), folder, True))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder))
    ours = AutoModelForCausalLM.from_pretrained(str(folder))
    x = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, ref(x).logits, rtol=1e-4, atol=1e-5)
    shutil.rmtree(folder)
