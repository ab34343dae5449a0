"""from_pretrained / save_pretrained: Hugging Face checkpoints in and out.

Loading builds the model on the meta device (no memory, no random init), then materialises each
tensor once, read from the file (plain reads, no memory map: see safetensors_io) straight into the
target dtype on the target device: peak host memory stays near the model's size, not twice it. Pickle checkpoints
are never unpickled; every file name an index gives must resolve inside the folder (`utils/contained_paths.py`).
Every refusal is one sentence naming the file or the weights.

Saving writes config.json in the transformers-5 spelling, safetensors shards with an index above
`max_shard_size`, and generation_config.json when known; transformers loads what we write.

Names go through the family's checkpoint-name adapter (`checkpoints/names.py`): a mixture of experts
stores one tensor per expert on the Hub and holds them stacked in memory, so loading fills each stacked
parameter from its pieces and saving splits it back (dense families: the identity). Tensors a family's files
hold for a part that transformers does not build either (`Family.ignored_weights`: Qwen3.5's and Qwen3-Next's
multi-token prediction head, `mtp.*`) are skipped.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import nn

from ..checkpoints.names import Piece, by_file, file_shapes, names_for, target_shapes
from .model_config import ModelConfig, dtype_name, parse_dtype
from ..utils.contained_paths import OutsideFolderError
from ..checkpoints.hub import CheckpointNotFoundError, is_local, resolve_file
from .decoder import CausalLM
from ..checkpoints.safetensors_io import SafetensorsFile, SafetensorsFormatError
from ..checkpoints.weights_writer import SAFE_INDEX, SAFE_WEIGHTS, write_weights
from ..checkpoints.compressed_tensors import pack_int8, scheme_of, unpack_int8
from ..checkpoints import mxfp4
from .quantization import FP8, QuantizationConfig, as_quantization_config, prepare_for_checkpoint, quantize_model

logger = logging.getLogger("staticformers")

PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")

# keys some checkpoints carry that hold nothing we load (old Llama exports saved RoPE buffers)
_IGNORED_KEYS = re.compile(r".*\.rotary_emb\.inv_freq$")


class CheckpointError(ValueError):
    """A checkpoint whose weights do not fit the model its config describes."""


def _hub_kwargs(revision, cache_dir, local_files_only, token) -> dict:
    return dict(revision=revision, cache_dir=cache_dir, local_files_only=local_files_only, token=token)


def weight_files(name_or_path: str, **hub) -> list[str]:
    """Local paths of the checkpoint's safetensors files (every shard, in index order)."""
    index = resolve_file(name_or_path, SAFE_INDEX, required=False, **hub)
    if index is not None:
        paths = []
        for shard in _index_shards(index):
            try:
                paths.append(resolve_file(name_or_path, shard, listed_in=f"{SAFE_INDEX} of {name_or_path}", **hub))
            except CheckpointNotFoundError:
                raise CheckpointNotFoundError(
                    f"Shard {shard} listed in {SAFE_INDEX} is missing from {name_or_path}: download the complete checkpoint."
                ) from None
            except OutsideFolderError as err:
                raise CheckpointError(str(err)) from None
        return paths
    single = resolve_file(name_or_path, SAFE_WEIGHTS, required=False, **hub)
    if single is not None:
        return [single]
    for pickle_name in PICKLE_WEIGHTS:
        if resolve_file(name_or_path, pickle_name, required=False, **hub) is not None:
            raise CheckpointError(
                f"{name_or_path} holds only a pickle checkpoint ({pickle_name}), which staticformers never unpickles: "
                f"convert it to safetensors first (for instance with transformers: load it and save_pretrained(dir, safe_serialization=True))."
            )
    raise CheckpointNotFoundError(
        f"{name_or_path} has no {SAFE_WEIGHTS} and no {SAFE_INDEX}: it holds no weights we can load."
    )


def open_weights(path: str) -> SafetensorsFile:
    """A safetensors file with its header checked; a bad one is a `CheckpointError` naming the file."""
    try:
        return SafetensorsFile(path)
    except SafetensorsFormatError as err:
        raise CheckpointError(str(err)) from None


