"""The DDP backend (dpengine.distributed) against the threaded Trainer, on gloo CPU ranks.

Each DDP run starts real rank processes (about 2-5 s on two cores), so runs are shared
through module-scoped fixtures where the tests only read them.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from fixtures.ddp_workloads import SLOW_STEP_S
from fixtures.slow_device import SLOW_RANK_FORWARD_MS

from dpengine.distributed import DdpTrainer, WorkloadSpec
from dpengine.distributed.channel import is_comm_error
from dpengine.distributed.host_inbox import LIVENESS_S
from dpengine.distributed.torchrun import rank_device_kind, torchrun_env
from dpengine.eventlog.events import (
    ConfigChanged,
    RankJoined,
    RankStepFinished,
    RunFailed,
    RunFinished,
    StateChanged,
    StepFinished,
    StragglerFound,
)
from dpengine.eventlog.writer import JsonLinesWriter
from dpengine.run.options import RunOptions
from dpengine.run.trainer import Trainer
from dpengine.run.workloads import load_workload
from tui.headless import TextPrinter

FIXTURES = Path(__file__).parent / "fixtures"
DDP_WORKLOADS = FIXTURES / "ddp_workloads.py"
SEED = 7
TOLERANCE = 1e-5


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _ddp(model: str = "seed", devices=("cpu:0", "cpu:1"), *, available=None, step_timeout: float | None = None,
         liveness_timeout: float = LIVENESS_S, **options) -> DdpTrainer:
    """A DdpTrainer with RunOptions(**options), seeded with SEED and without telemetry unless told."""
    options.setdefault("seed", SEED)
    options.setdefault("telemetry_interval", None)
    return DdpTrainer(WorkloadSpec(model, seed=options["seed"]), list(devices), RunOptions(**options),
                      available=available, step_timeout=step_timeout, liveness_timeout=liveness_timeout)


def _threaded(devices, epochs: int, setup=None, **kwargs) -> tuple[RunFinished | RunFailed, list]:
    """The threaded backend on the same workload and seed; `setup(trainer)` may subscribe steering."""
    options = RunOptions(seed=SEED, epochs=epochs, telemetry_interval=None, **kwargs)
    trainer = Trainer(load_workload("seed", seed=SEED), list(devices), options)
    events: list = []
    trainer.subscribe(events.append)
    if setup is not None:
        setup(trainer)
    return trainer.run(), events


def _steps(events) -> list[StepFinished]:
    return [e for e in events if isinstance(e, StepFinished)]


def _chunks(events) -> list[tuple[tuple[str, int], ...]]:
    """Per step: (device, chunk rows) of each replica/rank that got a chunk, in order."""
    return [tuple((r.device, r.chunk_size) for r in e.record.replicas) for e in _steps(events)]


def _model_lines(events) -> list[tuple]:
    """What the headless printer's `In Model` lines show: device, input and output shapes."""
    return [tuple((r.device, r.input_shapes, r.output_shapes) for r in e.record.replicas) for e in _steps(events)]


# -- equal to the threaded backend --------------------------------------------------------------


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """One DDP run per world size, with its events, its headless JSON Lines and its checkpoint."""
    runs = {}
    for world in (2, 3):
        devices = [f"cpu:{i}" for i in range(world)]
        before = _children()
        checkpoint = tmp_path_factory.mktemp("ddp") / "final.pt"
        trainer = _ddp(devices=devices, epochs=2, telemetry_interval=0.2, checkpoint=checkpoint)
        events: list = []
        out = io.StringIO()
        trainer.subscribe(events.append)
        trainer.subscribe(JsonLinesWriter(out))
        result = trainer.run()
        runs[world] = dict(devices=devices, result=result, events=events, json=out.getvalue(),
                           left=_children() - before, checkpoint=checkpoint)
    return runs


