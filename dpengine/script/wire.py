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
  {"type": "used", "what": "torch.nn.parallel.DistributedDataParallel"}   once: the script built
      a class this process does not record (unrecorded.py); dptui says so when it ends
  {"type": "closed"}   last, at the script's exit: the link lasted to its end (a script that closes
      fds it did not open, os.closerange(3, ...), or leaves by os._exit, never sends it)
  {"type": "notice", "text": TEXT}   once each: what dptui did differently from torch (gpu_ids.py:
      GPU ids run on virtual devices); dptui says it when the script ends
KEY is the instance's label (dpengine.script.instances): `DataParallel(Net, 1.2k params)@train.py:42`.
dptui -> child, the control pipe (its EOF means dptui is gone):
  {"op": "pause", "request": R} | {"op": "resume", "request": R}
  {"op": "devices", "devices": [...], "request": R}
R numbers dptui's requests; the state or config that answers one carries it back.
"""

from __future__ import annotations

# Steps are decoded by the event log's own decoder (dpengine.eventlog.reader.decode_step): one
# decoder for the log and the pipe, so a field a record gains crosses both.

# Environment variables the bootstrap reads (and removes, so the script's own children do not see them).
EVENTS_FD = "DPTUI_RUN_EVENTS_FD"
CONTROL_FD = "DPTUI_RUN_CONTROL_FD"
DEVICES = "DPTUI_RUN_DEVICES"
PARENT_PID = "DPTUI_RUN_PARENT_PID"  # dptui's pid: the parent the child checks it still has
LIFELINE_FD = "DPTUI_RUN_LIFELINE_FD"  # a pipe only dptui writes to (never does): EOF when it is gone
