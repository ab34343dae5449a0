"""`DistributedConfig`: how the ranks of a torchrun job split one model, checked before anything runs.

The seed passes `DistributedConfig(tp_size=2, fsdp_size=2)` to `from_pretrained()` and launches with
`torchrun --nproc_per_node=4`. This module holds the layout and refuses, with one sentence each, every
layout that cannot work: sizes that do not multiply to `WORLD_SIZE`, more than one rank asked of a
process torchrun did not start, heads or KV heads (or a linear-attention layer's key heads) or the MLP width
not divisible by `tp_size`, an unknown `tp_plan` rule, an expert-parallel size that breaks transformers' rules. Field names are
transformers' (`tp_size`, `tp_plan`, `fsdp_size`, `dp_replicate_size`, `fsdp_cpu_offload`,
`fsdp_mixed_precision`, `ep_size`, `ep_plan`, `ep_implementation`).

The layout is a 3-D mesh `(dp_replicate, fsdp, tp)`: tensor parallel inside, FSDP2 sharding across
`fsdp`, replicas of that (HSDP) across `dp_replicate`. Ranks that differ only in `tp` see the same
data; `dp_replicate * fsdp` ranks see distinct batches. A mixture of experts may split its experts
over `ep_size` ranks (expert parallelism): the `fsdp * tp` ranks of a replica are laid out again as
`(efsdp, ep)`, `ep` innermost (so an EP group holds whole TP groups), each EP group holding every
expert once and each expert FSDP-sharded over the `efsdp = fsdp * tp / ep` groups that hold it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Union

import torch

# the values a tp_plan rule may take (see parallelize.py for what each does)
TP_STYLES = (
    "colwise",
    "rowwise",
    "vocab",
    "heads",
    "sinks",
    "latent",
    "value_heads",
    "channels",
    "gated_norm",
    "replicate",
)
# how tokens reach the experts of other ranks (distributed/expert_parallel.py)
EP_IMPLEMENTATIONS = ("auto", "all_reduce")
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class DistributedConfigError(ValueError):
    """A layout that cannot run: the message says what to change."""


def world_size_from_env() -> int:
    """WORLD_SIZE as torchrun set it, else 1 (a plain `python` run)."""
    value = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(value)
    except ValueError:
        raise DistributedConfigError(f"WORLD_SIZE={value!r} is not a number: launch with torchrun.") from None


def started_by_torchrun() -> bool:
    """True when the torchrun (or any c10d env://) variables are all present."""
    return all(v in os.environ for v in _TORCHRUN_VARS)


def _positive(name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise DistributedConfigError(
            f"DistributedConfig({name}={value!r}) must be a whole number of ranks, at least 1."
        )


@dataclass
class DistributedConfig:
    """The layout of one model over the ranks of a torchrun job.

    tp_size: ranks that split each weight matrix (tensor parallel); heads, KV heads, a linear-attention
        layer's key heads and the MLP width must divide by it.
    fsdp_size: ranks that shard parameters, gradients and optimizer state (FSDP2); None = the rest of
        the world (`WORLD_SIZE // (tp_size * dp_replicate_size)`).
    dp_replicate_size: replicas of the FSDP group (HSDP, for instance one per node).
    tp_plan: "auto" (the family's plan) or a dict `{module pattern: style}` overriding rules; patterns
        use `*` for a layer index ("model.layers.*.mlp.down_proj"); styles are colwise, rowwise, vocab
        (embedding / head split over the vocabulary), heads (a per-head norm on local heads), the
        special rules sinks, latent, value_heads, channels and gated_norm (parallelize.py), and
        replicate (leave whole).
    fsdp_cpu_offload: keep sharded parameters and optimizer state in host memory (FSDP2 CPUOffloadPolicy).
    fsdp_mixed_precision: False, True (= bfloat16) or a dtype: FSDP2 gathers parameters in that dtype for
        compute and reduces gradients in float32, keeping float32 master weights.
    reshard_after_forward: FSDP2's flag (False trades memory for one all-gather less per step).
    ep_size: ranks over which a mixture of experts splits its experts (expert parallelism; 1: every rank
        holds every expert). As in transformers it must be a multiple of tp_size and divide
        fsdp_size * tp_size, and the expert count must divide by it; the experts are FSDP-sharded over
        `efsdp_size = fsdp_size * tp_size / ep_size`.
    ep_plan: None (the family's plan: every sparse layer's experts split over the EP group).
    ep_implementation: "auto" (fixed-size all-gather of the tokens, local experts, reduce-scatter of the
        outputs: no shape depends on the routing) or "all_reduce" (ep_size == tp_size: every rank of the
        group holds the same tokens, runs its experts on all of them, and the outputs are summed).
        transformers' "all_to_all" exchanges routing-dependent counts, which is refused.
    """

    tp_size: int = 1
    fsdp_size: Optional[int] = None
    dp_replicate_size: int = 1
    tp_plan: Union[str, dict, None] = "auto"
    fsdp_cpu_offload: bool = False
    fsdp_mixed_precision: Union[bool, str, torch.dtype] = False
    reshard_after_forward: bool = True
    ep_size: int = 1
    ep_plan: Optional[dict] = None
    ep_implementation: str = "auto"

    def __post_init__(self):
        _positive("tp_size", self.tp_size)
        _positive("fsdp_size", self.fsdp_size)
        _positive("dp_replicate_size", self.dp_replicate_size)
        if self.tp_plan is None:
            self.tp_plan = "auto"
        if not (self.tp_plan == "auto" or isinstance(self.tp_plan, dict)):
            raise DistributedConfigError(
                f'tp_plan={self.tp_plan!r} is neither "auto" nor a dict of {{module pattern: style}}: '
                f'pass "auto" for the family\'s plan.'
            )
        if isinstance(self.tp_plan, dict):
            for pattern, style in self.tp_plan.items():
                if style not in TP_STYLES:
                    raise DistributedConfigError(
                        f"tp_plan rule {pattern!r}: {style!r} is not a style: use one of {', '.join(TP_STYLES)}."
                    )
        _ = self.param_dtype  # validates fsdp_mixed_precision
        if self.ep_size is None:
            self.ep_size = 1
        _positive("ep_size", self.ep_size)
        if self.ep_plan is not None:
            raise DistributedConfigError(
                f"ep_plan={self.ep_plan!r}: staticformers splits every sparse layer's experts by the family's plan; "
                f"leave ep_plan=None."
            )
        if self.ep_implementation == "all_to_all":
            raise DistributedConfigError(
                'ep_implementation="all_to_all" exchanges token counts that depend on the routing (a new shape '
                'every step, which a compile-per-shape device cannot afford): use "auto", which exchanges '
                "fixed-size buffers."
            )
        if self.ep_implementation not in EP_IMPLEMENTATIONS:
            raise DistributedConfigError(
                f"ep_implementation={self.ep_implementation!r} is not one of {', '.join(map(repr, EP_IMPLEMENTATIONS))}."
            )
        if self.ep_size > 1:
            if self.ep_size % self.tp_size:
                raise DistributedConfigError(
                    f"ep_size={self.ep_size} is not a multiple of tp_size={self.tp_size}: an expert group holds whole "
                    f"tensor-parallel groups (transformers' rule)."
                )
            if self.fsdp_size is not None and (self.fsdp_size * self.tp_size) % self.ep_size:
                raise DistributedConfigError(
                    f"ep_size={self.ep_size} does not divide fsdp_size * tp_size = {self.fsdp_size * self.tp_size}: "
                    f"the experts are split over ranks of one replica (transformers' rule)."
                )
        if self.ep_implementation == "all_reduce" and self.ep_size != self.tp_size:
            raise DistributedConfigError(
                f'ep_implementation="all_reduce" needs ep_size == tp_size (the ranks of a tensor-parallel group '
                f'share their tokens), not ep_size={self.ep_size} with tp_size={self.tp_size}: use "auto".'
            )

    # ---- derived --------------------------------------------------------------------------------
    @property
    def param_dtype(self) -> Optional[torch.dtype]:
        """The compute dtype FSDP2 gathers parameters in, or None for no mixed precision."""
        mp = self.fsdp_mixed_precision
        if mp is False or mp is None:
            return None
        if mp is True:
            return torch.bfloat16
        from ..models.model_config import ConfigError, parse_dtype

        try:
            return parse_dtype(mp, what="fsdp_mixed_precision")
        except ConfigError as err:
            raise DistributedConfigError(str(err)) from None

    def resolved(self, world_size: Optional[int] = None) -> "DistributedConfig":
        """A copy with fsdp_size filled in, checked against the job's world size and launcher."""
        world = world_size_from_env() if world_size is None else world_size
        ranks_asked = self.tp_size * (self.fsdp_size or 1) * self.dp_replicate_size
        if world == 1 and ranks_asked > 1:
            how = "torchrun" if not started_by_torchrun() else "torchrun with more processes"
            raise DistributedConfigError(
                f"{self._describe()} asks for {ranks_asked} processes, but this one runs alone (WORLD_SIZE=1, "
                f"not started by {how}): launch your script with `torchrun --nproc_per_node={ranks_asked}`."
            )
        if world > 1 and not started_by_torchrun():
            missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
            raise DistributedConfigError(
                f"WORLD_SIZE={world} is set but {', '.join(missing)} is not: launch with torchrun, which sets them all."
            )
        fsdp = self.fsdp_size
        if fsdp is None:
            rest = self.tp_size * self.dp_replicate_size
            if world % rest:
                raise DistributedConfigError(
                    f"WORLD_SIZE={world} is not divisible by tp_size * dp_replicate_size = {rest}: "
                    f"launch a multiple of {rest} processes or change the sizes."
                )
            fsdp = world // rest
        product = self.tp_size * fsdp * self.dp_replicate_size
        if product != world:
            raise DistributedConfigError(
                f"dp_replicate_size * fsdp_size * tp_size = {self.dp_replicate_size} * {fsdp} * {self.tp_size} = "
                f"{product} ranks, but torchrun started WORLD_SIZE={world}: make the product equal the number of processes."
            )
        return DistributedConfig(
            self.tp_size,
            fsdp,
            self.dp_replicate_size,
            self.tp_plan,
            self.fsdp_cpu_offload,
            self.fsdp_mixed_precision,
            self.reshard_after_forward,
            self.ep_size,
            self.ep_plan,
            self.ep_implementation,
        )

    @property
    def dp_size(self) -> int:
        """Ranks that see distinct batches (after `resolved()`)."""
        return self.dp_replicate_size * (self.fsdp_size or 1)

    @property
    def efsdp_size(self) -> int:
        """Ranks that hold the same experts and FSDP-shard them: fsdp * tp / ep (after `resolved()`)."""
        return (self.fsdp_size or 1) * self.tp_size // self.ep_size

    def check_model(self, config) -> None:
        """Refuse a tensor- or expert-parallel size the model's shapes cannot split (one sentence per mismatch)."""
        if self.ep_size > 1:
            if not getattr(config, "is_moe", False):
                raise DistributedConfigError(
                    f"ep_size={self.ep_size} splits experts, but {config.architecture} has none: drop ep_size."
                )
            if config.num_experts % self.ep_size:
                raise DistributedConfigError(
                    f"{config.architecture} has {config.num_experts} experts per sparse layer, which ep_size="
                    f"{self.ep_size} does not divide: choose an ep_size that divides {config.num_experts}."
                )
        tp = self.tp_size
        if tp == 1:
            return
        family = getattr(config, "family", None)
        if getattr(family, "qk_norm_over", "head") == "projection":
            raise DistributedConfigError(
                f"{config.architecture} normalises q and k over the whole projection, which tp_size={tp} would "
                f"split across ranks (each rank's norm would see only its heads): use tp_size=1 with fsdp_size."
            )
        problems = []
        widths = (
            ("intermediate_size",)
            if any(not config.layer_is_sparse(i) for i in range(config.num_hidden_layers))
            else ()
        )
        # a Gated DeltaNet layer splits over its key heads, each with the value heads it serves (parallelize.py)
        linear = ("linear_num_key_heads",) if getattr(config, "has_linear_attention", False) else ()
        for name in ("num_attention_heads", "num_key_value_heads", *linear, *widths):
            value = getattr(config, name)
            if value % tp:
                problems.append(f"{name}={value} is not divisible by tp_size={tp}")
        if problems:
            raise DistributedConfigError(
                f"{config.architecture} cannot be split {tp} ways: "
                + "; ".join(problems)
                + "; choose a tp_size that divides them (and use fsdp_size for the remaining ranks)."
            )
        if isinstance(self.tp_plan, dict) and config.vocab_size % tp:
            for pattern, style in self.tp_plan.items():
                if style == "vocab":
                    raise DistributedConfigError(
                        f"tp_plan rule {pattern!r} splits the vocabulary, but vocab_size={config.vocab_size} is not "
                        f'divisible by tp_size={tp}: make that rule "replicate" or pad the vocabulary.'
                    )

    def _describe(self) -> str:
        parts = [f"tp_size={self.tp_size}"]
        if self.fsdp_size is not None:
            parts.append(f"fsdp_size={self.fsdp_size}")
        if self.dp_replicate_size != 1:
            parts.append(f"dp_replicate_size={self.dp_replicate_size}")
        if self.ep_size != 1:
            parts.append(f"ep_size={self.ep_size}")
        return f"DistributedConfig({', '.join(parts)})"

    def to_dict(self) -> dict:
        mp = self.fsdp_mixed_precision
        return {
            "tp_size": self.tp_size,
            "fsdp_size": self.fsdp_size,
            "dp_replicate_size": self.dp_replicate_size,
            "tp_plan": self.tp_plan,
            "fsdp_cpu_offload": self.fsdp_cpu_offload,
            "fsdp_mixed_precision": str(mp).removeprefix("torch.") if isinstance(mp, torch.dtype) else mp,
            "reshard_after_forward": self.reshard_after_forward,
            "ep_size": self.ep_size,
            "ep_plan": self.ep_plan,
            "ep_implementation": self.ep_implementation,
        }


__all__ = [
    "DistributedConfig",
    "DistributedConfigError",
    "TP_STYLES",
    "EP_IMPLEMENTATIONS",
    "world_size_from_env",
    "started_by_torchrun",
]
