"""A missing model folder and a missing tokenizer folder: one exception family, one wording."""

import pytest

from staticformers import AutoModelForCausalLM, AutoTokenizer
from staticformers.checkpoints.hub import CheckpointNotFoundError


LOADERS = {"model": AutoModelForCausalLM.from_pretrained, "tokenizer": AutoTokenizer.from_pretrained}


def _message(load, *args, **kwargs):
    with pytest.raises(CheckpointNotFoundError) as err:  # a FileNotFoundError, so `except OSError` still works
        load(*args, **kwargs)
    assert isinstance(err.value, FileNotFoundError)
    return str(err.value)


@pytest.mark.parametrize("path", ["./no/such/model", "/no/such/model"])
def test_a_missing_folder_reads_the_same_for_model_and_tokenizer(path):
    messages = {name: _message(load, path) for name, load in LOADERS.items()}
    assert (
        messages["model"]
        == messages["tokenizer"]
        == f'{path} is not a folder: pass a checkpoint folder or a Hub id like "Qwen/Qwen3-0.6B".'
    )


def test_an_empty_folder_names_the_missing_file(tmp_path):
    model = _message(AutoModelForCausalLM.from_pretrained, str(tmp_path))
    tokenizer = _message(AutoTokenizer.from_pretrained, str(tmp_path))
    assert model == f"{tmp_path} has no config.json: it is not a complete checkpoint."
    assert tokenizer.startswith(f"{tmp_path} has no tokenizer.json (") and tokenizer.endswith(".")


def test_an_uncached_hub_id_offline_reads_the_same(tmp_path):
    kwargs = dict(cache_dir=str(tmp_path), local_files_only=True)
    model = _message(AutoModelForCausalLM.from_pretrained, "org/not-cached", **kwargs)
    tokenizer = _message(AutoTokenizer.from_pretrained, "org/not-cached", **kwargs)
    tail = "of 'org/not-cached' is not in the local Hub cache and the Hub cannot be reached: download it once while online, or pass a local folder."
    assert model.endswith(tail) and tokenizer.endswith(tail)
