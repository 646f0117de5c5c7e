"""model.eval() / model.train() on the model a DDP rank trains (dpengine/script/eval_mode.py, through
ddp_swap.py): which calls tell the phase clock an evaluation begins or ends. In a fresh process:
nn.Module.train is wrapped process-wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, os, threading
    import torch, torch.distributed as dist
    from torch import nn
    from dpengine.script import ddp_swap

    class Steps:  # what eval_mode tells the rank's clock
        training_thread = threading.get_ident()
        said = []
        def on_training_thread(self): return threading.get_ident() == self.training_thread
        def eval_begins(self): self.said.append("begins")
        def eval_ends(self): self.said.append("ends")

    class Wrapper(nn.Module):  # Lightning's: the LightningModule inside the module DDP wraps
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
    dist.init_process_group("gloo", rank=0, world_size=1)
    steps = Steps()
    ddp_swap.install(lambda clock: steps, print)
    ddp_swap.install(lambda clock: steps, print)  # a second install wraps nothing twice
    inner = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    inner.eval()  # before any DDP: nothing to tell
    ddp = nn.parallel.DistributedDataParallel(Wrapper(inner))  # dptui's, which the clock watches
    said = {}

    def say(name, call):
        steps.said.clear()
        call()
        said[name] = list(steps.said)

    say("ddp.eval", ddp.eval)
    say("ddp.train", ddp.train)
    say("module.eval", ddp.module.eval)
    say("inner.eval", inner.eval)
    say("inner.train(True)", lambda: inner.train(True))
    say("first layer.eval", inner[0].eval)
    say("batchnorm.eval", inner[1].eval)
    say("another model.eval", nn.Linear(4, 2).eval)

    def on_another_thread():
        thread = threading.Thread(target=inner.eval)
        thread.start()
        thread.join()

    say("another thread", on_another_thread)
    print(json.dumps({"said": said, "modes": [inner.training, inner[1].training]}))
    dist.destroy_process_group()
""")


def test_eval_and_train_on_the_trained_model_are_told_once_and_no_others():
    from test_ddp_run import free_port_pair

    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PORT": str(free_port_pair())})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["said"] == {
        "ddp.eval": ["begins"], "ddp.train": ["ends"], "module.eval": ["begins"], "inner.eval": ["begins"],
        "inner.train(True)": ["ends"], "first layer.eval": [], "batchnorm.eval": [], "another model.eval": [],
        "another thread": [],
    }
    assert result["modes"] == [False, False]  # torch's train() still set every module's mode