def _index_shards(index: str) -> list[str]:
    """The shard file names of a safetensors index, in order, each once; a malformed index is refused."""
    from ..checkpoints.json_files import read_json_object

    data = read_json_object(index, "restore it from the checkpoint's source", CheckpointError)
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(
            f'{index} has no "weight_map" object naming each weight\'s shard: restore it from the source.'
        )
    bad = [k for k, v in weight_map.items() if not isinstance(v, str)]
    if bad:
        raise CheckpointError(
            f"{index} maps weight {bad[0]!r} to {weight_map[bad[0]]!r}, not to a shard file name: "
            f"restore it from the source."
        )
    return list(dict.fromkeys(weight_map.values()))


def _checkpoint_dtype(files: list[str]) -> Optional[torch.dtype]:
    """The dtype of the first floating tensor in the first shard (fp8 weights aside), read from its header alone."""
    with open_weights(files[0]) as f:
        for name in f.keys():
            if f.dtype(name).is_floating_point and f.dtype(name) != FP8:
                return f.dtype(name)
    return None


def resolve_dtype(dtype, config: ModelConfig, files: list[str]) -> torch.dtype:
    """None or "auto": the checkpoint's own dtype (config.json, else the weights' header)."""
    if dtype is None or dtype == "auto":
        return config.dtype or _checkpoint_dtype(files) or torch.float32
    return parse_dtype(dtype)


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    if leaf in module._buffers:  # a persistent buffer (DeepSeek's correction bias): its own dtype kept
        module._buffers[leaf] = value.to(module._buffers[leaf].dtype)
        return
    old = module._parameters.get(leaf)
    module._parameters[leaf] = nn.Parameter(value, requires_grad=old.requires_grad if old is not None else True)


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a checkpoint stores (`state_dict`'s, not the RoPE tables): DeepSeek's correction bias."""
    return {
        f"{prefix}.{name}" if prefix else name: b
        for prefix, module in model.named_modules()
        for name, b in module._buffers.items()
        if b is not None and name not in module._non_persistent_buffers_set
    }


def expected_weights(model: CausalLM) -> dict[str, tuple]:
    """Name -> shape of every weight the checkpoint must hold (a tied lm_head is not stored), the persistent
    buffers among them."""
    expected = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
    expected.update({name: tuple(b.shape) for name, b in persistent_buffers(model).items()})
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    return expected


def check_checkpoint(model: CausalLM, files: list[str]) -> dict[str, str]:
    """Check from the headers alone that the files hold every weight the model needs, with the right
    shapes, once each and nothing else; return which file holds each weight (by its name in the files).

    Run before any tensor is read, so a checkpoint that does not fit loses nothing and gets one sentence.
    """
    return checkpoint_layout(model, files)[1]


def quantized_targets(model: CausalLM) -> dict[str, torch.dtype]:
    """The parameters stored quantized (int8 or fp8 values), by name, with their dtype."""
    return {n: p.dtype for n, p in model.named_parameters() if p.dtype in (torch.int8, FP8)}


def _file_name(name: str, f: SafetensorsFile, scheme) -> Optional[str]:
    """The model's name for file tensor `name` under a compressed-tensors `scheme`: a `pack-quantized`
    `X.weight_packed` is `X.weight`; "" for what holds nothing to load (`weight_shape`, a zero point,
    which symmetric weights store as zeros); an MXFP4 stack's `X_blocks` is `X` and its `X_scales` ""
    (`checkpoints/mxfp4.py`); `name` itself otherwise."""
    packed = mxfp4.packed_part(name)
    if packed is not None:
        return packed[0] if packed[1] == "blocks" else ""
    if scheme is None:
        return name
    if name.endswith((".weight_shape", ".weight_zero_point")):
        return ""
    if scheme.format == "pack-quantized" and name.endswith(".weight_packed"):
        return name[: -len("_packed")]
    return name


def _stored_shape_fits(name: str, stored: tuple, want: tuple, packed: bool) -> bool:
    """Whether a stored quantized tensor of shape `stored` fills `want`: packed rows hold four values per
    int32; a per-tensor scale (`[]` or `[1]`) fills a per-row one."""
    if packed:
        return stored == (want[0], -(-want[1] // 4))
    if name.endswith("weight_scale") and stored in ((), (1,)):
        return True
    return stored == want


def checkpoint_layout(model: CausalLM, files: list[str]) -> tuple[dict[str, Piece], dict[str, str]]:
    """`check_checkpoint`'s checks, and (the file names' pieces of the model's parameters, which file holds
    each name): names as the files spell them, through the family's adapter (`checkpoints/names.py`); a
    quantized model's (`prepare_for_checkpoint`) values must be stored in its dtype, int8 or fp8."""
    scheme = scheme_of(model.config.extra)
    present = set()
    for path in files:
        with open_weights(path) as f:
            present.update(filter(None, (_file_name(n, f, scheme) for n in f.keys())))
    layout = names_for(model.config).layout(expected_weights(model), present)
    expected = file_shapes(layout)
    pieces = by_file(layout)
    quantized = quantized_targets(model)
    tied = model.config.tie_word_embeddings
    skipped = (
        model.config.family.ignored_weights
    )  # what transformers skips too (the `mtp.` head of Qwen3.5, Qwen3-Next)
    where: dict[str, str] = {}
    unexpected: list[str] = []
    for path in files:
        with open_weights(path) as f:
            for stored in f.keys():
                name = _file_name(stored, f, scheme)
                if not name:
                    continue
                if name not in expected:
                    if not (
                        _IGNORED_KEYS.match(name) or (tied and name == "lm_head.weight") or name.startswith(skipped)
                    ):
                        unexpected.append(name)
                    continue
                if name in where:
                    raise CheckpointError(f"Weight {name} appears in more than one shard ({path} is the second).")
                if mxfp4.packed_part(stored):
                    where[name] = path
                    where[name + "_scales"] = _check_mxfp4(f, stored, name, pieces[name][0], files, path)
                    continue
                want = quantized.get(pieces[name][0].target)
                packed = stored != name
                have = f.dtype(stored)
                if want is not None and have != (torch.int32 if packed else want):
                    raise CheckpointError(
                        f"Weight {stored} in {os.path.basename(path)} is stored as {dtype_name(have)}, but config.json's "
                        f"quantization_config says {dtype_name(want)}: the config and the weights come from different "
                        f"exports."
                    )
                if want is None and (not have.is_floating_point or have == FP8):
                    raise CheckpointError(
                        f"Weight {name} in {os.path.basename(path)} is stored as {dtype_name(have)}, but this "
                        f"model's weights are floating point: the file holds another kind of checkpoint (quantized?); "
                        f"export it in float32, bfloat16 or float16."
                    )
                if want is not None or name.endswith("weight_scale"):
                    if not _stored_shape_fits(name, f.shape(stored), expected[name], packed):
                        raise CheckpointError(
                            f"Weight {stored} in {os.path.basename(path)} has shape {list(f.shape(stored))}, which does "
                            f"not fit {list(expected[name])}: the config and the weights come from different models."
                        )
                    where[name] = path
                    continue
                if f.shape(name) != expected[name]:
                    raise CheckpointError(
                        f"Weight {name} in {os.path.basename(path)} has shape {list(f.shape(name))} but config.json "
                        f"implies {list(expected[name])}: the config and the weights come from different models."
                    )
                where[name] = path
    if unexpected:
        raise CheckpointError(
            f"The checkpoint has {len(unexpected)} weight(s) this {model.config.architecture} does not use: "
            f"{_names(unexpected)}: the config and the weights come from different models."
        )
    missing = sorted(set(expected) - set(where))
    if missing:
        raise CheckpointError(
            f"The checkpoint lacks {len(missing)} weight(s) that {model.config.architecture} needs: {_names(missing)}: "
            f"a shard may be missing or the config may not match the weights."
        )
    return layout, where


