"""`dptui run` on real DataParallel code: every way a script reaches DataParallel is recorded.

Real child processes running the reproductions of public code in tests/fixtures/scripts/real
(see its README): the submodule import, the functional form, subclasses that override forward()
and call torch's pieces themselves, two models in one loop. Each test checks what the script
itself printed (it knows nothing of dptui) and what dptui recorded.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import torch
from waiting import holds_for, wait_for

from dpengine.eventlog.events import ConfigChanged, StateChanged, StepFinished
from tui.script.script_run import ScriptRun
from tui.script.target import ScriptTarget

SCRIPTS = Path(__file__).parent / "fixtures" / "scripts"
REAL = SCRIPTS / "real"
THREE = "cpu:0,cpu:1,cpu:2"


def dptui_json(script: str, *args: str, cwd: Path | None = None, log: Path | None = None) -> tuple[list[dict], str]:
    """`dptui run --headless --json` on three virtual devices: its events, and the script's stdout."""
    logging = ["--log", str(log)] if log else []
    done = subprocess.run(
        [sys.executable, "-m", "tui.cli", "run", "--headless", "--json", "--no-telemetry", "--devices", THREE,
         *logging, str(REAL / script), *args],
        capture_output=True, text=True, timeout=180, cwd=cwd,
    )
    events = [json.loads(line) for line in done.stdout.splitlines()]
    stdout = "\n".join(e["line"] for e in events if e["type"] == "output" and e["stream"] == "stdout")
    exited = [e for e in events if e["type"] == "script_exited"]
    assert exited and exited[0]["code"] == 0, (done.stderr, [e["line"] for e in events if e["type"] == "output"])
    return events, stdout


def steps_of(events: list[dict], instance: str | None = None) -> list[dict]:
    return [e for e in events if e["type"] == "step" and (instance is None or e["instance"] == instance)]


def chunks(step: dict) -> list[tuple[str, int]]:
    return [(r["device"], r["chunk_size"]) for r in step["replicas"]]


def instances(events: list[dict]) -> list[str]:
    return [e["instance"] for e in events if e["type"] == "dataparallel"]


def test_transformer_xls_balanced_data_parallel_is_recorded_as_it_split():
    # A forward() of its own over torch's Scatter.apply (which raised on virtual devices, and
    # the script's bare except quit() with status 0 and no step) and torch's parallel_apply.
    events, stdout = dptui_json("transformer_xl_train.py", "--multi_gpu", "--gpu0_bsz", "2")
    (balanced,) = instances(events)
    assert balanced.startswith("BalancedDataParallel(MemLM, ") and balanced.endswith("@transformer_xl_train.py:125")
    steps = steps_of(events, balanced)
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]  # 4 training steps and the gradient check's
    assert all(chunks(s) == [("cpu:0", 2), ("cpu:1", 6), ("cpu:2", 6)] for s in steps)
    assert all(s["batch_size"] == 14 and s["engine"]["dim"] == 1 for s in steps)
    assert all(r["forward_ms"] > 0 and r["backward_ms"] is not None for s in steps for r in s["replicas"])
    assert stdout.splitlines()[-1] == "grads match the plain module: True"


def test_pytorch_encodings_model_and_criterion_from_the_submodule_are_both_recorded():
    # Both subclass the DataParallel of `torch.nn.parallel.data_parallel`, which stayed torch's:
    # the script ran unsplit. The criterion's forward runs its replicas in threads of its own
    # and sums them with torch.cuda.comm.reduce_add (and Broadcast backward).
    events, stdout = dptui_json("encoding_train.py")
    model, criterion = instances(events)
    assert model.startswith("DataParallelModel(TinySegNet, ") and criterion.startswith("DataParallelCriterion(")
    for instance in (model, criterion):
        steps = steps_of(events, instance)
        assert [chunks(s) for s in steps] == [[("cpu:0", 2), ("cpu:1", 2), ("cpu:2", 2)]] * 3
    assert all(r["backward_ms"] is not None for s in steps_of(events, model) for r in s["replicas"])
    assert stdout.startswith("epoch 0: train loss 1.72")


def test_synchronized_batchnorms_callback_classes_from_the_submodule_are_dptuis():
    events, stdout = dptui_json("sync_batchnorm_train.py")
    with_callback, patched = instances(events)
    assert with_callback.startswith("DataParallelWithCallback(") and patched.startswith("DataParallel(")
    for instance in (with_callback, patched):  # 3 training steps each (the check's forward has no backward)
        trained = [s for s in steps_of(events, instance) if s["engine"]["backward_ms"] is not None]
        assert [chunks(s) for s in trained] == [[("cpu:0", 4), ("cpu:1", 4), ("cpu:2", 4)]] * 3
    checks = [line for line in stdout.splitlines() if "copies called back" in line]
    assert checks == [f"{name}: output matches whole-batch BatchNorm: True; copies called back: [0, 1, 2]"
                      for name in ("DataParallelWithCallback", "patch_replication_callback")]


