"""Conversational and prompt-completion examples (TRL's dataset formats) as Documents with loss masks.

The formats, named as TRL's `SFTTrainer` names them:
- **conversational**: `{"messages": [{"role": ..., "content": ...}, ...]}`, with optional `tools`
  (a list of JSON schemas, or that list as a JSON string) and `chat_template_kwargs` per example;
- **prompt-completion**: `{"prompt": ..., "completion": ...}`, both strings, or both message lists
  (the conversation is the prompt's messages followed by the completion's).

Conversations become ids through the tokenizer's chat template (`apply_chat_template`, which TRL
calls the same way); nothing is appended, since the template ends each turn. String pairs are
tokenised as text (with the tokenizer's special tokens) and get the EOS token appended to the
completion, as `text` examples do.

Which tokens carry loss (the others get label -100), with TRL's names and defaults:
- `assistant_only_loss=True`: only the tokens the template's `{% generation %}` blocks mark as the
  assistant's (`return_assistant_tokens_mask=True`); conversational examples only.
- `completion_only_loss` (None: True for prompt-completion examples): only the completion's tokens,
  which start where the tokenised prompt (with the generation prompt) and the tokenised whole
  example stop agreeing. `text` and `messages` examples are not affected.
Both at once: a token carries loss when both masks keep it.

`use_chat_template_file` is `TrainingArguments(chat_template_path=...)`: the tokenizer's template is
replaced (as TRL does) by a Jinja file or by the template of another tokenizer folder, so a template
without `{% generation %}` can be swapped for a training one, and the saved tokenizer keeps it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any, Optional

from ..tokenization.tokenizer import AutoTokenizer
from .documents import IGNORE_INDEX, Document, ExampleError, TextEncoder

logger = logging.getLogger("staticformers")

CHAT_KEYS = ("messages", "prompt")


def is_chat_example(example: Any) -> bool:
    """Whether an example is conversational (`messages`) or prompt-completion (`prompt`)."""
    return hasattr(example, "keys") and any(k in example for k in CHAT_KEYS)


def _is_message_list(value: Any) -> bool:
    return (
        isinstance(value, (list, tuple))
        and len(value) > 0
        and all(isinstance(m, Mapping) and "role" in m for m in value)
    )


def _common_prefix_length(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class ChatEncoder:
    """Encodes the conversational and prompt-completion examples of one dataset (see the module docstring)."""

    def __init__(self, tokenizer: Any, assistant_only_loss: bool = False, completion_only_loss: Optional[bool] = None):
        self.tokenizer = tokenizer
        self.assistant_only_loss = bool(assistant_only_loss)
        self.completion_only_loss = completion_only_loss
        self.prompt_completion_examples = 0
        self._warned_prefix = False
        self._checked_stop = False
        self._text: Optional[TextEncoder] = None
        self._prompt_text: Optional[TextEncoder] = None

    # ---- checks ------------------------------------------------------------------------------
    def check_plain(self, index: int, kind: str) -> None:
        """Refuse a `text` / `input_ids` example when the loss must fall on the assistant's tokens only."""
        if self.assistant_only_loss:
            raise ExampleError(
                index,
                f"assistant_only_loss=True needs conversational examples ('messages', or 'prompt'/'completion' as "
                f"message lists), but example {index} is {kind}: convert it, or set assistant_only_loss=False.",
            )

    def finish(self) -> None:
        """After the last example: completion_only_loss=True must have had prompt-completion examples."""
        if self.completion_only_loss is True and self.prompt_completion_examples == 0:
            raise ValueError(
                "completion_only_loss=True needs 'prompt'/'completion' examples and this dataset has none: "
                "give such examples, or leave completion_only_loss unset."
            )

    def _chat_tokenizer(self, index: int) -> Any:
        tok = self.tokenizer
        if tok is None or not callable(getattr(tok, "apply_chat_template", None)):
            raise ExampleError(
                index,
                f"Example {index} is a conversation, which needs a tokenizer with a chat template: pass "
                f"processing_class=AutoTokenizer.from_pretrained(...) to Trainer.",
            )
        return tok

    # ---- encoding ----------------------------------------------------------------------------
    def encode(self, example: Mapping, index: int) -> Document:
        if "messages" in example:
            messages = example["messages"]
            if not _is_message_list(messages):
                raise ExampleError(
                    index,
                    f"Example {index} has 'messages' that are not a non-empty list of "
                    f"{{'role': ..., 'content': ...}} dicts: fix that example.",
                )
            ids, assistant = self._render(messages, example, index)
            return self._document(ids, assistant, None, index)
        if "completion" not in example:
            raise ExampleError(
                index,
                f"Example {index} has a 'prompt' but no 'completion': give both (prompt-completion), "
                f"or put the conversation under 'messages'.",
            )
        prompt, completion = example["prompt"], example["completion"]
        self.prompt_completion_examples += 1
        if isinstance(prompt, str) and isinstance(completion, str):
            self.check_plain(index, "a prompt-completion pair of strings")
            return self._encode_text_pair(prompt, completion, index)
        if _is_message_list(prompt) and _is_message_list(completion):
            return self._encode_chat_pair(list(prompt), list(completion), example, index)
        raise ExampleError(
            index,
            f"Example {index} has a 'prompt' and a 'completion' of different kinds "
            f"({type(prompt).__name__}, {type(completion).__name__}): make both strings or both "
            f"message lists.",
        )

    def _template_kwargs(self, example: Mapping, index: int) -> dict:
        tools = example.get("tools")
        if isinstance(tools, str):
            try:
                tools = json.loads(tools)
            except json.JSONDecodeError as err:
                raise ExampleError(
                    index, f"Example {index} has 'tools' that are not valid JSON ({err.msg}): fix that example."
                ) from None
        extra = example.get("chat_template_kwargs") or {}
        if not isinstance(extra, Mapping):
            raise ExampleError(
                index, f"Example {index} has 'chat_template_kwargs' that are not a dict: fix that example."
            )
        return {"tools": tools, **extra}

    def _apply(self, messages: list, kwargs: dict, index: int, **flags: Any) -> Any:
        tok = self._chat_tokenizer(index)
        try:
            return tok.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs, **flags)
        except ValueError as err:
            raise ExampleError(index, f"Example {index}: {err}") from err
        except TypeError as err:
            raise TypeError(f"Example {index}: {err}") from err
        except Exception as err:  # jinja2 TemplateError from raise_exception(...), and the like
            raise ExampleError(index, f"Example {index} could not be rendered with the chat template: {err}") from err

    def _render(self, messages: list, example: Mapping, index: int) -> tuple[list, Optional[list]]:
        out = self._apply(
            messages,
            self._template_kwargs(example, index),
            index,
            return_assistant_tokens_mask=self.assistant_only_loss,
        )
        ids = [int(t) for t in out["input_ids"]]
        if not self.assistant_only_loss:
            return ids, None
        assistant = [int(m) for m in out["assistant_masks"]]
        if 1 not in assistant:
            raise ExampleError(
                index,
                f"Example {index} has no assistant tokens under assistant_only_loss=True: it has no assistant turn, "
                f"or the chat template marks none (it needs {{% generation %}} blocks; pass "
                f"TrainingArguments(chat_template_path=...) a training template).",
            )
        if not self._checked_stop:
            self._checked_stop = True
            self._warn_if_stop_token_untrained(ids, assistant)
        return ids, assistant

    def _warn_if_stop_token_untrained(self, ids: list, assistant: list) -> None:
        """TRL's check: the last marked token (whitespace aside) must be an added token such as the end of turn."""
        tok = self.tokenizer
        added = set(getattr(tok, "added_tokens_decoder", {}) or {})
        for t in reversed([t for t, m in zip(ids, assistant) if m]):
            if tok.decode([t]).strip():
                if t not in added:
                    logger.warning(
                        "The chat template's {%% generation %%} blocks end on %r, not on an end-of-turn "
                        "token, so under assistant_only_loss the model never learns to stop: put the "
                        "end-of-turn token inside the block.",
                        tok.decode([t]),
                    )
                return

    def _encode_chat_pair(self, prompt: list, completion: list, example: Mapping, index: int) -> Document:
        kwargs = self._template_kwargs(example, index)
        prompt_ids = [int(t) for t in self._apply(prompt, kwargs, index, add_generation_prompt=True)["input_ids"]]
        ids, assistant = self._render(prompt + completion, example, index)
        return self._document(ids, assistant, self._completion_mask(prompt_ids, ids), index)

    def _encode_text_pair(self, prompt: str, completion: str, index: int) -> Document:
        if self._text is None:
            self._text = TextEncoder(self.tokenizer)
            self._prompt_text = TextEncoder(self.tokenizer, add_eos=False)
        prompt_ids = self._prompt_text.encode_batch([prompt])[0]
        ids = self._text.encode_batch([prompt + completion])[0]
        return self._document(ids, None, self._completion_mask(prompt_ids, ids), index)

    def _completion_mask(self, prompt_ids: list, ids: list) -> list:
        start = _common_prefix_length(prompt_ids, ids)
        if start < len(prompt_ids) and not self._warned_prefix:
            self._warned_prefix = True
            logger.warning(
                "The tokenised prompt is not a prefix of the tokenised prompt + completion (the template "
                "renders the prompt alone differently, or tokens merge across the boundary): the "
                "completion's loss starts where they differ, at token %d of %d. Shown once.",
                start,
                len(ids),
            )
        return [0] * start + [1] * (len(ids) - start)

    def _document(self, ids: list, assistant: Optional[list], completion: Optional[list], index: int) -> Document:
        masks = [
            m for m in (assistant, completion if self.completion_only_loss is not False else None) if m is not None
        ]
        if not masks:
            return Document(ids)
        labels = [t if all(m[i] for m in masks) else IGNORE_INDEX for i, t in enumerate(ids)]
        return Document(ids, labels)


