"""`pipeline("text-generation", ...)`: transformers' one-line entry point over the engine.

Takes a string, a list of strings, chat messages (a list of `{"role", "content"}` dicts, run through
the tokenizer's chat template) or a list of chats; returns what transformers returns:
`[{"generated_text": ...}]` per input (the full text, or only the new text with
`return_full_text=False`; for chats, the messages with the assistant's reply appended). Prompts are
tokenized one by one and left-padded here, so the result does not depend on the tokenizer's padding
side; the engine's plan decides the shapes.
"""

from __future__ import annotations

from typing import Any, Union

import torch

TASKS = ("text-generation",)
DEFAULT_MAX_NEW_TOKENS = 256


def _is_chat(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(m, dict) and "role" in m for m in x)


class TextGenerationPipeline:
    """Callable: `pipe(text_or_chat, max_new_tokens=..., return_full_text=True, **generate_kwargs)`."""

    task = "text-generation"

    def __init__(self, model, tokenizer, **generate_defaults):
        self.model = model
        self.tokenizer = tokenizer
        self.generate_defaults = generate_defaults

    @property
    def device(self) -> torch.device:
        return self.model.device

    def _encode(self, item: Any) -> list[int]:
        if _is_chat(item):
            ids = self.tokenizer.apply_chat_template(list(item), add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            if isinstance(ids, torch.Tensor):
                ids = ids.tolist()
            if ids and isinstance(ids[0], list):
                ids = ids[0]
            return list(ids)
        if not isinstance(item, str):
            raise TypeError(
                f"text-generation takes a string, a list of strings or chat messages, got {type(item).__name__}."
            )
        ids = self.tokenizer(item)["input_ids"]
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return list(ids)

    def __call__(self, inputs: Union[str, list, tuple], return_full_text: bool = True, **kwargs) -> list:
        single = isinstance(inputs, str) or _is_chat(inputs)
        items = [inputs] if single else list(inputs)
        if not items:
            raise ValueError("text-generation got an empty list of inputs: pass at least one prompt.")
        encoded = [self._encode(item) for item in items]
        empty = [i for i, ids in enumerate(encoded) if not ids]
        if empty:
            raise ValueError(f"The prompt is empty for input(s) {empty[:8]}: pass some text.")
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
        width = max(len(ids) for ids in encoded)
        ids = torch.full((len(encoded), width), int(pad), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(encoded):
            ids[i, width - len(row) :] = torch.tensor(row)
            mask[i, width - len(row) :] = 1
        options = {"max_new_tokens": DEFAULT_MAX_NEW_TOKENS, **self.generate_defaults, **kwargs}
        if options.get("pad_token_id") is None:
            options["pad_token_id"] = int(pad)
        if "max_length" in kwargs and "max_new_tokens" not in kwargs:
            options.pop("max_new_tokens")
        out = self.model.generate(input_ids=ids, attention_mask=mask, **options)
        results = []
        for i, item in enumerate(items):
            new_text = self.tokenizer.decode(out[i, width:], skip_special_tokens=True)
            if _is_chat(item):
                text: Any = list(item) + [{"role": "assistant", "content": new_text}] if return_full_text else new_text
            else:
                text = item + new_text if return_full_text else new_text
            results.append([{"generated_text": text}])
        return results[0] if single else results


def pipeline(
    task: str = "text-generation",
    model: Any = None,
    tokenizer: Any = None,
    device: Any = None,
    dtype: Any = None,
    device_map: Any = None,
    torch_dtype: Any = None,
    **generate_defaults: Any,
) -> TextGenerationPipeline:
    """Build a text-generation pipeline from a path / Hub id or a loaded model (transformers' names).

    `device` (or `device_map`): "auto" (Neuron first), "neuron", "cuda", "cpu", ...; None keeps a
    loaded model where it is and loads a path on the CPU, as transformers does.
    """
    if task not in TASKS:
        raise ValueError(f"pipeline task {task!r} is not available: staticformers provides {', '.join(TASKS)}.")
    if model is None:
        raise ValueError('pipeline("text-generation") needs model= (a path, a Hub id or a loaded model).')
    if device is not None and device_map is not None:
        raise ValueError("Pass device or device_map, not both.")
    if torch_dtype is not None:
        if dtype is not None:
            raise ValueError("Pass dtype or its old name torch_dtype, not both.")
        dtype = torch_dtype
    place = device if device is not None else device_map
    from ..tokenization.tokenizer import AutoTokenizer

    if isinstance(model, str):
        from .auto import from_pretrained

        path = model
        model = from_pretrained(path, dtype=dtype, device_map=place)
    else:
        path = getattr(model, "name_or_path", None)
        if place is not None:
            from ..backends.devices import resolve_device

            model = model.to(resolve_device(place))
        if dtype is not None and dtype != "auto":  # "auto": keep the loaded model's dtype
            from ..models.model_config import parse_dtype

            model = model.to(parse_dtype(dtype))
    if tokenizer is None:
        if path is None:
            raise ValueError("pipeline() could not find a tokenizer for this model: pass tokenizer=.")
        tokenizer = AutoTokenizer.from_pretrained(path)
    elif isinstance(tokenizer, str):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    return TextGenerationPipeline(model, tokenizer, **generate_defaults)