@pytest.mark.parametrize("world", [2, 3])
def test_chunks_loss_and_weights_match_the_threaded_backend(ddp_runs, world, tmp_path):
    run = ddp_runs[world]
    assert isinstance(run["result"], RunFinished), run["result"]
    threaded_checkpoint = tmp_path / "threaded.pt"
    expected, threaded_events = _threaded(run["devices"], epochs=2, checkpoint=threaded_checkpoint)
    assert _chunks(run["events"]) == _chunks(threaded_events)
    assert _model_lines(run["events"]) == _model_lines(threaded_events)
    ddp_steps, dp_steps = _steps(run["events"]), _steps(threaded_events)
    assert [s.input_shape for s in ddp_steps] == [s.input_shape for s in dp_steps]
    assert [s.output_shape for s in ddp_steps] == [s.output_shape for s in dp_steps]
    for ours, theirs in zip(ddp_steps, dp_steps):
        assert ours.loss == pytest.approx(theirs.loss, abs=TOLERANCE)
    assert run["result"].final_loss == pytest.approx(expected.final_loss, abs=TOLERANCE)
    assert (run["result"].steps, run["result"].samples, run["result"].epochs) == (8, 200, 2)
    assert run["left"] == set()
    ours = torch.load(run["checkpoint"], weights_only=True)
    theirs = torch.load(threaded_checkpoint, weights_only=True)
    assert ours.keys() == theirs.keys()
    assert ours["model"].keys() == theirs["model"].keys()
    for name, weight in theirs["model"].items():
        torch.testing.assert_close(ours["model"][name], weight, atol=TOLERANCE, rtol=1e-5)
    assert (ours["epoch"], ours["position"], ours["step"], ours["seed"]) == (2, 0, 8, SEED)


def test_headless_json_has_per_rank_records(ddp_runs):
    run = ddp_runs[3]
    lines = [json.loads(line) for line in run["json"].splitlines()]
    started = lines[0]
    assert started["type"] == "run_started" and started["config"]["backend"] == "ddp"
    assert started["config"]["devices"] == ["cpu:0", "cpu:1", "cpu:2"]
    steps = [line for line in lines if line["type"] == "step"]
    assert len(steps) == 8
    for step in steps:
        replicas = step["replicas"]
        assert [r["device"] for r in replicas] == ["cpu:0", "cpu:1", "cpu:2"]
        assert [r["index"] for r in replicas] == [0, 1, 2]
        assert sum(r["chunk_size"] for r in replicas) == step["batch_size"]
        for replica in replicas:
            assert replica["forward_ms"] >= 0 and replica["backward_ms"] is not None
            assert replica["memory_bytes"] > 0
            assert replica["input_shapes"][0][0] == replica["chunk_size"]
        assert step["engine"]["batch_size"] == step["batch_size"]
    telemetry = [line for line in lines if line["type"] == "telemetry"]
    assert telemetry, "each rank samples itself on the first step"
    assert [s["device"] for s in telemetry[0]["samples"]] == ["cpu:0", "cpu:1", "cpu:2"]
    assert all(s["memory_used_bytes"] > 0 for s in telemetry[0]["samples"])
    assert lines[-1]["type"] == "run_finished"


# -- failures -------------------------------------------------------------------------------------


def test_a_rank_that_raises_fails_the_run_naming_it():
    before = _children()
    trainer = _ddp(f"{DDP_WORKLOADS}:raises_on_rank_2", devices=("cpu:0", "cpu:1", "cpu:2"), epochs=2)
    events: list = []
    trainer.subscribe(events.append)
    started = time.monotonic()
    result = trainer.run()
    assert time.monotonic() - started < 30
    assert isinstance(result, RunFailed)
    assert (result.replica, result.device, result.error_type) == (2, "cpu:2", "ValueError")
    assert result.error.startswith("rank 2 on cpu:2 failed: ValueError: boom on rank 2")
    assert "raise ValueError" in result.traceback  # the rank's own traceback
    assert events[-1] == result and not any(isinstance(e, RunFinished) for e in events)
    assert len(_steps(events)) == 1  # the second forward on rank 2 raised
    assert _children() - before == set()