def _check_mxfp4(f: SafetensorsFile, stored: str, name: str, piece: Piece, files: list[str], path: str) -> str:
    """Check an MXFP4 stack's blocks (`stored`, in `f`) and scales against the parameter they fill
    (`piece`: the Hub's transposed layout); return the file that holds the scales."""
    scales_name, scales_path, shape, dtype = name + "_scales", None, None, None
    for other in files:
        with open_weights(other) as g:
            if scales_name in g.tensors:
                scales_path, shape, dtype = other, tuple(g.shape(scales_name)), g.dtype(scales_name)
                break
    hub = piece.shape  # the dequantised matrix, transposed as the Hub holds it
    try:
        mxfp4.check(
            name,
            tuple(f.shape(stored)),
            f.dtype(stored),
            shape,
            dtype,
            (*hub[:-2], hub[-1], hub[-2]),
            os.path.basename(path),
        )
    except mxfp4.Mxfp4FormatError as err:
        raise CheckpointError(str(err)) from None
    return scales_path


def untie_stored_head(config: ModelConfig, files: list[str]) -> None:
    """transformers' rule for a config that ties lm_head to embed_tokens while the checkpoint stores its
    own lm_head.weight with other values: keep the stored head (untie, in `config`) and warn."""
    if not config.tie_word_embeddings:
        return
    found = {}
    for path in files:
        with open_weights(path) as f:
            for name in ("lm_head.weight", "model.embed_tokens.weight"):
                if name in f.tensors:
                    found[name] = path
    if "lm_head.weight" not in found or "model.embed_tokens.weight" not in found:
        return
    with SafetensorsFile(found["lm_head.weight"]) as head, SafetensorsFile(found["model.embed_tokens.weight"]) as embed:
        if head.same_values("lm_head.weight", embed, "model.embed_tokens.weight"):
            return
    logger.warning(
        "config.json ties lm_head.weight to model.embed_tokens.weight, but the checkpoint stores both with "
        "different values, so they are NOT tied (as transformers does): set tie_word_embeddings=false in "
        "config.json to silence this warning."
    )
    config.tie_word_embeddings = False


