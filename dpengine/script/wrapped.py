"""One of torch's functions or methods wrapped where torch binds it, once: what the rank's hooks on
FSDP, `nn.Module.train` and the DataLoader's iterator are built on."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def wrap(owner: Any, name: str, around: Callable[..., Any]) -> None:
    """`owner.name(*args, **kwargs)` becomes `around(original, *args, **kwargs)`, with the original's name,
    docstring and signature; wrapping it again does nothing."""
    original = getattr(owner, name)
    if getattr(original, "_dptui", False):
        return

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        return around(original, *args, **kwargs)

    wrapped._dptui = True
    setattr(owner, name, wrapped)