def test_a_rank_that_dies_fails_the_run_naming_it():
    before = _children()
    trainer = _ddp(f"{DDP_WORKLOADS}:dies_on_rank_1", devices=("cpu:0", "cpu:1", "cpu:2"), epochs=1)
    result = trainer.run()
    assert isinstance(result, RunFailed)
    assert (result.replica, result.device) == (1, "cpu:1")
    assert result.error == "rank 1 on cpu:1 was killed by SIGKILL"
    assert _children() - before == set()


def test_a_rank_that_hangs_is_named_once_the_others_time_out():
    before = _children()
    trainer = _ddp(f"{DDP_WORKLOADS}:hangs_on_rank_1", devices=("cpu:0", "cpu:1", "cpu:2"), epochs=1, step_timeout=2)
    result = trainer.run()
    assert isinstance(result, RunFailed)
    assert (result.replica, result.device, result.error_type) == (1, "cpu:1", "RankTimeout")
    assert result.error.startswith("rank 1 on cpu:1 stopped responding: rank ")
    assert _children() - before == set()


# -- steering -------------------------------------------------------------------------------------


def _pause_then_grow(trainer, seen: list, numbers: dict | None = None) -> None:
    """Steer as a user would: pause after step 2, ask for batch 4 on three devices, resume.

    With batch 4 on three devices rank/replica 2 gets no chunk (torch.chunk cuts 4 into 2 + 2).
    `numbers` gets each request's number.
    """
    numbers = {} if numbers is None else numbers

    def steer(event) -> None:
        if isinstance(event, StepFinished) and event.step == 2:
            numbers["pause"] = trainer.pause()
        elif isinstance(event, StateChanged) and event.state == "paused":
            numbers["batch"] = trainer.set_batch_size(4)
            numbers["devices"] = trainer.set_devices(["cpu:0", "cpu:1", "cpu:2"])
            seen.append(trainer.has_pending_change)
            numbers["resume"] = trainer.resume()

    trainer.subscribe(steer)


def test_batch_and_device_changes_match_the_threaded_backend():
    trainer = _ddp(devices=("cpu:0", "cpu:1"), epochs=2)
    events: list = []
    pending_seen: list = []
    numbers: dict = {}
    trainer.subscribe(events.append)
    _pause_then_grow(trainer, pending_seen, numbers)
    before = _children()
    result = trainer.run()
    assert isinstance(result, RunFinished), result
    assert pending_seen == [True] and not trainer.has_pending_change
    assert trainer.devices == ("cpu:0", "cpu:1", "cpu:2") and trainer.batch_size == 4
    changes = [(c.batch_size, c.devices, c.step) for c in events if isinstance(c, ConfigChanged)]
    # Asked for while step 2 was published: applied at step 3, as the threaded Trainer does.
    assert changes == [(4, ("cpu:0", "cpu:1", "cpu:2"), 3)]
    # Each event carries the number of the request it answers; the restart's, the newer of two.
    assert [c.request for c in events if isinstance(c, ConfigChanged)] == [numbers["devices"]]
    states = [(e.state, e.request) for e in events if isinstance(e, StateChanged)]
    assert states == [("paused", numbers["pause"]), ("running", numbers["resume"])]
    assert _children() - before == set()

    expected, threaded_events = _threaded(("cpu:0", "cpu:1"), epochs=2,
                                          setup=lambda threaded: _pause_then_grow(threaded, []))
    threaded_changes = [(c.batch_size, c.devices, c.step) for c in threaded_events if isinstance(c, ConfigChanged)]
    assert threaded_changes == changes
    assert _chunks(events) == _chunks(threaded_events)
    assert {("cpu:2", 2), ("cpu:2", 0)}.isdisjoint({r for step in _chunks(events) for r in step})
    for ours, theirs in zip(_steps(events), _steps(threaded_events), strict=True):
        assert ours.loss == pytest.approx(theirs.loss, abs=TOLERANCE)
    assert result.final_loss == pytest.approx(expected.final_loss, abs=TOLERANCE)