def load_weights(model: CausalLM, files: list[str], device: torch.device, dtype: torch.dtype) -> None:
    """Fill a meta-device model from safetensors files, one tensor at a time, after checking them all; a
    stacked parameter (a mixture's experts) is allocated once and filled from its pieces."""
    layout, where = checkpoint_layout(model, files)
    shapes = target_shapes(layout)
    pieces = by_file(layout)
    scheme = scheme_of(model.config.extra)
    quantized = quantized_targets(model)
    stacked: dict[str, torch.Tensor] = {}
    for path in files:
        with SafetensorsFile(path) as f:
            for stored in f.keys():
                name = _file_name(stored, f, scheme)
                if not name or where.get(name) != path:
                    continue
                first = pieces[name][0]
                if mxfp4.packed_part(stored):  # blocks and scales -> the matrix, as the Hub holds it (transposed)
                    with SafetensorsFile(where[name + "_scales"]) as g:
                        scales = g.read(name + "_scales", device=device)
                    value = mxfp4.dequantize(f.read(stored, device=device), scales, dtype).transpose(-1, -2)
                elif first.target in quantized:  # int8 / fp8 values as stored (unpacked from int32 if packed)
                    value = f.read(stored, device=device)
                    if stored != name:
                        value = unpack_int8(value, first.file_shape)
                else:
                    value = f.read(
                        stored, dtype=dtype if f.dtype(stored).is_floating_point else None, device=device, finite=True
                    )
                    if tuple(value.shape) != first.file_shape:  # a per-tensor scale, one per row here
                        value = value.reshape(1, 1).expand(first.file_shape).contiguous()
                for piece in pieces[name]:  # several for a fused tensor (each part's rows)
                    part = piece.source(value)
                    if piece.whole:
                        part = piece.to_model(part)
                        _set_tensor(model, piece.target, part if piece.source_rows is None else part.clone())
                        continue
                    if piece.target not in stacked:
                        stacked[piece.target] = torch.empty(shapes[piece.target], dtype=value.dtype, device=device)
                    piece.view(stacked[piece.target]).copy_(part)
                del value
    for name, value in stacked.items():
        _set_tensor(model, name, value)
    model.tie_weights()
    model.model.reset_rope(device)


