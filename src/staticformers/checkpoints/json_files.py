"""Reading the JSON files of a checkpoint (config, generation config, tokenizer files) with one error.

Each of them must hold a JSON object; a broken one is refused with a sentence naming the file, what
is wrong with it, and what to do.
"""

from __future__ import annotations

import json
import os
from typing import Any, Type, Union


def read_json_object(
    path: Union[str, os.PathLike], what_to_do: str, error: Type[Exception] = ValueError
) -> dict[str, Any]:
    """The object in `path`; `error(sentence)` when the file is not JSON or holds something else."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as err:
        raise error(f"{path} is not valid JSON ({err.msg} at line {err.lineno}): {what_to_do}.") from None
    except RecursionError:
        raise error(f"{path} nests JSON too deeply to be read: {what_to_do}.") from None
    if not isinstance(data, dict):
        raise error(f"{path} should hold a JSON object but holds a {type(data).__name__}: {what_to_do}.")
    return data