def test_a_slow_subscriber_and_a_long_pause_outlast_the_timeout(tmp_path):
    """Longer than the collectives' timeout: rank 0's heartbeat keeps the ranks waiting, unharmed.

    Then a stop while paused ends the run at that boundary, and rank 0 saves the checkpoint.
    """
    checkpoint = tmp_path / "run.pt"
    trainer = _ddp(devices=("cpu:0", "cpu:1"), epochs=None, checkpoint=checkpoint, step_timeout=2)
    events: list = []
    trainer.subscribe(events.append)

    def stop_at_step_3(event):
        if isinstance(event, StepFinished) and event.step == 1:
            time.sleep(2.5)  # a subscriber that holds up the host (a blocked stdout, say)
        if isinstance(event, StepFinished) and event.step == 3:
            trainer.pause()
        elif isinstance(event, StateChanged) and event.state == "paused":
            threading.Timer(2.5, trainer.stop).start()

    trainer.subscribe(stop_at_step_3)
    result = trainer.run()
    assert isinstance(result, RunFinished) and result.stopped
    assert trainer.stopping
    assert [e.state for e in events if isinstance(e, StateChanged)] == ["paused"]
    assert result.steps == 3  # paused (then stopped) at the boundary after the step that asked
    state = torch.load(checkpoint, weights_only=True)
    assert state["step"] == 3 and state["seed"] == SEED
    assert set(state) >= {"model", "optimizer", "epoch", "position", "batch_size"}


def test_resumes_a_threaded_checkpoint_mid_epoch(tmp_path):
    checkpoint = tmp_path / "threaded.pt"

    def stop_after_step_2(threaded: Trainer) -> None:
        threaded.subscribe(lambda e: threaded.stop() if isinstance(e, StepFinished) and e.step == 2 else None)

    stopped, _ = _threaded(("cpu:0", "cpu:1"), epochs=2, setup=stop_after_step_2, checkpoint=checkpoint)
    assert stopped.stopped and stopped.steps == 2
    devices = ("cpu:0", "cpu:1", "cpu:2")
    expected, threaded_events = _threaded(devices, epochs=2, resume=checkpoint)
    trainer = _ddp(devices=devices, epochs=2, resume=checkpoint)
    events: list = []
    trainer.subscribe(events.append)
    result = trainer.run()
    assert isinstance(result, RunFinished), result
    assert [s.step for s in _steps(events)] == [s.step for s in _steps(threaded_events)] == list(range(3, 9))
    assert _chunks(events) == _chunks(threaded_events)
    assert result.final_loss == pytest.approx(expected.final_loss, abs=TOLERANCE)


def test_set_devices_checks_what_is_available():
    trainer = _ddp(devices=("cpu:0", "cpu:1"), available=["cpu:0", "cpu:1", "cpu:2"])
    with pytest.raises(ValueError, match="cpu:5 is not available"):
        trainer.set_devices(["cpu:0", "cpu:5"])
    with pytest.raises(ValueError):
        trainer.set_batch_size(0)
    config = trainer.config()
    assert config.backend == "ddp" and config.devices == ("cpu:0", "cpu:1")
    assert config.available_devices == ("cpu:0", "cpu:1", "cpu:2")
    with pytest.raises(TypeError, match="WorkloadSpec"):
        DdpTrainer(load_workload("seed"), ["cpu:0"])


def test_comm_errors_are_told_apart_from_the_rank_own_errors():
    assert is_comm_error(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]"))
    assert not is_comm_error(ValueError("boom"))
    assert not is_comm_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def test_torchrun_env_is_read_only_from_a_complete_environment(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "DPTUI_DDP_FD"):
        monkeypatch.delenv(key, raising=False)
    assert torchrun_env() is None
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("LOCAL_RANK", "1")
    env = torchrun_env()
    assert (env.rank, env.world_size, env.local_rank, env.master_port) == (3, 4, 1, 29500)


# -- torchrun ---------------------------------------------------------------------------------------