def use_chat_template_file(tokenizer: Any, path: str) -> None:
    """Replace the tokenizer's chat template by a Jinja file's text or another tokenizer folder's template."""
    if tokenizer is None:
        raise ValueError("chat_template_path is set but no tokenizer was given: pass processing_class=tokenizer.")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            template: Any = f.read()
        if not template.strip():
            raise ValueError(f"chat_template_path={path!r} is an empty file: give a Jinja chat template.")
    elif os.path.isdir(path):
        source = AutoTokenizer.from_pretrained(path)
        template = source.chat_template
        if template is None:
            raise ValueError(
                f"chat_template_path={path!r} is a tokenizer folder without a chat template: give a "
                f"folder that has one, or a .jinja file."
            )
        text = template if isinstance(template, str) else "\n".join(template.values())
        vocab = tokenizer.get_vocab()
        missing = sorted(
            {t.content for t in source.added_tokens_decoder.values() if t.content in text and t.content not in vocab}
        )
        if missing:
            raise ValueError(
                f"The chat template in {path} writes token(s) {', '.join(missing)} that this tokenizer "
                f"does not have: add them (tok.add_tokens, then resize the model's embeddings), or use a "
                f"template made for this tokenizer."
            )
    else:
        raise FileNotFoundError(
            f"chat_template_path={path!r} does not exist: give a .jinja file or a tokenizer "
            f"folder with a chat template."
        )
    tokenizer.chat_template = template


__all__ = ["ChatEncoder", "is_chat_example", "use_chat_template_file", "CHAT_KEYS"]
