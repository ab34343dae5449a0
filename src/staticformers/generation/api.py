"""`model.generate(...)` and `model.compile_stats()`: transformers' argument names over the engine.

This module turns a call into validated settings (generation options, compile settings, the plan),
splits the batch into plan-sized sub-batches, runs the host loop around the engine's compiled
prefill and decode, and assembles the output `[batch, prompt + new]` (pad after EOS) on the inputs'
device. Everything that can be refused is refused before any device work, so a bad call leaves the
engine (its caches, graphs and plan) exactly as it was.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..seeds import check_seed

from .config import CompileConfig, GenerationConfig
from .engine import CompileSettings, Engine
from .plan import ShapePlan
from .sampling import Sampler, check_options

logger = logging.getLogger("staticformers")

# keyword arguments transformers' generate() accepts that mean nothing here but are harmless
_IGNORED = {"use_cache", "token_type_ids", "return_dict_in_generate", "output_scores", "output_logits"}
_DEFAULT_MAX_NEW_TOKENS = 20
_ENGINE_ATTR = "_staticformers_engine"


def engine_for(model, plan: Optional[ShapePlan] = None) -> Engine:
    """The model's engine (created on first use); `plan` replaces its plan when given."""
    engine = model.__dict__.get(_ENGINE_ATTR)
    if engine is None:
        engine = Engine(model, plan)
        model.__dict__[_ENGINE_ATTR] = engine
    elif plan is not None:
        engine.plan = plan.bind(model.config.max_position_embeddings)
    return engine


def set_shape_plan(model, plan: ShapePlan) -> ShapePlan:
    """Give the model's engine a new plan (graphs already compiled for shapes still in it are kept)."""
    return engine_for(model, plan).plan


def compile_stats(model) -> list[dict]:
    """Each graph the engine built: kind, shape, backend, graphs compiled, seconds, calls."""
    engine = model.__dict__.get(_ENGINE_ATTR)
    return engine.stats() if engine is not None else []


# ---------------------------------------------------------------------------------------------
# settings
# ---------------------------------------------------------------------------------------------
# Inductor options for the engine's graphs (options given in CompileConfig win):
# - no size/stride/alignment asserts on every call: the engine checks its inputs' shapes itself (token
#   ids, positions, masks), owns the cache buffers and fingerprints the weights before each call, and
#   Dynamo's guards check the same when they run (~0.05-0.1 ms a decode step on this CPU, A/B);
# - realize a pointwise result read by two or more consumers (default: more than four): otherwise
#   the RMSNorm before q/k/v and before gate/up is recomputed inside each weight-streaming reduction,
#   for every weight row (in bf16 two more loads and conversions per weight element); batch-1 bf16
#   decode 4.04 -> 3.76 ms a token, A/B in one process, other cases unchanged (BENCHMARKS.md).
INDUCTOR_DEFAULTS = {"size_asserts": False, "alignment_asserts": False, "realize_reads_threshold": 2}


def _compile_settings(model, config: GenerationConfig, compile_config: Optional[CompileConfig]) -> CompileSettings:
    from ..compile import default_backend

    cc = compile_config if compile_config is not None else CompileConfig()
    if not isinstance(cc, CompileConfig):
        raise TypeError(f"compile_config must be a staticformers.CompileConfig, got {type(cc).__name__}.")
    backend = cc.backend or default_backend(model.device)
    options = {**(INDUCTOR_DEFAULTS if backend == "inductor" else {}), **(cc.options or {})}
    return CompileSettings(
        enabled=not config.disable_compile,
        backend=backend,
        mode=cc.mode,
        options=tuple(sorted(options.items())),
        fullgraph=cc.fullgraph,
        dynamic=cc.dynamic,
        fast_decode=bool(getattr(cc, "fast_decode", True)),
        regional=bool(cc.regional) if cc.regional is not None else model.device.type == "cpu",
    )


def _as_list(x) -> list[int]:
    if x is None:
        return []
    if isinstance(x, torch.Tensor):
        return [int(v) for v in x.flatten().tolist()]
    if isinstance(x, int):
        return [int(x)]
    return [int(v) for v in x]


def _merged_config(model, generation_config: Optional[GenerationConfig], kwargs: dict) -> GenerationConfig:
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise TypeError(f"generation_config must be a staticformers.GenerationConfig, got {type(generation_config).__name__}.")
    base = generation_config or model.generation_config or GenerationConfig()
    config = base.copy()
    rest = config.update(**kwargs)
    rest = {k: v for k, v in rest.items() if k not in _IGNORED}
    if rest:
        raise TypeError(f"generate() got argument(s) it does not know: {', '.join(sorted(rest))}.")
    return config


@dataclass
class Request:
    """A validated call: host ids and mask, limits, stop ids, the sampler and compile settings."""

    ids: torch.Tensor  # [batch, seq] int64 on the CPU
    mask: torch.Tensor  # [batch, seq] bool on the CPU
    out_device: torch.device
    max_new_tokens: int
    eos: list
    pad: int
    sampler_args: dict
    settings: CompileSettings
    plan: ShapePlan
    generator: Optional[torch.Generator]


