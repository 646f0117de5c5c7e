"""dpengine: a threaded data-parallel engine that shows what each replica did."""

from .data_parallel import DataParallel
from .devices import auto_devices, available_devices, device_name, resolve_devices
from .parallel_apply import ReplicaFailure, replica_failure
from .records import ReplicaRecord, StepRecord
from .run_protocol import ControlUnsupported, Run

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
    "device_name",
    "replica_failure",
    "resolve_devices",
    "__version__",
]
