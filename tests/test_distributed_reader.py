"""The sliced safetensors reader behind sharded loading: any slice, any dtype, only the rows it needs."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from staticformers.distributed import reader
from staticformers.checkpoints.safetensors_io import SafetensorsFile


@pytest.fixture
def file(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "w": torch.randn(40, 24, generator=g),
        "b": torch.randn(7, generator=g),
        "h": torch.randn(6, 5, generator=g).to(torch.bfloat16),
    }
    path = str(tmp_path / "model.safetensors")
    save_file(tensors, path)
    return path, tensors


@pytest.mark.parametrize("offsets, lengths", [([10, 0], [20, 24]), ([0, 8], [40, 8]), ([5, 3], [9, 17])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slices_in_any_dtype(file, offsets, lengths, dtype, monkeypatch):
    monkeypatch.setattr(reader, "CHUNK_BYTES", 3 * 24 * 4)  # force several chunks
    path, tensors = file
    target = torch.empty(lengths, dtype=dtype)
    with SafetensorsFile(path) as f:
        reader.read_slice(f, "w", offsets, lengths, target)
    expected = tensors["w"][offsets[0] : offsets[0] + lengths[0], offsets[1] : offsets[1] + lengths[1]].to(dtype)
    assert torch.equal(target, expected)


def test_vectors_and_bf16_sources(file):
    path, tensors = file
    with SafetensorsFile(path) as f:
        b = torch.empty(3)
        reader.read_slice(f, "b", [4], [3], b)
        h = torch.empty(2, 5)
        reader.read_slice(f, "h", [1, 0], [2, 5], h)
    assert torch.equal(b, tensors["b"][4:7])
    assert torch.equal(h, tensors["h"][1:3].float())


def test_a_row_range_in_place_reads_straight_into_the_shard(file, monkeypatch):
    path, tensors = file
    target = torch.zeros(8, 24)
    with SafetensorsFile(path) as f:
        monkeypatch.setattr(torch, "empty", None)  # no temporary may be made
        reader.read_slice(f, "w", [16, 0], [8, 24], target)
    assert torch.equal(target, tensors["w"][16:24])


def test_only_the_checkpoints_own_files_are_listed(tmp_path):
    """A stray safetensors file in the folder (stale shard, consolidated.safetensors) is not read."""
    import torch.distributed.checkpoint as dcp

    save_file({"w": torch.ones(4, 2)}, str(tmp_path / "model.safetensors"))
    save_file({"w": torch.zeros(4, 2)}, str(tmp_path / "zz-stale.safetensors"))
    state = {"w": torch.empty(4, 2)}
    dcp.load(state, storage_reader=reader.SlicedSafetensorsReader(str(tmp_path), [str(tmp_path / "model.safetensors")]))
    assert torch.equal(state["w"], torch.ones(4, 2))
