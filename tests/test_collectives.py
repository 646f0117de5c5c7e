"""The script's own torch.distributed collectives in a rank (dpengine/script/collectives.py): which
calls are timed as comm_wait. In a fresh process: the wrappers replace torch's names process-wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import inspect, json, os, threading
    import torch, torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from dpengine.script import collectives
    from dpengine.script.step_phases import HostClock, RankSteps

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
    dist.init_process_group("gloo", rank=0, world_size=1)
    sent = []
    steps = RankSteps(0, HostClock(), sent.append)
    collectives.install(lambda: steps)
    collectives.install(lambda: None)  # a second install wraps nothing twice
    t = torch.ones(1)
    dist.all_reduce(t)  # before the first step: no step's
    steps.forward_begins(8, synced=True)
    steps.forward_ends()
    timed = {}

    def count(name, call):
        before = len(steps._step.collectives)
        call()
        timed[name] = len(steps._step.collectives) - before

    count("all_reduce", lambda: dist.all_reduce(t))
    count("c10d.broadcast", lambda: c10d.broadcast(t, src=0))
    count("positional async_op", lambda: dist.all_reduce(t, dist.ReduceOp.SUM, None, True).wait())
    count("async_op", lambda: dist.broadcast(t, src=0, async_op=True).wait())
    count("broadcast_object_list", lambda: dist.broadcast_object_list([{"a": 1}], src=0))
    count("barrier", lambda: dist.barrier())

    def on_another_thread():
        thread = threading.Thread(target=dist.all_reduce, args=(t,))
        thread.start()
        thread.join()

    count("another thread", on_another_thread)
    print(json.dumps({"timed": timed, "same_name": dist.all_reduce is c10d.all_reduce,
                      "signature": str(inspect.signature(dist.all_reduce))}))
    dist.destroy_process_group()
""")


def test_blocking_collectives_on_the_training_thread_are_timed_once_and_no_others():
    from test_ddp_run import free_port_pair

    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PORT": str(free_port_pair())})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["timed"] == {"all_reduce": 1, "c10d.broadcast": 1, "positional async_op": 0, "async_op": 0,
                               "broadcast_object_list": 1, "barrier": 1, "another thread": 0}
    assert result["same_name"]  # torch.distributed's name and distributed_c10d's are one function still
    assert "async_op" in result["signature"]  # frameworks that read the signature see torch's