def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


_KNOWN_IGNORED_KWARGS = {"trust_remote_code", "attn_implementation", "low_cpu_mem_usage", "use_safetensors"}


@dataclass
class Resolved:
    """What `from_pretrained` found before building anything: the path, config, weight files and dtype."""

    path: str
    config: ModelConfig
    files: list
    dtype: torch.dtype
    hub: dict
    quantization: Optional[QuantizationConfig] = None  # asked for at load (`quantization_config=`)
    gguf: Optional[object] = None  # the opened GGUF file (`gguf_file=`): `checkpoints/gguf_file.GGUFFile`


def resolve(
    pretrained_model_name_or_path: Union[str, os.PathLike],
    *,
    dtype: Union[str, torch.dtype, None] = None,
    revision: Optional[str] = None,
    cache_dir: Optional[str] = None,
    local_files_only: bool = False,
    token: Optional[str] = None,
    config: Optional[ModelConfig] = None,
    torch_dtype: Union[str, torch.dtype, None] = None,
    quantization_config=None,
    gguf_file: Union[str, os.PathLike, None] = None,
    **kwargs,
) -> Resolved:
    """Check the arguments of `from_pretrained` and find the checkpoint's config, files and target dtype.

    `dtype`: None or "auto" keeps the checkpoint's dtype; "bfloat16", torch.float32, ... convert."""
    unknown = set(kwargs) - _KNOWN_IGNORED_KWARGS
    if unknown:
        raise TypeError(
            f"from_pretrained() got argument(s) it does not know: {', '.join(sorted(unknown))}; "
            f"see help(staticformers.AutoModelForCausalLM.from_pretrained)."
        )
    if torch_dtype is not None:
        if dtype is not None:
            raise ValueError("Pass dtype or its old name torch_dtype, not both.")
        dtype = torch_dtype
    path = os.fspath(pretrained_model_name_or_path)
    hub = _hub_kwargs(revision, cache_dir, local_files_only, token)
    quantization = as_quantization_config(quantization_config) if quantization_config is not None else None
    if gguf_file is not None:
        from .gguf_loading import gguf_dtype, open_model_file, read_config

        f = open_model_file(path, gguf_file, **hub)
        config = config if config is not None else read_config(f)
        return Resolved(path, config, [f.path], gguf_dtype(dtype, f), hub, quantization, gguf=f)
    if config is None:
        config = ModelConfig.from_pretrained(path, **hub)
    files = weight_files(path, **hub)
    if mxfp4.is_mxfp4_config(config.extra):  # MXFP4 experts load dequantised: the model holds no MXFP4
        config.extra.pop("quantization_config")
    untie_stored_head(config, files)
    return Resolved(path, config, files, resolve_dtype(dtype, config, files), hub, quantization)


def load_model(resolved: Resolved, device: torch.device, model_class: type = CausalLM) -> CausalLM:
    """A model of `model_class` built on the meta device and filled from the files, in one process; a
    compressed-tensors checkpoint (config.json's `quantization_config`) loads quantized, as stored; with
    `quantization_config` asked for, the loaded model is quantized (`models/quantization.py`); a GGUF file
    (`gguf_file=`) loads dequantised (`gguf_loading.py`)."""
    if resolved.gguf is not None:
        from .gguf_loading import load_gguf_model

        model = load_gguf_model(resolved.gguf, resolved.config, device, resolved.dtype, model_class)
        if resolved.quantization is not None:
            quantize_model(model, resolved.quantization)
        return model
    with torch.device("meta"):
        model = model_class(resolved.config)
    scheme = scheme_of(resolved.config.extra, os.path.join(resolved.path, "config.json"))
    if scheme is not None:
        if resolved.quantization is not None:
            raise ValueError(
                f"{resolved.path} is quantized already ({scheme.format}); load it without quantization_config."
            )
        with torch.device("meta"):
            prepare_for_checkpoint(model, scheme)
    load_weights(model, resolved.files, device, resolved.dtype)
    if resolved.quantization is not None:
        quantize_model(model, resolved.quantization)
    return model


