"""Which DataParallel instance a script's DataParallel object is, and its label.

An instance is the module it wraps plus the line that built it: a DataParallel rebuilt every
step around the same model at the same line is one instance, two models wrapped by one helper
are two. The label, which names the instance on the wire, in events and on screen, is the
call site with the model's class and parameter count, numbered where two would read the same:
`DataParallel(Net, 1.2k params)@train.py:42`, `... #2`. A copy (deepcopy, an EMA model) is an
instance of its own: `copy of DataParallel(Net, 1.2k params)@train.py:42`.
"""

from __future__ import annotations

import copy
import os
import sys
import threading
import weakref
from collections import Counter

import torch
from torch import nn

_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # dpengine/
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
_COPY = os.path.abspath(copy.__file__)


def count_text(n: int) -> str:
    """12 params, 1.2k params, 3.4M params."""
    for size, unit in ((10**9, "B"), (10**6, "M"), (10**3, "k")):
        if n >= size:
            value = n / size
            return f"{value:.1f}{unit}".replace(".0" + unit, unit) if value < 100 else f"{value:.0f}{unit}"
    return str(n)


def call_site(skip_self: object = None) -> str:
    """file:line of the user's code that is calling us: past dpengine, torch and `copy` frames,
    and past a subclass's own __init__ (a frame whose `self` is `skip_self`)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith((_OURS, _TORCH)) and path != _COPY and (
                skip_self is None or frame.f_locals.get("self") is not skip_self):
            return f"{os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class Instances:
    """The labels given so far: one per (wrapped module, site)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[tuple[int, str], tuple[weakref.ref, str]] = {}
        self._taken: Counter[str] = Counter()

    def label(self, kind: str, module: nn.Module, site: str) -> str:
        """The instance's label; a new one for a module and site not seen together before."""
        known = self._known((id(module), site), module)
        if known is not None:
            return known
        params = sum(p.numel() for p in module.parameters() if not nn.parameter.is_lazy(p))  # LazyLinear: none yet
        plural = "" if params == 1 else "s"
        return self._claim((id(module), site), module,
                           f"{kind}({type(module).__qualname__}, {count_text(params)} param{plural})@{site}")

    def copy_label(self, original: str, module: nn.Module) -> str:
        """A copy's label: `copy of` the original's, numbered as labels are."""
        key = (id(module), "copy of " + original)
        return self._known(key, module) or self._claim(key, module, "copy of " + original)

    def _known(self, key: tuple[int, str], module: nn.Module) -> str | None:
        with self._lock:
            known = self._by_key.get(key)
        return known[1] if known is not None and known[0]() is module else None

    def _claim(self, key: tuple[int, str], module: nn.Module, base: str) -> str:
        with self._lock:
            known = self._by_key.get(key)
            if known is not None and known[0]() is module:
                return known[1]
            self._taken[base] += 1
            n = self._taken[base]
            label = base if n == 1 else f"{base} #{n}"
            self._by_key[key] = (weakref.ref(module, lambda _ref, key=key: self._forget(key)), label)
            return label

    def _forget(self, key: tuple[int, str]) -> None:
        with self._lock:
            known = self._by_key.get(key)
            if known is not None and known[0]() is None:
                del self._by_key[key]
