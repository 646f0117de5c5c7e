"""dpengine: a threaded data-parallel engine that shows what each replica did."""

from .data_parallel import DataParallel
from .devices import auto_devices, available_devices, device_name, resolve_devices

# torch.nn.parallel's functions; as in torch, these names shadow the submodules of the same name.
from .functional import data_parallel, gather, parallel_apply, replicate, scatter
from .parallel_apply import ReplicaFailure, replica_failure
from .records import ReplicaRecord, StepRecord
from .run.protocol import ControlUnsupported, Run

__version__ = "0.1.0"

__all__ = [
    "ControlUnsupported",
    "DataParallel",
    "ReplicaFailure",
    "ReplicaRecord",
    "Run",
    "StepRecord",
    "auto_devices",
    "available_devices",
    "data_parallel",
    "device_name",
    "gather",
    "parallel_apply",
    "replica_failure",
    "replicate",
    "resolve_devices",
    "scatter",
    "__version__",
]