def finish_loading(model: CausalLM, resolved: Resolved) -> CausalLM:
    """What every loaded model gets last: its dtype, name, eval mode (its generation config: `api/auto.py`)."""
    model.config.dtype = resolved.dtype
    model.name_or_path = resolved.path
    model.eval()
    return model


# ---------------------------------------------------------------------------------------------
# saving
# ---------------------------------------------------------------------------------------------
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*$", re.IGNORECASE)


def parse_size(size: Union[int, str]) -> int:
    """5GB -> 5 * 10**9 bytes, 2GiB -> 2 * 2**30, an int is bytes."""
    if isinstance(size, int):
        return size
    m = _SIZE.match(str(size))
    if not m:
        raise ValueError(
            f'max_shard_size={size!r} is not a size: use an int of bytes or a string like "5GB" or "500MB".'
        )
    number, unit = float(m.group(1)), (m.group(2) or "B").upper()
    scale = {
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }[unit]
    return int(number * scale)


def export_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """The weights as transformers names them (tied lm_head left out), contiguous, on the CPU."""
    out = {}
    for name, tensor in model.state_dict().items():
        if model.config.tie_word_embeddings and name == "lm_head.weight":
            continue
        if hasattr(tensor, "full_tensor"):  # a DTensor from tensor parallel / FSDP
            tensor = tensor.full_tensor()
        out[name] = tensor.detach().to("cpu").contiguous()
    return out


def _packed(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """compressed-tensors' `pack-quantized` names: each int8 `X.weight` as `X.weight_packed` (four values to an
    int32) and `X.weight_shape`."""
    out = {}
    for name, tensor in tensors.items():
        if tensor.dtype == torch.int8 and name.endswith(".weight") and tensor.dim() == 2:
            out[name + "_packed"] = pack_int8(tensor)
            out[name + "_shape"] = torch.tensor(tensor.shape, dtype=torch.int32)
        else:
            out[name] = tensor
    return out


def save_pretrained(
    model: CausalLM,
    save_directory: Union[str, os.PathLike],
    max_shard_size: Union[int, str] = "5GB",
    state_dict: Optional[dict] = None,
    safe_serialization: bool = True,
    **kwargs,
) -> None:
    """Write the safetensors weights (sharded above `max_shard_size`), config.json and generation_config.json.

    Into a folder that holds a model already, a kill at any moment leaves one that loads, the old model or
    the new one (`checkpoints/weights_writer.py`; config files are replaced in one rename each).
    """
    if not safe_serialization:
        raise ValueError("staticformers saves safetensors only: drop safe_serialization=False.")
    directory = os.fspath(save_directory)
    if os.path.isfile(directory):
        raise ValueError(f"{directory} is a file: save_pretrained needs a folder path.")
    os.makedirs(directory, exist_ok=True)
    tensors = state_dict if state_dict is not None else export_state_dict(model)
    tensors = names_for(model.config).to_hub(tensors)  # the Hub's names (a mixture: one tensor per expert)
    scheme = scheme_of(model.config.extra)
    if scheme is not None and scheme.format == "pack-quantized":
        tensors = _packed(tensors)
    limit = parse_size(max_shard_size)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    write_weights(directory, shards, metadata={"format": "pt"})  # the old weights stay until the new ones are in
    floats = [t.dtype for t in tensors.values() if t.is_floating_point() and t.dtype != FP8]
    model.config.dtype = floats[0] if floats else model.config.dtype
    model.config.save_pretrained(directory)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(directory)


__all__ = [
    "resolve",
    "load_model",
    "finish_loading",
    "save_pretrained",
    "load_weights",
    "check_checkpoint",
    "checkpoint_layout",
    "weight_files",
    "export_state_dict",
    "dtype_name",
    "is_local",
]