def _prepare(model, engine: Engine, input_ids, attention_mask, config: GenerationConfig,
             compile_config, shape_plan, generator, seed, no_eos: bool = False) -> Request:
    if input_ids is None:
        raise ValueError("generate() needs input_ids (token ids of the prompt, [batch, length]).")
    if not isinstance(input_ids, torch.Tensor):
        input_ids = torch.as_tensor(input_ids)
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    if input_ids.dim() != 2 or input_ids.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"input_ids must be integer token ids of shape [batch, length], got {tuple(input_ids.shape)} {input_ids.dtype}.")
    out_device = input_ids.device
    ids = input_ids.detach().to("cpu", torch.long)
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError("The prompt is empty: pass at least one token id per sequence.")
    vocab = model.config.vocab_size
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise ValueError(f"input_ids hold ids outside the vocabulary [0, {vocab}): "
                         f"found {int(ids.min())}..{int(ids.max())}.")
    if attention_mask is None:
        mask = torch.ones_like(ids, dtype=torch.bool)
    else:
        mask = torch.as_tensor(attention_mask).detach().to("cpu")
        if tuple(mask.shape) != tuple(ids.shape):
            raise ValueError(f"attention_mask has shape {tuple(mask.shape)} but input_ids has {tuple(ids.shape)}.")
        mask = mask.bool()
    empty = (~mask.any(-1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"The prompt is empty for sequence(s) {empty[:8]} (attention_mask is all zeros): "
                         f"pass at least one token per sequence.")

    if config.cache_implementation not in (None, "static"):
        raise ValueError(f"cache_implementation={config.cache_implementation!r} is not available: staticformers' "
                         f"cache is always static (pass None or \"static\").")
    if config.max_new_tokens is not None:
        max_new = config.max_new_tokens
    elif config.max_length is not None:
        max_new = config.max_length - ids.shape[1]
        if max_new < 1:
            raise ValueError(f"max_length={config.max_length} leaves no room after a prompt of {ids.shape[1]} tokens: "
                             f"pass max_new_tokens instead.")
    else:
        max_new = _DEFAULT_MAX_NEW_TOKENS
    if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 1:
        raise ValueError(f"max_new_tokens={max_new!r} must be a positive integer.")
    if config.min_new_tokens is not None and (not isinstance(config.min_new_tokens, int) or config.min_new_tokens < 0):
        raise ValueError(f"min_new_tokens={config.min_new_tokens!r} must be a non-negative integer.")
    check_options(config.do_sample, config.temperature, config.top_k, config.top_p, config.min_p,
                  config.repetition_penalty)

    plan = shape_plan.bind(model.config.max_position_embeddings) if shape_plan is not None else engine.plan
    # the longest sub-batch decides nothing: each sub-batch is checked, all before any work
    for sub_ids, sub_mask in _sub_batches(plan, ids, mask):
        plan.choose(sub_ids.shape[0], sub_ids.shape[1], max_new)

    eos = _as_list(config.eos_token_id)
    if not eos and not no_eos:  # eos_token_id=None passed explicitly means "never stop early", as in transformers
        eos = _as_list(getattr(model.generation_config, "eos_token_id", None) if model.generation_config else None) \
            or _as_list(model.config.eos_token_id)
    pad = config.pad_token_id
    if pad is None and model.generation_config is not None:
        pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.config.pad_token_id
    if isinstance(pad, (list, tuple)):
        pad = pad[0] if pad else None
    if pad is None:
        pad = eos[0] if eos else 0

    if generator is not None and seed is not None:
        raise ValueError("Pass generator or seed, not both.")
    if seed is not None:
        generator = torch.Generator(device=model.device).manual_seed(check_seed(seed))
    settings = _compile_settings(model, config, compile_config)
    sampler_args = dict(do_sample=config.do_sample, temperature=config.temperature, top_k=config.top_k,
                        top_p=config.top_p, min_p=config.min_p, repetition_penalty=config.repetition_penalty,
                        min_new_tokens=config.min_new_tokens, eos_token_ids=eos)
    return Request(ids, mask, out_device, max_new, eos, int(pad), sampler_args, settings, plan, generator)


def _sub_batches(plan: ShapePlan, ids: torch.Tensor, mask: torch.Tensor):
    """Plan-sized chunks of the batch, each without the leading columns that are padding in every row."""
    start = 0
    for size in plan.split(ids.shape[0]):
        sub_ids, sub_mask = ids[start:start + size], mask[start:start + size]
        first = int(sub_mask.any(0).long().argmax())
        yield sub_ids[:, first:], sub_mask[:, first:]
        start += size


# ---------------------------------------------------------------------------------------------
# the host loop
# ---------------------------------------------------------------------------------------------
def _without_autocast(device: torch.device):
    """Generation computes in the model's dtype, as its static caches do: an enclosing autocast region
    is switched off for the steps (under it the cache writes would mix dtypes). Load the model in
    bfloat16 for bfloat16 generation."""
    try:
        if torch.is_autocast_enabled(device.type):
            return torch.autocast(device.type, enabled=False)
    except (RuntimeError, TypeError, ValueError):  # a device type autocast does not know
        pass
    return contextlib.nullcontext()


def _run(engine: Engine, req: Request, sub_ids: torch.Tensor, sub_mask: torch.Tensor, streamer) -> torch.Tensor:
    """Generate for one sub-batch; returns the new tokens `[b, steps]` on the CPU."""
    model = engine.model
    device = model.device
    b = sub_ids.shape[0]
    entry = req.plan.choose(b, sub_ids.shape[1], req.max_new_tokens)
    sampler = Sampler(generator=req.generator, **req.sampler_args)
    pad_rows = entry.batch - b  # the graphs' logits have the bucket's rows; filler rows see nothing
    sampler.start(torch.nn.functional.pad(sub_ids, (0, 0, 0, pad_rows)),
                  torch.nn.functional.pad(sub_mask, (0, 0, 0, pad_rows)), model.config.vocab_size, device)
    eos = set(req.eos)
    with torch.no_grad(), _without_autocast(device):
        argmax, logits, fill_cache, full_mask, next_pos = engine.prefill(entry, sub_ids, sub_mask, req.settings)
        mask_dev = None  # the cache is filled and the mask sent after the first token is out
        B = entry.batch
        positions = next_pos.view(B, 1)
        finished = [False] * b
        steps: list[list[int]] = []
        for step in range(req.max_new_tokens):
            chosen = sampler(logits, step) if sampler.needs_logits else argmax
            sampler.observe(chosen)
            row = chosen.tolist()[:b]
            for i in range(b):
                if finished[i]:
                    row[i] = req.pad
                elif row[i] in eos:
                    finished[i] = True
            steps.append(row)
            if streamer is not None:
                streamer.put(torch.tensor(row, dtype=torch.long))
            if all(finished) or step == req.max_new_tokens - 1:
                break
            if mask_dev is None:
                fill_cache()
                mask_dev = full_mask.to(device)
            tokens = torch.tensor(row + [req.pad] * (B - b), dtype=torch.long).view(B, 1)
            slot = torch.tensor([entry.prompt + step], dtype=torch.long)
            argmax, logits = engine.decode(entry, tokens.to(device), (positions + step).to(device), mask_dev,
                                           slot.to(device), req.settings)
    return torch.tensor(steps, dtype=torch.long).T.reshape(b, len(steps))


def generate(
    model,
    inputs: Optional[torch.Tensor] = None,
    generation_config: Optional[GenerationConfig] = None,
    *,
    input_ids: Optional[torch.Tensor] = None,
    attention_mask: Optional[torch.Tensor] = None,
    streamer=None,
    compile_config: Optional[CompileConfig] = None,
    shape_plan: Optional[ShapePlan] = None,
    generator: Optional[torch.Generator] = None,
    seed: Optional[int] = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Generate continuations: returns `[batch, prompt + new]` token ids on the inputs' device.

    Options use transformers' names (`max_new_tokens`, `min_new_tokens`, `do_sample`, `temperature`,
    `top_k`, `top_p`, `min_p`, `repetition_penalty`, `eos_token_id`, `pad_token_id`,
    `cache_implementation`, `disable_compile`, ...) and default to the checkpoint's
    generation_config.json. `compile_config` chooses the backend (default: the device's);
    `shape_plan` replaces the plan for this call; `seed` or `generator` makes sampling reproducible.
    """
    if inputs is not None and input_ids is not None:
        raise ValueError("Pass the prompt once: inputs or input_ids, not both.")
    input_ids = inputs if input_ids is None else input_ids
    no_eos = "eos_token_id" in kwargs and kwargs["eos_token_id"] is None
    config = _merged_config(model, generation_config, kwargs)
    engine = engine_for(model)
    req = _prepare(model, engine, input_ids, attention_mask, config, compile_config, shape_plan, generator, seed,
                   no_eos)
    engine.check_weights()
    if streamer is not None:
        if req.ids.shape[0] != 1:
            raise ValueError(f"A streamer follows one sequence; this batch has {req.ids.shape[0]}: stream batch 1.")
        streamer.put(req.ids.clone())
    try:
        news = [_run(engine, req, si, sm, streamer) for si, sm in _sub_batches(req.plan, req.ids, req.mask)]
    finally:
        if streamer is not None:
            streamer.end()
    longest = max(n.shape[1] for n in news)
    new = torch.cat([torch.nn.functional.pad(n, (0, longest - n.shape[1]), value=req.pad) for n in news])
    return torch.cat([req.ids, new], dim=1).to(req.out_device)

