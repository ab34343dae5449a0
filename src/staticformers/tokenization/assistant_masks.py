"""Assistant-token masks: which tokens of a rendered chat the template marked as the assistant's.

Chat templates written for training wrap what the assistant says in `{% generation %}` ...
`{% endgeneration %}`. Rendering records the character span of each block (`chat_template.render(...,
return_spans=True)`); this module maps those spans to token positions through the tokenizer's
offsets, the way `transformers.PreTrainedTokenizerBase.apply_chat_template(...,
return_assistant_tokens_mask=True)` does, so the masks are equal to transformers' token for token:

- a span covers the tokens from the one holding its first character to the one holding its last;
- when the first character is in no token (cut off by truncation), that span and every later one of
  the conversation are dropped;
- when the last character is in no token (or its token is the first of the row), the span runs to
  the end of the row, padding included, as transformers' does.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")  # transformers' test for a training template


def has_generation_blocks(template: str) -> bool:
    """Whether the template marks the assistant's text with `{% generation %}` blocks."""
    return _GENERATION_TAG.search(template) is not None


def no_generation_blocks_message() -> str:
    return (
        "return_assistant_tokens_mask=True needs a chat template that wraps the assistant's text in "
        "{% generation %} ... {% endgeneration %}, and this one has no such blocks: pass chat_template= a "
        "training template that marks them (for training, TrainingArguments(chat_template_path=...))."
    )


def token_masks(encodings: Sequence[Any], spans: Sequence[Sequence[tuple[int, int]]]) -> list[list[int]]:
    """One 0/1 list per encoding (a `tokenizers.Encoding` with offsets): 1 on tokens inside a span."""
    masks = []
    for encoding, row_spans in zip(encodings, spans):
        mask = [0] * len(encoding.ids)
        for start_char, end_char in row_spans:
            start = encoding.char_to_token(start_char, 0)
            if start is None:  # cut off (truncation): so is everything after it
                break
            if end_char == 0:  # an empty block at the very start marks nothing (transformers raises there)
                continue
            end = encoding.char_to_token(end_char - 1, 0)
            stop = end + 1 if end else len(mask)  # transformers' `if end_token`: None and 0 both run to the end
            for position in range(start, stop):
                mask[position] = 1
        masks.append(mask)
    return masks


__all__ = ["has_generation_blocks", "no_generation_blocks_message", "token_masks"]
