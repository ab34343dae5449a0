"""`model.generate(...)`: transformers' argument names over the generation loop.

This module turns a call into validated settings (generation options, compile settings, the plan)
and one `GenerationRequest` per row, drives the loop (`generation/loop.py`) until every row has finished, and
assembles the output `[batch, prompt + new]` (pad after EOS) on the inputs' device. Each row's prompt
is the tokens its attention mask keeps, so left- and right-padded batches give the same continuations.
Everything that can be refused is refused before any device work, so a bad call leaves the engine
(its caches, graphs and plan) exactly as it was. Calls from several threads on one model run one
after the other (the engine's lock), each with its own rows.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from ..adapters.bank import bank_for_names
from ..backends import device_kind
from ..utils.seeds import check_seed
from ..generation.generation_config import CompileConfig, GenerationConfig
from ..generation.engines import compile_settings, engine_for
from ..generation.constraints import Grammar, StructuredOutputs, compiler_for
from ..generation.loop import GenerationLoop, GenerationRequest
from ..generation.plan import ShapePlan
from ..generation.sampling import SamplingParams
from .speculative import SPECULATIVE_ARGUMENTS, speculator_from_generate

logger = logging.getLogger("staticformers")

# keyword arguments transformers' generate() accepts that mean nothing here but are harmless
_IGNORED = {"use_cache", "token_type_ids"}
_DEFAULT_MAX_NEW_TOKENS = 20


@dataclass
class GenerateDecoderOnlyOutput:
    """What `generate(..., return_dict_in_generate=True)` returns (transformers' class of the same name, its
    fields that apply): `sequences` `[batch, prompt + new]`; `logits` (with `output_logits=True`): one
    `[batch, vocab]` tensor per generated position, the unprocessed logits each token was chosen from (a
    row that had already finished has NaN there). Readable as attributes or by key."""

    sequences: torch.Tensor
    logits: Optional[tuple] = None

    def __getitem__(self, key: str):
        return getattr(self, key)


def _as_list(x) -> list[int]:
    if x is None:
        return []
    if isinstance(x, torch.Tensor):
        return [int(v) for v in x.flatten().tolist()]
    if isinstance(x, int):
        return [int(x)]
    return [int(v) for v in x]


def merged_config(model, generation_config: Optional[GenerationConfig], kwargs: dict) -> GenerationConfig:
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise TypeError(
            f"generation_config must be a staticformers.GenerationConfig, got {type(generation_config).__name__}."
        )
    base = generation_config or model.generation_config or GenerationConfig()
    config = base.copy()
    rest = config.update(**kwargs)
    rest = {k: v for k, v in rest.items() if k not in _IGNORED}
    if rest:
        raise TypeError(f"generate() got argument(s) it does not know: {', '.join(sorted(rest))}.")
    return config


def _prompts(model, input_ids, attention_mask) -> tuple[torch.Tensor, list[list[int]], torch.device]:
    """The host ids as given, each row's prompt (the tokens its mask keeps) and the output device."""
    if input_ids is None:
        raise ValueError("generate() needs input_ids (token ids of the prompt, [batch, length]).")
    if not isinstance(input_ids, torch.Tensor):
        input_ids = torch.as_tensor(input_ids)
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    if input_ids.dim() != 2 or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise ValueError(
            f"input_ids must be integer token ids of shape [batch, length], got {tuple(input_ids.shape)} {input_ids.dtype}."
        )
    out_device = input_ids.device
    ids = input_ids.detach().to("cpu", torch.long)
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError("The prompt is empty: pass at least one token id per sequence.")
    if attention_mask is None:
        mask = torch.ones_like(ids, dtype=torch.bool)
    else:
        mask = torch.as_tensor(attention_mask).detach().to("cpu")
        if tuple(mask.shape) != tuple(ids.shape):
            raise ValueError(f"attention_mask has shape {tuple(mask.shape)} but input_ids has {tuple(ids.shape)}.")
        mask = mask.bool()
    empty = (~mask.any(-1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(
            f"The prompt is empty for sequence(s) {empty[:8]} (attention_mask is all zeros): "
            f"pass at least one token per sequence."
        )
    kept = ids[mask]
    vocab = model.config.vocab_size
    if int(kept.min()) < 0 or int(kept.max()) >= vocab:
        raise ValueError(
            f"input_ids hold ids outside the vocabulary [0, {vocab}): found {int(kept.min())}..{int(kept.max())}."
        )
    return ids, [row[m].tolist() for row, m in zip(ids, mask)], out_device


def _max_new_tokens(config: GenerationConfig, prompt_width: int) -> int:
    if config.max_new_tokens is not None:
        max_new = config.max_new_tokens
    elif config.max_length is not None:
        if not isinstance(config.max_length, int) or isinstance(config.max_length, bool):
            raise ValueError(f"max_length={config.max_length!r} must be a positive integer.")
        max_new = config.max_length - prompt_width
        if max_new < 1:
            raise ValueError(
                f"max_length={config.max_length} leaves no room after a prompt of {prompt_width} tokens: "
                f"pass max_new_tokens instead."
            )
    else:
        max_new = _DEFAULT_MAX_NEW_TOKENS
    if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 1:
        raise ValueError(f"max_new_tokens={max_new!r} must be a positive integer.")
    return max_new


def _pad_and_eos(model, config: GenerationConfig, no_eos: bool) -> tuple[list[int], int]:
    eos = _as_list(config.eos_token_id)
    if not eos and not no_eos:  # eos_token_id=None passed explicitly means "never stop early", as in transformers
        eos = _as_list(
            getattr(model.generation_config, "eos_token_id", None) if model.generation_config else None
        ) or _as_list(model.config.eos_token_id)
    pad = config.pad_token_id
    if pad is None and model.generation_config is not None:
        pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.config.pad_token_id
    if isinstance(pad, (list, tuple)):
        pad = pad[0] if pad else None
    if pad is None:
        pad = eos[0] if eos else 0
    return eos, int(pad)


def _sampling(
    config: GenerationConfig, eos: list[int], row: int, seed: Optional[int], generator: Optional[torch.Generator]
) -> SamplingParams:
    """Row `row`'s settings: with `seed`, its own generator seeded `seed + row`, so each row of a batch
    samples what it samples alone with that seed."""
    return SamplingParams(
        do_sample=config.do_sample,
        temperature=config.temperature,
        top_k=config.top_k,
        top_p=config.top_p,
        min_p=config.min_p,
        repetition_penalty=config.repetition_penalty,
        min_new_tokens=config.min_new_tokens if config.min_new_tokens is not None else 0,
        eos_token_ids=eos,
        seed=(seed + row) % 2**64 if seed is not None else None,
        generator=generator if seed is None else None,
    )


def _without_autocast(device: torch.device):
    """Generation computes in the model's dtype, as its static caches do: an enclosing autocast region
    is switched off for the steps (under it the cache writes would mix dtypes). Load the model in
    bfloat16 for bfloat16 generation."""
    try:
        if torch.is_autocast_enabled(device_kind(device)):
            return torch.autocast(device_kind(device), enabled=False)
    except (RuntimeError, TypeError, ValueError):  # a device kind autocast does not know
        pass
    return contextlib.nullcontext()


def _grammars(structured: Any, tokenizer, vocab: int, eos: list, rows: int) -> list:
    """One compiled grammar (or None) per row from `generate`'s `structured_outputs` (see `generate`)."""
    if structured is None:
        return [None] * rows
    per_row = isinstance(structured, (list, tuple))
    specs = list(structured) if per_row else [structured] * rows
    if len(specs) != rows:
        raise ValueError(
            f"structured_outputs lists {len(specs)} constraints for a batch of {rows} rows: pass one per "
            f"row or a single one for all."
        )
    out, compiled = [], {}
    for given in specs:
        spec = given
        if spec is None or isinstance(spec, Grammar):
            out.append(spec)
            continue
        if isinstance(spec, dict):
            unknown = set(spec) - {"json", "regex", "choice", "grammar", "json_object", "whitespace"}
            if unknown:
                raise ValueError(
                    f"structured_outputs has unknown keys {sorted(unknown)}: use json, regex, choice, "
                    f"grammar or json_object."
                )
            spec = StructuredOutputs(**spec)
        if not isinstance(spec, StructuredOutputs):
            raise TypeError(
                f"structured_outputs must be a StructuredOutputs, a dict or a Grammar, not {type(spec).__name__}."
            )
        if tokenizer is None:
            raise ValueError("structured_outputs needs the model's tokenizer to compile its grammar: pass tokenizer=.")
        key = id(given)  # one compile per distinct constraint given (the list repeats the same object)
        if key not in compiled:
            compiled[key] = compiler_for(tokenizer, vocab, eos).compile(spec)
        out.append(compiled[key])
    return out


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
) -> Union[torch.Tensor, GenerateDecoderOnlyOutput]:
    """Generate continuations: returns `[batch, prompt + new]` token ids on the inputs' device (with
    `return_dict_in_generate=True`, a `GenerateDecoderOnlyOutput` holding them and, with
    `output_logits=True`, each step's logits).

    Options use transformers' names (`max_new_tokens`, `min_new_tokens`, `do_sample`, `temperature`,
    `top_k`, `top_p`, `min_p`, `repetition_penalty`, `eos_token_id`, `pad_token_id`,
    `cache_implementation`, `disable_compile`, ...) and default to the checkpoint's
    generation_config.json. `compile_config` chooses the backend (default: the device's);
    `shape_plan` replaces the plan for this call; `seed` (row i of the batch samples with seed + i) or
    `generator` (shared by the rows) makes sampling reproducible. `adapter_names` (PEFT's): one adapter
    name per row ("__base__": none), the rows batched together over stacked adapter weights
    (`adapters/bank.py`). Speculative decoding, with transformers' names: `prompt_lookup_num_tokens=k`
    (and `max_matching_ngram_size`), or `assistant_model=draft` with `num_assistant_tokens=k`
    (`speculative.py`); greedy output is the output without it, sampling keeps its distribution.
    `structured_outputs` (vLLM's name): a `StructuredOutputs`, a dict of its fields
    (`{"json": schema}`, `{"regex": ...}`, `{"choice": [...]}`, `{"grammar": ebnf}`, `{"json_object": True}`)
    or a compiled `Grammar`, or one per row (None: free); it needs `tokenizer=` unless compiled. A row
    whose grammar is complete ends there.
    """
    if inputs is not None and input_ids is not None:
        raise ValueError("Pass the prompt once: inputs or input_ids, not both.")
    input_ids = inputs if input_ids is None else input_ids
    no_eos = "eos_token_id" in kwargs and kwargs["eos_token_id"] is None
    adapter_names = kwargs.pop("adapter_names", None)
    structured = kwargs.pop("structured_outputs", None)
    tokenizer = kwargs.pop("tokenizer", None)
    as_dict = bool(kwargs.pop("return_dict_in_generate", False))
    want_logits = bool(kwargs.pop("output_logits", False))
    if kwargs.pop("output_scores", False):
        raise ValueError(
            "output_scores=True (the processed scores) is not available here: pass output_logits=True "
            "with return_dict_in_generate=True for the unprocessed logits of each step."
        )
    speculative = {key: kwargs.pop(key) for key in SPECULATIVE_ARGUMENTS if key in kwargs}
    config = merged_config(model, generation_config, kwargs)
    speculator = speculator_from_generate(  # speculative.py; the draft compiles as the model does
        model, speculative, lambda draft: (engine_for(draft), compile_settings(draft, config, compile_config))
    )
    engine = engine_for(model)
    ids, prompts, out_device = _prompts(model, input_ids, attention_mask)
    if config.cache_implementation not in (None, "static"):
        raise ValueError(
            f"cache_implementation={config.cache_implementation!r} is not available: staticformers' "
            f'cache is always static (pass None or "static").'
        )
    max_new = _max_new_tokens(config, ids.shape[1])
    if generator is not None and seed is not None:
        raise ValueError("Pass generator or seed, not both.")
    if seed is not None:
        check_seed(seed)
    eos, pad = _pad_and_eos(model, config, no_eos)
    if adapter_names is not None and (
        not isinstance(adapter_names, (list, tuple))
        or len(adapter_names) != len(prompts)
        or not all(isinstance(n, str) for n in adapter_names)
    ):
        raise ValueError(f'adapter_names must list one adapter name per row ({len(prompts)}), "__base__" for none.')
    grammars = _grammars(structured, tokenizer, model.config.vocab_size, eos, len(prompts))
    requests = [
        GenerationRequest(
            p,
            max_new,
            _sampling(config, eos, i, seed, generator),
            request_id=i,
            adapter=adapter_names[i] if adapter_names is not None else None,
            output_logits=as_dict and want_logits,
            structured_outputs=grammars[i],
        )
        for i, p in enumerate(prompts)
    ]
    settings = compile_settings(model, config, compile_config)
    plan = shape_plan.bind(model.config.max_position_embeddings) if shape_plan is not None else None
    if streamer is not None and len(prompts) != 1:
        raise ValueError(f"A streamer follows one sequence; this batch has {len(prompts)}: stream batch 1.")
    new: list[list[int]] = [[] for _ in prompts]
    step_logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    draft_engine = getattr(speculator.proposer, "engine", None) if speculator is not None else None
    draft_lock = draft_engine.lock if draft_engine is not None else contextlib.nullcontext()
    with engine.lock, draft_lock:
        if adapter_names is not None:
            bank_for_names(model, adapter_names)
        loop = GenerationLoop(engine, settings, plan, speculator=speculator)
        for request in requests:  # every request is checked before any device work
            loop.validate(request)
        engine.check_weights()
        if draft_engine is not None:
            draft_engine.check_weights()
        for request in requests:
            loop.add(request)
        if streamer is not None:
            streamer.put(ids.clone())
        try:
            with _without_autocast(model.device):
                while not loop.idle:
                    for event in loop.step():
                        if event.error is not None:
                            raise event.error
                        new[event.request_id].append(event.token)
                        if event.logits is not None:
                            step_logits[event.request_id].append(event.logits)
                        if streamer is not None:
                            streamer.put(torch.tensor([event.token], dtype=torch.long))
        finally:
            loop.close()
            if streamer is not None:
                streamer.end()
    longest = max(len(n) for n in new)
    out = torch.full((len(new), longest), pad, dtype=torch.long)
    for i, tokens in enumerate(new):
        out[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    sequences = torch.cat([ids, out], dim=1).to(out_device)
    if not as_dict:
        return sequences
    logits = None
    if want_logits:
        vocab = model.config.vocab_size
        logits = tuple(
            torch.stack(
                [
                    rows[t]
                    if t < len(rows)
                    else torch.full((vocab,), float("nan"), device=rows[0].device, dtype=rows[0].dtype)
                    for rows in step_logits
                ]
            ).to(out_device)
            for t in range(longest)
        )
    return GenerateDecoderOnlyOutput(sequences=sequences, logits=logits)