def test_the_functional_data_parallel_is_recorded_like_the_class():
    # dcgan's `nn.parallel.data_parallel(self.main, input, None)` in each model's forward
    # (torch's raised "device type could not be determined" without GPUs).
    events, stdout = dptui_json("dcgan_functional_unguarded.py")
    labels = instances(events)
    assert len(labels) == 2 and all(label.startswith("data_parallel(Sequential, ") for label in labels)
    per_instance = sorted(len(steps_of(events, label)) for label in labels)
    assert per_instance == [2, 6]  # per iteration: the generator once, the discriminator three times
    assert all(chunks(s) == [("cpu:0", 3), ("cpu:1", 3), ("cpu:2", 2)] for s in steps_of(events))
    assert "[0/1][1/2] Loss_D:" in stdout


def test_gpu_ids_without_gpus_run_on_the_virtual_devices_of_their_numbers_and_dptui_says_so(tmp_path):
    # dcgan today: `nn.parallel.data_parallel(self.main, input, range(self.ngpu))` (dpengine refused
    # GPU 0 with a ValueError traceback; torch's own raises "device type could not be determined").
    # Two devices asked on the command line; the script's own ids win, as explicit ids do.
    done = subprocess.run(
        [sys.executable, "-m", "tui.cli", "run", "--headless", "--json", "--no-telemetry", "--devices",
         "cpu:0,cpu:1", str(REAL / "dcgan_ngpu.py"), "--outf", str(tmp_path)],
        capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stderr
    events = [json.loads(line) for line in done.stdout.splitlines()]
    assert all(chunks(s) == [("cpu:0", 3), ("cpu:1", 3), ("cpu:2", 2)] for s in steps_of(events))
    assert sorted(len(steps_of(events, label)) for label in instances(events)) == [2, 6]
    assert [e["text"] for e in events if e["type"] == "notice"] == [
        "the script asks DataParallel for GPU 0, 1, 2 and this machine has none: dptui ran them on "
        "virtual devices cpu:0, cpu:1, cpu:2"]
    assert set(torch.load(tmp_path / "netD_epoch_0.pth", weights_only=True)) >= {"main.0.weight"}


def test_every_step_of_every_instance_reaches_json_and_the_log(tmp_path):
    log = tmp_path / "run.jsonl"
    events, _stdout = dptui_json("gan_two_dataparallel.py", log=log)
    generator, discriminator = instances(events)
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    for stream in (events, logged):
        assert [len(steps_of(stream, i)) for i in (generator, discriminator)] == [3, 9]
        assert [s["step"] for s in steps_of(stream, discriminator)] == list(range(1, 10))
    # The panels follow the instance that stepped first; the other's steps are in the record all the same.
    assert [e["config"]["workload"] for e in logged if e["type"] == "run_started"] == [discriminator]


def test_pause_and_device_changes_reach_a_forward_of_its_own():
    run = ScriptRun(ScriptTarget(str(SCRIPTS / "balanced_endless.py")), ("cpu:0", "cpu:1", "cpu:2"),
                    telemetry_interval=None, grace_s=30)
    seen: list = []
    run.subscribe(seen.append)
    thread = threading.Thread(target=run.run)
    thread.start()

    def steps() -> list[StepFinished]:
        return [e for e in list(seen) if isinstance(e, StepFinished)]

    try:
        wait_for(lambda: len(steps()) >= 3, "steps of BalancedDataParallel")
        assert steps()[0].record.chunk_sizes == (2, 6, 6)
        paused = run.pause()
        wait_for(lambda: any(isinstance(e, StateChanged) and e.request == paused for e in list(seen)), "paused")
        count = len(steps())
        holds_for(lambda: len(steps()) == count, 1.0, "no step while paused")
        run.resume()
        request = run.set_devices(["cpu:0", "cpu:1"])
        wait_for(lambda: any(isinstance(e, ConfigChanged) and e.request == request for e in list(seen)),
                 "the change of devices")
        wait_for(lambda: steps()[-1].record.devices == ("cpu:0", "cpu:1"), "a step on two devices")
        assert steps()[-1].record.chunk_sizes == (2, 12)  # its own split, over the devices it now has
    finally:
        run.stop()
        run.wait(30)
        run.kill()
        thread.join(30)


def test_a_deepcopy_of_a_dataparallel_is_an_instance_of_its_own():
    # timm's ModelEmaV3 deep-copies the wrapped model (after the DataParallel, as timm says) and
    # validates the copy under no_grad: its steps are the copy's, not posted under the model's.
    events, stdout = dptui_json("timm_train_ema.py")
    model, ema = instances(events)
    assert model.startswith("DataParallel(Sequential, ") and model.endswith("@timm_train_ema.py:65")
    assert ema == f"copy of {model}"
    assert [e["copy_of"] for e in events if e["type"] == "dataparallel"] == [None, model]
    four = [("cpu:0", 4), ("cpu:1", 4), ("cpu:2", 4)]
    trained = [s for s in steps_of(events, model) if s["engine"]["backward_ms"] is not None]
    assert [chunks(s) for s in trained] == [four] * 6  # 2 epochs of 3 batches
    assert [chunks(s) for s in steps_of(events, ema)] == [four] * 2  # its validation, once an epoch
    assert "Test (EMA): Loss:" in stdout
