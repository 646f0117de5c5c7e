"""What crosses the private pipes between a script run by `dptui run` and dptui.

Child -> dptui, one JSON object per line (steps use the `step` form of dpengine.eventlog.events):
  {"type": "dp_created", "instance": KEY, "name": TEXT, "devices": [...], "copy_of": KEY | null}
      once per instance: a DataParallel (or a functional data_parallel call site) wrapping a
      module not seen there before; a deepcopy or unpickled one names the instance it copies
  {"type": "step", "instance": KEY, ...to_json_dict(StepFinished)}   every step; `step` counts
      the instance's steps from 1 (dropped ones included)
  {"type": "dropped", "instance": KEY, "steps": N}   N steps of KEY not sent: dptui fell
      further behind than the child's queue holds
  {"type": "threads", "instance": KEY, "threads": {device: native thread id}}
  {"type": "state", "state": "paused" | "running", "request": R}
  {"type": "config", "instance": KEY, "devices": [...], "step": N, "request": R}
KEY is the instance's label (dpengine.script.instances): `DataParallel(Net, 1.2k params)@train.py:42`.
dptui -> child, the control pipe (its EOF means dptui is gone):
  {"op": "pause", "request": R} | {"op": "resume", "request": R}
  {"op": "devices", "devices": [...], "request": R}
R numbers dptui's requests; the state or config that answers one carries it back.
"""

from __future__ import annotations

import math
from typing import Any

from ..eventlog.events import StepFinished
from ..records import ReplicaRecord, StepRecord

# Environment variables the bootstrap reads (and removes, so the script's own children do not see them).
EVENTS_FD = "DPTUI_RUN_EVENTS_FD"
CONTROL_FD = "DPTUI_RUN_CONTROL_FD"
DEVICES = "DPTUI_RUN_DEVICES"
PARENT_PID = "DPTUI_RUN_PARENT_PID"  # dptui's pid: the parent the child checks it still has
LIFELINE_FD = "DPTUI_RUN_LIFELINE_FD"  # a pipe only dptui writes to (never does): EOF when it is gone


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in value or ())


def _number(value: Any) -> float:
    return math.nan if value is None else float(value)


def step_from_json(body: dict[str, Any]) -> StepFinished:
    """The StepFinished that `to_json_dict` wrote (JSON null for NaN comes back as NaN)."""
    replicas = tuple(
        ReplicaRecord(
            index=r["index"], device=r["device"], chunk_size=r["chunk_size"],
            input_shapes=tuple(_shape(s) for s in r["input_shapes"]),
            output_shapes=tuple(_shape(s) for s in r["output_shapes"]),
            forward_ms=_number(r["forward_ms"]), memory_bytes=r["memory_bytes"],
            peak_memory_bytes=r.get("peak_memory_bytes"), backward_ms=r.get("backward_ms"),
        )
        for r in body["replicas"]
    )
    engine = body["engine"]
    record = StepRecord(
        step=engine["step"], dim=engine["dim"], batch_size=engine["batch_size"],
        input_shapes=tuple(_shape(s) for s in engine["input_shapes"]),
        output_shapes=tuple(_shape(s) for s in engine["output_shapes"]), replicas=replicas,
        scatter_ms=_number(engine["scatter_ms"]), replicate_ms=_number(engine["replicate_ms"]),
        apply_ms=_number(engine["apply_ms"]), gather_ms=_number(engine["gather_ms"]),
        total_ms=_number(engine["total_ms"]), backward_ms=engine.get("backward_ms"),
    )
    return StepFinished(
        epoch=body["epoch"], step=body["step"], step_in_epoch=body["step_in_epoch"],
        steps_in_epoch=body["steps_in_epoch"], batch_size=body["batch_size"],
        input_shape=_shape(body["input_shape"]), output_shape=_shape(body["output_shape"]),
        loss=_number(body["loss"]), samples_per_s=_number(body["samples_per_s"]),
        record=record, seconds=_number(body["seconds"]), instance=body.get("instance"),
    )