# The CPU case on any machine: ranks on a GPU machine would take cuda:LOCAL_RANK (see the cuda tests).
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}


def _torchrun_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **extra}


def test_under_torchrun_rank_0_runs_the_host_and_others_follow(tmp_path):
    out = tmp_path / "events.jsonl"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                "--max-restarts=0", str(FIXTURES / "ddp_torchrun_main.py"), str(out)]
    done = subprocess.run(torchrun, capture_output=True, text=True, timeout=90, env=_torchrun_env(**CPU_ONLY))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    finished = [line for line in lines if line["type"] == "run_finished"]
    assert len(finished) == 2  # rank 0 ran twice; the other rank followed both runs
    steps = [line for line in lines if line["type"] == "step"]
    assert all([r["device"] for r in s["replicas"]] == ["cpu:0", "cpu:1"] for s in steps)
    # the fixture script's seed
    expected = Trainer(load_workload("seed", seed=5), ["cpu:0", "cpu:1"],
                       RunOptions(seed=5, epochs=1, telemetry_interval=None)).run()
    assert finished[0]["final_loss"] == pytest.approx(expected.final_loss, abs=TOLERANCE)
    assert finished[1]["final_loss"] == pytest.approx(expected.final_loss, abs=TOLERANCE)


def test_the_readmes_torchrun_command_runs_dptui_on_rank_0():
    # torchrun --standalone --nproc-per-node=2 -m tui.torchrun --headless --seed 1, made short.
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                "--max-restarts=0", "-m", "tui.torchrun", "--headless", "--seed", "5", "--every", "0",
                "--no-telemetry"]
    done = subprocess.run(torchrun, capture_output=True, text=True, timeout=90, env=_torchrun_env(**CPU_ONLY))
    assert done.returncode == 0, done.stderr[-3000:]
    expected = Trainer(load_workload("seed", seed=5), ["cpu:0", "cpu:1"],
                       RunOptions(seed=5, epochs=1, telemetry_interval=None)).run()
    lines = done.stdout.splitlines()
    assert f"final loss {expected.final_loss:.6f}" in lines
    assert lines[-1] == "straggler verdicts: none"  # the end: a row per rank, then the verdicts


def _pretend_gpus(monkeypatch, count: int, local_world: int = 2) -> None:
    """torch seeing `count` GPUs and torchrun starting `local_world` ranks on this machine."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    for key, value in {"RANK": "0", "WORLD_SIZE": str(local_world), "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": str(local_world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("DPTUI_DDP_FD", raising=False)


def test_torchrun_with_fewer_gpus_than_ranks_is_refused_or_runs_on_the_cpu_when_asked(monkeypatch):
    _pretend_gpus(monkeypatch, count=1, local_world=2)
    env = torchrun_env()
    with pytest.raises(ValueError) as refused:
        rank_device_kind(env, ["cuda:0"])
    assert str(refused.value) == (
        "torchrun starts 2 ranks on this machine, which has 1 GPU: give --nproc-per-node=1 or fewer, "
        "or --devices cpu for ranks on the CPU (gloo)"
    )
    assert rank_device_kind(env, ["cpu:0"]) == "cpu"  # asked for: gloo on the CPU
    _pretend_gpus(monkeypatch, count=2, local_world=2)
    assert rank_device_kind(torchrun_env(), ["cuda:0", "cuda:1"]) == "cuda"
    _pretend_gpus(monkeypatch, count=0, local_world=2)
    assert rank_device_kind(torchrun_env(), None) == "cpu"


def test_dptui_under_torchrun_with_too_few_gpus_says_so_in_one_line(monkeypatch, capsys):
    from tui.cli import main

    _pretend_gpus(monkeypatch, count=1, local_world=2)
    assert main(["--backend", "ddp", "--headless", "--no-telemetry"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "torchrun starts 2 ranks on this machine, which has 1 GPU" in err


def test_a_rank_on_a_machine_without_its_gpu_names_the_limit(monkeypatch):
    """A machine other than rank 0's, with fewer GPUs than torchrun starts ranks on it."""
    from types import SimpleNamespace

    from dpengine.distributed.rank_loop import _own_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    config = SimpleNamespace(backend="nccl", devices=("cuda:0", "cuda:1", "cuda:2", "cuda:3"), torchrun=True)
    assert _own_device(config, 2, 0) == torch.device("cuda", 0)
    with pytest.raises(RuntimeError, match=r"local rank 1 needs cuda:1, but its machine has 1 GPU: give "
                                           r"torchrun --nproc-per-node=1 or fewer there"):
        _own_device(config, 3, 1)


