"""A token's own bytes and the text an API shows for it, for tokens that are not whole characters.

Byte-level BPE (GPT-2, Llama 3, Qwen) and ByteFallback (`<0xE2>`, Llama 2, Mistral) vocabularies hold
tokens that are a part of a UTF-8 character: decoded alone, each gives U+FFFD "�", so tokens that differ
decode to the same text. OpenAI's API answers with the token's bytes instead: `bytes` (chat) is the
token's own UTF-8 bytes, and a token that is not valid UTF-8 on its own is shown as `"bytes:\\xe2\\x80"`
(as its legacy completions' logprobs do), which keeps such tokens apart wherever they are keys.
"""

from __future__ import annotations

import functools
import re
from typing import Any

_REPLACEMENT = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """The GPT-2 byte-level alphabet, character -> byte (as `tokenizers`' ByteLevel maps them)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_bytes(tokenizer: Any, token: int) -> bytes:
    """The bytes token `token` stands for: its text's UTF-8 when it decodes to whole characters, else its
    raw bytes (a `<0xHH>` byte token, or a byte-level token's characters mapped back to bytes)."""
    text = tokenizer.decode([token])
    if _REPLACEMENT not in text:
        return text.encode("utf-8")
    piece = tokenizer.convert_ids_to_tokens(token)
    if isinstance(piece, str):
        match = _BYTE_TOKEN.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        alphabet = _byte_level_alphabet()
        if piece and all(c in alphabet for c in piece):
            return bytes(alphabet[c] for c in piece)
    return text.encode("utf-8")


def shown_text(tokenizer: Any, token: int) -> str:
    """The token as an API shows it: its text, or `bytes:\\xNN...` when its bytes are not UTF-8 alone."""
    raw = token_bytes(tokenizer, token)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


__all__ = ["shown_text", "token_bytes"]
