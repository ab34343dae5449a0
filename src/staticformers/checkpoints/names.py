"""A family's checkpoint-name adapter: the Hub's tensor names <-> the model's parameters.

Dense families store every parameter under its own name, so the adapter is the identity. Mixtures of
experts on the Hub store one tensor per expert and projection: Qwen3-MoE
`model.layers.3.mlp.experts.7.gate_proj.weight` (and `up_proj`, `down_proj`), Mixtral
`model.layers.3.block_sparse_moe.experts.7.w1.weight` (`w1` gate, `w3` up, `w2` down) with its router at
`block_sparse_moe.gate.weight`. The model holds each sparse layer's experts stacked, as transformers 5
holds them in memory: `mlp.experts.gate_up_proj` `[E, 2I, H]` (each expert's gate rows, then its up rows)
and `mlp.experts.down_proj` `[E, H, I]`, so one batched matmul reads them at once (`models/moe.py`);
quantized, their scales `gate_up_proj_scale` / `down_proj_scale` `[E, rows, 1]` map to each expert's
`weight_scale`.

A `Piece` says where one Hub tensor lives: parameter `target`, expert `expert` (None: the whole
parameter), rows `rows` of that expert's matrix. Loading fills each stacked parameter piece by piece
(`loading.load_weights`; the distributed reader turns the pieces into chunks of one tensor that
`torch.distributed.checkpoint` plans, so each rank reads only its experts' rows); saving splits the
stacked tensors back into the Hub's names (`to_hub`), which transformers loads. A parameter a file holds
whole under the model's own name (the stacked layout) is read whole: both layouts load.

Some dense families store projections of one input fused (`FusedNames`): Phi-3's
`self_attn.qkv_proj.weight` `[q + 2 kv, H]` (q's rows, then k's, then v's) and `mlp.gate_up_proj.weight`
`[2I, H]` (gate's rows, then up's), GLM-4's `mlp.gate_up_proj.weight`. The model holds them split, as
every other family does (`q_proj`, `k_proj`, `v_proj`, `gate_proj`, `up_proj`), so tensor parallel shards
each part by its own heads or columns and every backend's formulation applies unchanged. A split piece
names the rows of the file's tensor it takes (`source_rows`); the layout then has one entry per piece,
under the part's own name, each pointing at the same file tensor (`by_file` groups them back); saving
concatenates the parts into the fused tensor again (`to_hub`).

Qwen3.5's and Qwen3-Next's Gated DeltaNet layers are held the same way (`QWEN3_5_FUSED`, `QWEN3_NEXT_FUSED`):
transformers' `in_proj_qkv` (Qwen3.5) and depthwise `conv1d` (both), rows `[queries | keys | values]`, are the
model's `in_proj_qkv.q` / `.k` / `.v` and `conv1d.q` / `.k` / `.v`, so that tensor parallel splits each by its heads
(`models/linear_attention.py`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class ExpertNames:
    """How a MoE family's Hub checkpoints name a sparse layer's tensors.

    `stacked_transposed` (gpt-oss): the Hub stores the experts stacked under the model's names, each matrix
    transposed (`gate_up_proj` `[E, H, 2I]`, `down_proj` `[E, I, H]`), and the router as `mlp.router`."""

    block: str  # the sparse MLP's module name: "mlp" (Qwen3-MoE), "block_sparse_moe" (Mixtral)
    gate: str  # an expert's gate projection: "gate_proj" / "w1"
    up: str  # its up projection: "up_proj" / "w3"
    down: str  # its down projection: "down_proj" / "w2"
    router: str = "gate"  # the router's module name in the block
    stacked_transposed: bool = False


QWEN_MOE_NAMES = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")
MIXTRAL_NAMES = ExpertNames("block_sparse_moe", "w1", "w3", "w2")
GPT_OSS_NAMES = ExpertNames(
    "mlp", "gate_up_proj", "gate_up_proj", "down_proj", router="router", stacked_transposed=True
)


@dataclass(frozen=True)
class FusedNames:
    """Projections a family's checkpoints store fused: {fused module: its parts in row order}, module names
    relative to a decoder layer ("self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", ...))."""

    groups: tuple  # ((fused, (part, ...)), ...)

    def part_of(self, module: str) -> Optional[tuple[str, tuple]]:
        """(fused module, its parts) for a part's module name relative to its layer, else None."""
        for fused, parts in self.groups:
            if module in parts:
                return fused, parts
        return None