def test_tui_torchrun_outside_torchrun_says_how_to_start_it():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-m", "tui.torchrun", "--headless"], capture_output=True,
                          text=True, timeout=60, env={**env, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and "torchrun" in done.stderr


# -- CUDA -----------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_torchrun_with_more_ranks_than_gpus_is_refused_and_runs_on_the_cpu_when_asked():
    ranks = torch.cuda.device_count() + 1
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                "--max-restarts=0", "-m", "tui.torchrun", "--headless", "--seed", "5", "--every", "0",
                "--no-telemetry"]
    refused = subprocess.run(torchrun, capture_output=True, text=True, timeout=120, env=_torchrun_env())
    assert refused.returncode != 0
    assert f"torchrun starts {ranks} ranks on this machine, which has {ranks - 1} GPU" in refused.stderr
    assert "invalid device ordinal" not in refused.stderr
    on_cpu = subprocess.run([*torchrun, "--devices", "cpu"], capture_output=True, text=True, timeout=120,
                            env=_torchrun_env())
    assert on_cpu.returncode == 0, on_cpu.stderr[-3000:]
    assert "final loss" in on_cpu.stdout.splitlines()[-1]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (nccl)")
def test_nccl_ranks_match_the_threaded_backend():
    count = min(torch.cuda.device_count(), 2)
    devices = [f"cuda:{i}" for i in range(count)]
    before = _children()
    trainer = _ddp(devices=devices, epochs=2)
    events: list = []
    trainer.subscribe(events.append)
    result = trainer.run()
    assert isinstance(result, RunFinished), result
    expected, threaded_events = _threaded(devices, epochs=2)
    assert _chunks(events) == _chunks(threaded_events)
    assert result.final_loss == pytest.approx(expected.final_loss, abs=1e-4)
    assert _children() - before == set()


# -- liveness: a slow rank is not a dead one (issue 11) -------------------------------------------


def test_no_step_timeout_by_default():
    assert _ddp().timeout is None


def test_a_step_longer_than_the_liveness_limit_is_not_a_dead_rank():
    # Rank 1's second step sleeps twice the liveness limit: its heartbeat thread keeps it alive,
    # and no step timeout cuts the waiting ranks off.
    trainer = _ddp(f"{DDP_WORKLOADS}:slow_step_on_rank_1", epochs=1, liveness_timeout=SLOW_STEP_S / 2)
    result = trainer.run()
    assert isinstance(result, RunFinished), result
    assert result.steps == 4


def test_a_frozen_rank_is_caught_by_its_missing_heartbeat():
    before = _children()
    trainer = _ddp(epochs=None, liveness_timeout=5.0)  # beats come each second, even on a busy machine
    frozen: list[int] = []

    def freeze_rank_1(event):
        if isinstance(event, StepFinished) and event.step == 1 and not frozen:  # soon after the start
            frozen.append(trainer.rank_pids()["cpu:1"])
            os.kill(frozen[0], signal.SIGSTOP)  # alive but silent: no exit for the host to see

    trainer.subscribe(freeze_rank_1)
    result = trainer.run()
    assert frozen
    assert isinstance(result, RunFailed)
    assert (result.replica, result.device) == (1, "cpu:1")
    assert result.error.startswith("rank 1 on cpu:1 stopped responding: no heartbeat")
    assert _children() - before == set()


