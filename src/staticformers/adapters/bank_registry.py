"""Which adapter bank each model has: a weak map keyed by the model, not an attribute on it.

A bank (`bank.py`) is owned by the adapter layer: the model object carries no run-time state for it. The
bank refers back to its model weakly, so an entry disappears with its model.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

_BANKS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def bank_of(model) -> Optional[Any]:
    """The model's AdapterBank, or None."""
    return _BANKS.get(model)


def set_bank(model, bank) -> None:
    _BANKS[model] = bank


def drop_bank(model) -> None:
    _BANKS.pop(model, None)


__all__ = ["bank_of", "set_bank", "drop_bank"]
