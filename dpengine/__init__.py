"""dpengine: a threaded data-parallel engine that shows what each replica did.

The names below load on first use (PEP 562), so that importing a torch-free part of the
package (the event log, for `dptui view`) does not import torch: `from dpengine import
DataParallel` works as ever.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> the module that defines it. torch.nn.parallel's functions: as in torch, these names
# shadow the submodules of the same name once looked up.
_EXPORTS = {
    "DataParallel": ".data_parallel",
    "auto_devices": ".devices",
    "available_devices": ".devices",
    "device_name": ".devices",
    "resolve_devices": ".devices",
    "data_parallel": ".functional",
    "gather": ".functional",
    "parallel_apply": ".functional",
    "replicate": ".functional",
    "scatter": ".functional",
    "ReplicaFailure": ".parallel_apply",
    "replica_failure": ".parallel_apply",
    "ReplicaRecord": ".records",
    "StepRecord": ".records",
    "ControlUnsupported": ".run.protocol",
    "Run": ".run.protocol",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

if TYPE_CHECKING:
    from .data_parallel import DataParallel
    from .devices import auto_devices, available_devices, device_name, resolve_devices
    from .functional import data_parallel, gather, parallel_apply, replicate, scatter
    from .parallel_apply import ReplicaFailure, replica_failure
    from .records import ReplicaRecord, StepRecord
    from .run.protocol import ControlUnsupported, Run


# Functions named like a submodule: importing the submodule must not rebind the name to it.
_SHADOWING = {"data_parallel", "parallel_apply", "replicate"}


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SHADOWING and isinstance(value, types.ModuleType):
            return  # the import system binding the submodule: the function keeps the name
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