def test_a_non_finite_loss_fails_the_ddp_run_naming_the_step():
    result = _ddp(f"{DDP_WORKLOADS}:nan_on_rank_1", epochs=2).run()
    assert isinstance(result, RunFailed)
    assert result.error_type == "NonFiniteLoss"
    assert "the loss is nan at step 3" in result.error


# -- per-rank phases and the straggler verdict ------------------------------------------------


def test_every_rank_steps_phases_and_a_rank_slow_in_forward_is_named():
    # 600 rows / 60 a batch * 3 epochs = 30 steps: 2 of warm-up, then the verdict's 20.
    trainer = _ddp(f"{FIXTURES / 'slow_device.py'}:slow_rank_1_workload", epochs=3)
    events: list = []
    trainer.subscribe(events.append)
    headless = io.StringIO()
    trainer.subscribe(TextPrinter(headless))
    assert isinstance(trainer.run(), RunFinished)

    joined = [e for e in events if isinstance(e, RankJoined)]
    assert sorted(e.rank for e in joined) == [0, 1]
    assert all(e.world_size == 2 and e.device == "cpu" and e.pid != os.getpid() for e in joined)
    assert joined[0].pid != joined[1].pid

    steps = [e for e in events if isinstance(e, RankStepFinished)]
    for rank in (0, 1):
        assert [s.step for s in steps if s.rank == rank] == list(range(30))
    for s in steps:
        phases = s.data_ms + s.forward_ms + s.backward_ms + s.comm_wait_ms + s.optimizer_ms + s.other_ms
        assert phases == pytest.approx(s.total_ms, abs=1e-3)
        assert s.samples == 30 and s.micro_batches == 1 and s.loss is not None
    # Each rank's steps come before the StepFinished of the same step.
    kinds = [type(e) for e in events if isinstance(e, (RankStepFinished, StepFinished))]
    assert kinds[:3] == [RankStepFinished, RankStepFinished, StepFinished]

    def mean(rank, phase):
        values = [getattr(s, f"{phase}_ms") for s in steps if s.rank == rank and s.step >= 2]
        return sum(values) / len(values)

    assert mean(1, "forward") - mean(0, "forward") > SLOW_RANK_FORWARD_MS * 0.8
    assert mean(0, "comm_wait") > SLOW_RANK_FORWARD_MS * 0.5  # rank 0 waits for rank 1 in the all-reduce

    verdicts = [e for e in events if isinstance(e, StragglerFound)]
    assert verdicts, "no straggler verdict"
    assert (verdicts[0].rank, verdicts[0].phase) == (1, "forward")
    printed = headless.getvalue()
    assert f"step {verdicts[0].step}: rank 1 is the straggler: forward +" in printed
    # The end: a row per rank with its steps, and the verdicts seen again.
    table = printed[printed.index("rank  host"):].splitlines()
    assert [row.split()[0] for row in table[1:3]] == ["0", "1"]
    assert all(int(row.split()[4]) == sum(1 for e in steps if e.rank == int(row.split()[0])) for row in table[1:3])
    assert "straggler verdicts:" in table and any("rank 1 is the straggler: forward" in row for row in table)


def test_balanced_ranks_get_no_verdict_and_the_hosts_time_is_no_phase():
    trainer = _ddp(f"{FIXTURES / 'slow_device.py'}:balanced_two_ranks_workload", epochs=3)
    events: list = []
    trainer.subscribe(events.append)
    host_ms = 50.0

    def slow_subscriber(event):
        if isinstance(event, StepFinished):
            time.sleep(host_ms / 1000)  # every rank waits for the host at the next boundary

    trainer.subscribe(slow_subscriber)
    assert isinstance(trainer.run(), RunFinished)
    steps = [e for e in events if isinstance(e, RankStepFinished)]
    assert len(steps) == 60  # long enough for a verdict
    assert [e for e in events if isinstance(e, StragglerFound)] == []
    # The boundary's wait for the host is between steps: not the ranks' data (input) time.
    assert max(s.data_ms for s in steps) < host_ms / 2
