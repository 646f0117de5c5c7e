"""What crosses the side channel between the ranks of a user's DDP script and dptui.

`dptui run --nproc-per-node N SCRIPT.py` starts `python -m torch.distributed.run ... -m
dpengine.script.rank_bootstrap SCRIPT.py ARGS`. torchrun starts each rank in a session of its own
with close_fds, so no pipe is inherited: each rank connects back over TCP to the dptui of its node,
whose address and token it finds in its environment (torchrun passes the environment on). One
JSON object per line, UTF-8, both ways. Receivers ignore fields and types they do not know.

Rank -> dptui:
  {"type": "hello", "token": T, "rank", "local_rank", "world_size", "node_rank", "host", "pid",
   "device": "cpu" | "cuda:N", "restart": TORCHELASTIC_RESTART_COUNT}
      first line; dptui closes the connection on a wrong token
  {"type": "rank_step", ...}   every optimizer step: the fields of events.RankStepFinished
  {"type": "dropped", "rank", "steps": N}   N steps not sent (dptui that far behind); never stalls
  {"type": "notice", "rank", "text"}   something left unrecorded, said once
  {"type": "state", "rank", "state": "paused" | "running", "step": N}   answers pause / resume
  {"type": "state", "rank", "state": "late", "step": N, "asked": M}   the pause before step M came
      once step N >= M had begun: dptui asks every rank again, further ahead
  {"type": "script_finished", "rank", "exit_code"}   the script's last line ran (or SystemExit)
  {"type": "rank_failed", "rank", "host", "error": ONE_LINE, "traceback": TEXT}   the script raised
dptui -> rank:
  {"op": "pause", "step": N}   block before step N begins (at its first forward) until resume;
      dptui picks one N for every rank, so the ranks stay in lockstep; a later pause moves N on
      (a rank blocked before the old N goes on)
  {"op": "resume"}
  EOF: dptui is gone; the rank trains on unrecorded (the parent-death signal ends it with torchrun)

Optional (receivers that do not know them ignore them):
  {"type": "process_group", "rank", "backend", "timeout_s"}   once init_process_group ran: the
      collective timeout the script chose (else dptui says torch's default for the backend when paused)

Several nodes: each node's dptui takes its own ranks; a node other than 0 connects to node 0's dptui
with {"type": "node_hello", "token": T, "node_rank", "host"} and forwards its ranks' lines as they are
(without their token; and its telemetry as {"type": "telemetry", "node_rank", ...}); node 0 relays
control lines back. Node 0's dptui listens on the rendezvous host (--rdzv-endpoint, else
--master-addr) at its port + 1; T is derived from the flags every node was given
(tui/script/node_link.py). A node also sends each of its ranks' end as the event dptui logs,
{"type": "rank_ended", ...} (events.RankEnded), since only its own torchrun knows a signal's status.
"""

from __future__ import annotations

CHANNEL = "DPTUI_RANK_CHANNEL"  # "host:port" of this node's dptui
TOKEN = "DPTUI_RANK_TOKEN"  # proves a connection is one of this run's ranks
BOOTSTRAP_MODULE = "dpengine.script.rank_bootstrap"
