"""A family's checkpoint-name adapter: the Hub's tensor names <-> the model's parameters.

Dense families store every parameter under its own name, so the adapter is the identity. Mixtures of
experts on the Hub store one tensor per expert and projection: Qwen3-MoE
`model.layers.3.mlp.experts.7.gate_proj.weight` (and `up_proj`, `down_proj`), Mixtral
`model.layers.3.block_sparse_moe.experts.7.w1.weight` (`w1` gate, `w3` up, `w2` down) with its router at
`block_sparse_moe.gate.weight`. The model holds each sparse layer's experts stacked, as transformers 5
holds them in memory: `mlp.experts.gate_up_proj` `[E, 2I, H]` (each expert's gate rows, then its up rows)
and `mlp.experts.down_proj` `[E, H, I]`, so one batched matmul reads them at once (`moe.py`); quantized, their
scales `gate_up_proj_scale` / `down_proj_scale` `[E, rows, 1]` map to each expert's `weight_scale`.

A `Piece` says where one Hub tensor lives: parameter `target`, expert `expert` (None: the whole
parameter), rows `rows` of that expert's matrix. Loading fills each stacked parameter piece by piece
(`loading.load_weights`; the distributed reader turns the pieces into chunks of one tensor that
`torch.distributed.checkpoint` plans, so each rank reads only its experts' rows); saving splits the
stacked tensors back into the Hub's names (`to_hub`), which transformers loads. A parameter a file holds
whole under the model's own name (the stacked layout) is read whole: both layouts load.
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
GPT_OSS_NAMES = ExpertNames("mlp", "gate_up_proj", "gate_up_proj", "down_proj", router="router", stacked_transposed=True)

_STACKED = re.compile(r"^(?P<layer>(?:.*\.)?layers\.\d+)\.mlp\.experts\.(?P<kind>gate_up_proj|down_proj)(?P<scale>_scale)?$")
_ROUTER = re.compile(r"^(?P<layer>(?:.*\.)?layers\.\d+)\.mlp\.gate\.(?P<leaf>weight|bias)$")


@dataclass(frozen=True)
class Piece:
    """One Hub tensor (`hub`, of `shape`) and the part of model parameter `target` it fills."""

    hub: str
    target: str
    shape: tuple
    expert: Optional[int] = None  # index along the stacked experts; None: the whole parameter
    rows: Optional[tuple[int, int]] = None  # rows of that expert's matrix; None: all
    transposed: bool = False  # the Hub tensor is the whole parameter with its last two dims swapped

    @property
    def whole(self) -> bool:
        return self.expert is None and self.rows is None

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
        return part if self.rows is None else part[self.rows[0]:self.rows[1]]

    @property
    def offsets(self) -> tuple:
        """Where the piece starts in the target, per dimension (the target has one more dim when `expert` is set)."""
        if self.whole:
            return (0,) * len(self.shape)
        return (self.expert, self.rows[0] if self.rows else 0) + (0,) * (len(self.shape) - 1)


class CheckpointNames:
    """The adapter of one family (`names`: its `ExpertNames`, None for a dense family: the identity)."""

    def __init__(self, names: Optional[ExpertNames] = None):
        self.names = names

    def pieces(self, name: str, shape: tuple) -> list[Piece]:
        """The Hub tensors that make up parameter `name` of `shape`."""
        shape = tuple(shape)
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
                    return [Piece(f"{prefix}.{e}.{proj}.{leaf}", name, (half, cols), e, (start, start + half))
                            for e in range(experts) for proj, start in ((n.gate, 0), (n.up, half))]
                return [Piece(f"{prefix}.{e}.{n.down}.{leaf}", name, (rows, cols), e) for e in range(experts)]
            m = _ROUTER.match(name)
            if m:
                return [Piece(f"{m['layer']}.{n.block}.{n.router}.{m['leaf']}", name, shape)]
        return [Piece(name, name, shape)]

    def layout(self, expected: dict[str, tuple], present=()) -> dict[str, Piece]:
        """Hub name -> Piece for every expected parameter (name -> shape); a parameter stored whole under
        its own name (one of `present`, the files' names) is read whole."""
        present = set(present)
        out: dict[str, Piece] = {}
        for name, shape in expected.items():
            pieces = self.pieces(name, shape)
            if name in present and not any(p.hub == name for p in pieces):
                pieces = [Piece(name, name, tuple(shape))]
            for piece in pieces:
                out[piece.hub] = piece
        return out

    def to_hub(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The state dict under the Hub's names: stacked experts split into one tensor per expert and
        projection (copies: safetensors refuses tensors that share memory)."""
        out: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            for piece in self.pieces(name, tuple(tensor.shape)):
                out[piece.hub] = piece.to_hub(tensor) if piece.whole else piece.view(tensor).clone()
        return out

    def assemble(self, layout: dict[str, Piece], read: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The parameters, from the Hub tensors `read` (hub name -> tensor, every piece of `layout`)."""
        out: dict[str, torch.Tensor] = {}
        shapes = target_shapes(layout)
        for hub, piece in layout.items():
            tensor = read[hub]
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
        end = [piece.expert + 1, (piece.rows[1] if piece.rows else piece.shape[0]), *piece.shape[1:]]
        old = shapes.get(piece.target)
        shapes[piece.target] = end if old is None else [max(a, b) for a, b in zip(old, end)]
    return {k: tuple(v) for k, v in shapes.items()}


def names_for(config) -> CheckpointNames:
    """The adapter of a model config's family (the identity for a dense family or an unknown config)."""
    family = getattr(config, "family", None)
    return CheckpointNames(getattr(family, "expert_names", None))


__all__ = ["ExpertNames", "QWEN_MOE_NAMES", "MIXTRAL_NAMES", "GPT_OSS_NAMES", "Piece", "CheckpointNames", "target_shapes", "names_for"]
