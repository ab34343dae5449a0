"""checkpoints/gguf_header.py: a GGUF header read in one pass equals what the gguf package's GGUFReader reads (every
value type, arrays, a custom alignment, quantized and float tensors, the suite's real model file), tensors read
through it equal the reader's, and a file it leaves aside goes to the reader or is refused in one sentence."""

from __future__ import annotations

import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from staticformers.checkpoints.gguf_file import GGUFError, GGUFFile, _value  # noqa: E402
from staticformers.checkpoints.gguf_header import NotParsed, read_header  # noqa: E402


def reader_view(path: str) -> tuple[dict, list, int]:
    r = gguf.GGUFReader(path)
    metadata = {k: _value(f, gguf) for k, f in r.fields.items() if not k.startswith("GGUF.")}
    tensors = [(t.name, int(t.tensor_type), tuple(t.shape.tolist()), int(t.data_offset)) for t in r.tensors]
    return metadata, tensors, r.data_offset


def header_view(path: str) -> tuple[dict, list, int]:
    h = read_header(path)
    return h.metadata, [(t.name, t.ggml_type, t.dims, h.data_start + t.offset) for t in h.tensors], h.data_start


def write(path: str, alignment: int | None = None) -> str:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ▁world")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.strs", ["a", "", "ünï", "<|im_start|>"])
    w.add_array("t.bools", [True, False])
    w.add_array("t.empty", [])
    w.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 32)).astype(np.float16))
    q = rng.standard_normal((4, 64)).astype(np.float32)
    w.add_tensor(
        "q8", gguf.quants.quantize(q, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0
    )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_the_header_is_the_readers(tmp_path, alignment):
    path = write(str(tmp_path / "t.gguf"), alignment)
    assert header_view(path) == reader_view(path)
    assert read_header(path).metadata["t.strs"] == ["a", "", "ünï", "<|im_start|>"]
    f = GGUFFile(path)
    r = gguf.GGUFReader(path)
    for t in r.tensors:
        want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(f.shape(t.name))
        assert np.array_equal(f.read(t.name).numpy(), want.astype(np.float32)), t.name


def test_the_real_model_files_header_is_the_readers():
    from real_model_cache import GGUF_NAME, installed_gguf

    folder, why = installed_gguf()
    if folder is None:
        pytest.skip(why)
    path = os.path.join(folder, GGUF_NAME)
    assert header_view(path) == reader_view(path)


def test_files_it_leaves_aside_go_to_the_reader_or_are_refused(tmp_path):
    path = write(str(tmp_path / "t.gguf"))
    data = open(path, "rb").read()
    old = tmp_path / "v1.gguf"
    old.write_bytes(data[:4] + (1).to_bytes(4, "little") + data[8:])
    with pytest.raises(NotParsed, match="version 1"):
        read_header(str(old))
    with pytest.raises(GGUFError, match="is not a GGUF file the gguf package can read .*re-download"):
        GGUFFile(str(old))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:200])
    with pytest.raises(NotParsed, match="past the end"):
        read_header(str(cut))
    with pytest.raises(GGUFError, match="re-download"):
        GGUFFile(str(cut))
    short = tmp_path / "short.gguf"
    short.write_bytes(data[:-100])
    with pytest.raises(GGUFError, match="ends inside tensor q8: the file is truncated; re-download it"):
        GGUFFile(str(short)).read("q8")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match="re-download"):
        GGUFFile(str(tmp_path / "empty.gguf"))