PHI3_FUSED = FusedNames(
    (
        ("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
    )
)
GLM4_FUSED = FusedNames((("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),))
# Gated DeltaNet (models/linear_attention.py): transformers' `in_proj_qkv` and `conv1d`, rows [queries | keys | values],
# held as their three parts; Qwen3-Next's projections are grouped per key head and stay whole, its conv1d is split
_CONV_PARTS = ("linear_attn.conv1d", ("linear_attn.conv1d.q", "linear_attn.conv1d.k", "linear_attn.conv1d.v"))
QWEN3_5_FUSED = FusedNames(
    (
        (
            "linear_attn.in_proj_qkv",
            ("linear_attn.in_proj_qkv.q", "linear_attn.in_proj_qkv.k", "linear_attn.in_proj_qkv.v"),
        ),
        _CONV_PARTS,
    )
)
QWEN3_NEXT_FUSED = FusedNames((_CONV_PARTS,))
_LAYER_PART = re.compile(r"^(?P<layer>(?:.*\.)?layers\.\d+)\.(?P<module>.+)\.(?P<leaf>weight|bias|weight_scale)$")

_STACKED = re.compile(
    r"^(?P<layer>(?:.*\.)?layers\.\d+)\.mlp\.experts\.(?P<kind>gate_up_proj|down_proj)(?P<scale>_scale)?$"
)
_ROUTER = re.compile(r"^(?P<layer>(?:.*\.)?layers\.\d+)\.mlp\.gate\.(?P<leaf>weight|bias)$")


@dataclass(frozen=True)
class Piece:
    """One Hub tensor (`hub`, of `shape`) and the part of model parameter `target` it fills."""

    hub: str
    target: str
    shape: tuple
    expert: Optional[int] = None  # index along the stacked experts; None: the whole parameter
    rows: Optional[tuple[int, int]] = None  # rows of that expert's matrix; None: all
    source_rows: Optional[tuple[int, int]] = None  # rows of the file's tensor it takes (a fused one); None: all
    source_shape: Optional[tuple] = None  # that fused tensor's shape (with source_rows)
    transposed: bool = False  # the Hub tensor is the whole parameter with its last two dims swapped

    @property
    def whole(self) -> bool:
        return self.expert is None and self.rows is None

    @property
    def file_shape(self) -> tuple:
        """The shape of the file's tensor this piece comes from."""
        return self.source_shape if self.source_rows is not None and self.source_shape is not None else self.shape

    def source(self, tensor: torch.Tensor) -> torch.Tensor:
        """This piece's part of the file's tensor `tensor`."""
        return tensor if self.source_rows is None else tensor[self.source_rows[0] : self.source_rows[1]]

    @property
    def target_shape(self) -> tuple:
        """The shape this piece has in the model (`shape` is the Hub tensor's)."""
        return (*self.shape[:-2], self.shape[-1], self.shape[-2]) if self.transposed else self.shape

    def to_model(self, tensor: torch.Tensor) -> torch.Tensor:
        """A whole piece's Hub tensor as the model holds it."""
        return tensor.transpose(-1, -2).contiguous() if self.transposed else tensor

    def to_hub(self, tensor: torch.Tensor) -> torch.Tensor:
        """The model's parameter (whole) as the Hub stores it."""
        return tensor.transpose(-1, -2).contiguous() if self.transposed else tensor

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """The part of `tensor` (the target parameter, whole) this piece is."""
        part = tensor if self.expert is None else tensor[self.expert]
        return part if self.rows is None else part[self.rows[0] : self.rows[1]]

    @property
    def offsets(self) -> tuple:
        """Where the piece starts in the target, per dimension (the target has one more dim when `expert` is set)."""
        if self.whole:
            return (0,) * len(self.shape)
        return (self.expert, self.rows[0] if self.rows else 0) + (0,) * (len(self.shape) - 1)


class CheckpointNames:
    """The adapter of one family (`names`: its `ExpertNames`, None for a dense family: the identity)."""

    def __init__(self, names: Optional[ExpertNames] = None, fused: Optional[FusedNames] = None):
        self.names = names
        self.fused = fused

    def _fused_piece(self, name: str, shape: tuple, expected: dict) -> Optional[Piece]:
        """The piece of a fused file tensor that parameter `name` is (its parts' shapes from `expected`)."""
        m = _LAYER_PART.match(name) if self.fused is not None else None
        if m is None or self.fused is None:
            return None
        found = self.fused.part_of(m["module"])
        if found is None:
            return None
        fused, parts = found
        names = [f"{m['layer']}.{p}.{m['leaf']}" for p in parts]
        if not all(n in expected for n in names):
            return None
        start, rows = 0, None
        for n in names:
            count = expected[n][0]
            if n == name:
                rows = (start, start + count)
            start += count
        source_shape = (start, *shape[1:])
        return Piece(f"{m['layer']}.{fused}.{m['leaf']}", name, shape, source_rows=rows, source_shape=source_shape)

    def pieces(self, name: str, shape: tuple, expected: Optional[dict] = None) -> list[Piece]:
        """The Hub tensors that make up parameter `name` of `shape` (`expected`: every parameter's shape,
        which a fused family's split pieces need)."""
        shape = tuple(shape)
        if self.fused is not None and expected is not None:
            piece = self._fused_piece(name, shape, expected)
            if piece is not None:
                return [piece]
        n = self.names
        if n is not None:
            m = _STACKED.match(name)
            if m and len(shape) == 3 and n.stacked_transposed:
                if m["scale"]:  # int8 scales `[E, rows, 1]` have no Hub layout of their own: stored as held
                    return [Piece(name, name, shape)]
                return [Piece(name, name, (shape[0], shape[2], shape[1]), transposed=True)]
            if m and len(shape) == 3:
                prefix = f"{m['layer']}.{n.block}.experts"
                leaf = "weight_scale" if m["scale"] else "weight"  # a quantized stack's scales `[E, rows, 1]`
                experts, rows, cols = shape
                if m["kind"] == "gate_up_proj":
                    half = rows // 2
                    return [
                        Piece(f"{prefix}.{e}.{proj}.{leaf}", name, (half, cols), e, (start, start + half))
                        for e in range(experts)
                        for proj, start in ((n.gate, 0), (n.up, half))
                    ]
                return [Piece(f"{prefix}.{e}.{n.down}.{leaf}", name, (rows, cols), e) for e in range(experts)]
            m = _ROUTER.match(name)
            if m:
                return [Piece(f"{m['layer']}.{n.block}.{n.router}.{m['leaf']}", name, shape)]
        return [Piece(name, name, shape)]

    def layout(self, expected: dict[str, tuple], present=()) -> dict[str, Piece]:
        """Hub name -> Piece for every expected parameter (name -> shape); a parameter stored whole under
        its own name (one of `present`, the files' names) is read whole. A split piece of a fused tensor is
        keyed by its parameter's name (`piece.hub` is the file's name; `by_file` groups them)."""
        present = set(present)
        expected = {k: tuple(v) for k, v in expected.items()}
        out: dict[str, Piece] = {}
        for name, shape in expected.items():
            pieces = self.pieces(name, shape, expected)
            if name in present and not any(p.hub == name and p.source_rows is None for p in pieces):
                pieces = [Piece(name, name, shape)]  # stored whole under its own name
            for piece in pieces:
                out[piece.target if piece.source_rows is not None else piece.hub] = piece
        return out

    def to_hub(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The state dict under the Hub's names: stacked experts split into one tensor per expert and
        projection, split projections concatenated into their fused tensor (copies: safetensors refuses
        tensors that share memory)."""
        out: dict[str, torch.Tensor] = {}
        shapes = {name: tuple(t.shape) for name, t in tensors.items()}
        fused: dict[str, list] = {}
        for name, tensor in tensors.items():
            for piece in self.pieces(name, tuple(tensor.shape), shapes):
                if piece.source_rows is not None:
                    fused.setdefault(piece.hub, []).append((piece.source_rows[0], tensor))
                else:
                    out[piece.hub] = piece.to_hub(tensor) if piece.whole else piece.view(tensor).clone()
        for hub, parts in fused.items():
            out[hub] = torch.cat([t for _, t in sorted(parts, key=lambda p: p[0])])
        return out

    def assemble(self, layout: dict[str, Piece], read: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The parameters, from the Hub tensors `read` (hub name -> tensor, every piece of `layout`)."""
        out: dict[str, torch.Tensor] = {}
        shapes = target_shapes(layout)
        for piece in layout.values():
            tensor = piece.source(read[piece.hub])
            if piece.whole:
                out[piece.target] = piece.to_model(tensor)
                continue
            if piece.target not in out:
                out[piece.target] = tensor.new_empty(shapes[piece.target])
            piece.view(out[piece.target]).copy_(tensor)
        return out


def target_shapes(layout: dict[str, Piece]) -> dict[str, tuple]:
    """Each parameter's full shape, from its pieces (a stacked parameter: experts x the pieces' rows)."""
    shapes: dict[str, list] = {}
    for piece in layout.values():
        if piece.whole:
            shapes[piece.target] = list(piece.target_shape)
            continue
        assert piece.expert is not None  # a piece that is not whole is one expert's (its rows, or all of it)
        end = [piece.expert + 1, (piece.rows[1] if piece.rows else piece.shape[0]), *piece.shape[1:]]
        old = shapes.get(piece.target)
        shapes[piece.target] = end if old is None else [max(a, b) for a, b in zip(old, end)]
    return {k: tuple(v) for k, v in shapes.items()}


def by_file(layout: dict[str, Piece]) -> dict[str, list[Piece]]:
    """The layout grouped by the files' tensor names: each name's pieces (several for a fused tensor)."""
    out: dict[str, list[Piece]] = {}
    for piece in layout.values():
        out.setdefault(piece.hub, []).append(piece)
    return out


def file_shapes(layout: dict[str, Piece]) -> dict[str, tuple]:
    """The shape each of the files' tensors must have."""
    return {piece.hub: piece.file_shape for piece in layout.values()}


def names_for(config) -> CheckpointNames:
    """The adapter of a model config's family (the identity for a dense family or an unknown config)."""
    family = getattr(config, "family", None)
    return CheckpointNames(getattr(family, "expert_names", None), getattr(family, "fused_names", None))


__all__ = [
    "ExpertNames",
    "QWEN_MOE_NAMES",
    "MIXTRAL_NAMES",
    "GPT_OSS_NAMES",
    "FusedNames",
    "PHI3_FUSED",
    "GLM4_FUSED",
    "QWEN3_5_FUSED",
    "QWEN3_NEXT_FUSED",
    "Piece",
    "CheckpointNames",
    "target_shapes",
    "by_file",
    "file_shapes",
    "names_for",
]
