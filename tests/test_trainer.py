"""Trainer: the step loop, steering from other threads at step boundaries, events, checkpoints.

Every run is checked against a plain single-process loop (tests/reference_loop.py) on
the same seed and batch order, so "the weights carry over" means: equal to what one process
training the same batches would have, to float tolerance.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from reference_loop import chunk_sizes, clone_state, reference_run
from waiting import holds_for

from dpengine.eventlog.events import (
    ConfigChanged,
    EpochFinished,
    Event,
    RunFailed,
    RunFinished,
    RunStarted,
    StateChanged,
    StepFinished,
    TelemetrySampled,
)
from dpengine.run.options import RunOptions
from dpengine.run.trainer import Trainer
from dpengine.run.workloads import Workload, builtin_workload, load_workload
from dpengine.telemetry import open_telemetry

FIXTURES = Path(__file__).parent / "fixtures" / "dptui_test_workloads.py"
THREE = ["cpu:0", "cpu:1", "cpu:2"]
WAIT = 10.0  # seconds: generous bound for anything that should take milliseconds


class Recorder:
    """Subscriber keeping every event; `when(kind, predicate)` waits for a matching one."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._cond = threading.Condition()

    def __call__(self, event: Event) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    def of(self, kind: type) -> list:
        with self._cond:
            return [e for e in self.events if isinstance(e, kind)]

    def wait_for(self, kind: type, predicate: Callable[[object], bool] = lambda e: True) -> object:
        with self._cond:
            ok = self._cond.wait_for(
                lambda: any(isinstance(e, kind) and predicate(e) for e in self.events), timeout=WAIT
            )
            assert ok, f"no {kind.__name__} event within {WAIT} s; got {[type(e).__name__ for e in self.events]}"
            return next(e for e in self.events if isinstance(e, kind) and predicate(e))

    @property
    def steps(self) -> list[StepFinished]:
        return self.of(StepFinished)


def seed_trainer(devices, seed: int = 0, *, workload: Workload | None = None, telemetry=None, available=None,
                 **options) -> Trainer:
    """A Trainer with RunOptions(seed=seed, **options), without telemetry unless told."""
    options.setdefault("telemetry_interval", None)
    return Trainer(workload or builtin_workload("seed", seed), devices, RunOptions(seed=seed, **options),
                   telemetry=telemetry, available=available)


def assert_states_close(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], msg=f"parameter {name} differs")


def run_in_thread(trainer: Trainer) -> tuple[threading.Thread, dict]:
    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", trainer.run()), daemon=True)
    thread.start()
    return thread, box


def momentum_workload(seed: int) -> Workload:
    """The seed workload with SGD + momentum: optimizer state that a checkpoint must carry."""
    return dataclasses.replace(
        builtin_workload("seed", seed),
        optimizer_factory=lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
    )


# ------------------------------------------------------------------ a plain run


def test_run_publishes_config_steps_epochs_and_matches_the_reference_loop() -> None:
    trainer = seed_trainer(THREE, seed=4, epochs=2)
    rec = Recorder()
    trainer.subscribe(rec)

    result = trainer.run()
    ref = reference_run(builtin_workload("seed", 4), seed=4, epochs=2)

    assert isinstance(result, RunFinished) and not result.stopped
    started = rec.events[0]
    assert isinstance(started, RunStarted)
    config = started.config
    assert config.devices == tuple(THREE)
    assert set(THREE) <= set(config.available_devices)
    assert (config.workload, config.batch_size, config.epochs, config.seed, config.samples) == ("seed", 30, 2, 4, 100)
    assert config.lr == pytest.approx(0.05)
    assert rec.events[-1] is result

    steps = rec.steps
    assert [s.step for s in steps] == list(range(1, 9))
    assert [s.epoch for s in steps] == [1] * 4 + [2] * 4
    assert [s.step_in_epoch for s in steps] == [1, 2, 3, 4] * 2
    assert all(s.steps_in_epoch == 4 for s in steps)
    assert [s.batch_size for s in steps] == ref.rows == [30, 30, 30, 10] * 2
    assert [list(s.record.chunk_sizes) for s in steps] == [chunk_sizes(r, 3) for r in ref.rows]
    assert [s.record.devices for s in steps] == [tuple(THREE)] * 8
    assert [s.input_shape for s in steps] == [(r, 5) for r in ref.rows]
    assert [s.output_shape for s in steps] == [(r, 2) for r in ref.rows]
    assert all(s.samples_per_s > 0 for s in steps)
    for step, expected in zip(steps, ref.losses):
        assert step.loss == pytest.approx(expected, rel=1e-5)

    epochs = rec.of(EpochFinished)
    assert [(e.epoch, e.steps, e.samples) for e in epochs] == [(1, 4, 100), (2, 4, 100)]
    for epoch, expected in zip(epochs, ref.epoch_losses):
        assert epoch.mean_loss == pytest.approx(expected, rel=1e-5)
        assert epoch.samples_per_s > 0
    # An epoch's summary comes right after its last step.
    assert rec.events.index(epochs[0]) == rec.events.index(steps[3]) + 1

    assert (result.epochs, result.steps, result.samples) == (2, 8, 200)
    assert result.final_loss == pytest.approx(ref.epoch_losses[-1], rel=1e-5)
    assert_states_close(clone_state(trainer.workload.model), ref.final_state)


def test_same_seed_same_run_and_another_seed_another_loss() -> None:
    def once(seed: int) -> tuple[float, list, list, dict]:
        trainer = seed_trainer(THREE, seed=seed, epochs=2)
        rec = Recorder()
        trainer.subscribe(rec)
        result = trainer.run()
        steps = rec.steps
        return (
            result.final_loss,
            [s.record.chunk_sizes for s in steps],
            [s.loss for s in steps],
            clone_state(trainer.workload.model),
        )

    first, second, other = once(11), once(11), once(12)
    assert first[0] == second[0]  # bit for bit
    assert first[1] == second[1]
    assert first[2] == second[2]
    for name in first[3]:
        assert torch.equal(first[3][name], second[3][name])
    assert other[0] != first[0]


def test_epochs_zero_trains_nothing_and_bad_settings_raise() -> None:
    trainer = seed_trainer(THREE, epochs=0)
    before = clone_state(trainer.workload.model)
    result = trainer.run()
    assert isinstance(result, RunFinished)
    assert (result.steps, result.epochs, result.final_loss) == (0, 0, None)
    assert_states_close(clone_state(trainer.workload.model), before)

    with pytest.raises(ValueError, match="epochs"):
        seed_trainer(THREE, epochs=-1)
    with pytest.raises(ValueError, match="batch size"):
        seed_trainer(THREE, batch_size=0)
    trainer = seed_trainer(THREE)
    for bad in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match="batch size"):
            trainer.set_batch_size(bad)
    with pytest.raises(ValueError, match="cpu:9"):
        trainer.set_devices(["cpu:9"])  # beyond the available virtual devices
    with pytest.raises(ValueError):
        trainer.set_devices([])
    with pytest.raises(ValueError, match="twice"):
        trainer.set_devices(["cpu:1", "cpu:1"])
    assert not trainer.has_pending_change


# ------------------------------------------------------------------ changes from the training thread


def test_batch_size_change_from_a_subscriber_applies_at_the_next_step_and_keeps_the_weights() -> None:
    trainer = seed_trainer(THREE, seed=5, epochs=2)
    rec = Recorder()
    seen: dict = {}

    def on_event(event: Event) -> None:
        if isinstance(event, StepFinished) and event.step == 2:
            seen["weights"] = clone_state(trainer.workload.model)
            trainer.set_batch_size(60)
            seen["pending"] = trainer.has_pending_change
            seen["batch_then"] = trainer.batch_size  # not applied mid-step

    trainer.subscribe(rec)
    trainer.subscribe(on_event)
    result = trainer.run()

    # Step 3 runs at 60: the 40 rows left of epoch 1, then 60 + 40 in epoch 2.
    ref = reference_run(builtin_workload("seed", 5), seed=5, epochs=2, batch_for_step=lambda s: 30 if s <= 2 else 60)
    assert ref.rows == [30, 30, 40, 60, 40]
    assert isinstance(result, RunFinished) and not result.stopped
    assert seen["pending"] and seen["batch_then"] == 30
    assert trainer.batch_size == 60 and not trainer.has_pending_change

    steps = rec.steps
    assert [s.batch_size for s in steps] == ref.rows
    assert [list(s.record.chunk_sizes) for s in steps] == [chunk_sizes(r, 3) for r in ref.rows]
    assert [s.epoch for s in steps] == [1, 1, 1, 2, 2]
    assert [s.steps_in_epoch for s in steps[2:]] == [3, 2, 2]
    (change,) = rec.of(ConfigChanged)
    assert (change.batch_size, change.devices, change.step) == (60, tuple(THREE), 3)
    assert rec.events.index(steps[1]) < rec.events.index(change) < rec.events.index(steps[2])

    # The weights before the change are what one process had after the same two steps, and
    # training went on from them: every later loss and the final weights match too.
    assert_states_close(seen["weights"], ref.states[2])
    for step, expected in zip(steps, ref.losses):
        assert step.loss == pytest.approx(expected, rel=1e-5)
    assert_states_close(clone_state(trainer.workload.model), ref.final_state)
    assert [e.samples for e in rec.of(EpochFinished)] == [100, 100]


def test_device_change_from_a_subscriber_keeps_training_on_the_new_devices() -> None:
    trainer = seed_trainer(THREE, seed=6, epochs=2)
    rec = Recorder()
    seen: dict = {}

    def on_event(event: Event) -> None:
        if isinstance(event, StepFinished) and event.step == 2:
            seen["weights"] = clone_state(trainer.workload.model)
            trainer.set_devices(["cpu:1", "cpu:3"])
            seen["devices_then"] = trainer.devices

    trainer.subscribe(rec)
    trainer.subscribe(on_event)
    result = trainer.run()
    ref = reference_run(builtin_workload("seed", 6), seed=6, epochs=2)

    assert isinstance(result, RunFinished) and result.steps == 8
    assert seen["devices_then"] == tuple(THREE)
    assert trainer.devices == ("cpu:1", "cpu:3")
    steps = rec.steps
    assert [s.record.devices for s in steps[:2]] == [tuple(THREE)] * 2
    for step in steps[2:]:
        assert step.record.devices == ("cpu:1", "cpu:3")[: len(step.record.replicas)]
    assert [list(s.record.chunk_sizes) for s in steps] == (
        [chunk_sizes(30, 3)] * 2 + [chunk_sizes(r, 2) for r in ref.rows[2:]]
    )
    assert [list(s.record.chunk_sizes) for s in steps[2:4]] == [[15, 15], [5, 5]]
    (change,) = rec.of(ConfigChanged)
    assert (change.batch_size, change.devices, change.step) == (30, ("cpu:1", "cpu:3"), 3)

    assert_states_close(seen["weights"], ref.states[2])
    for step, expected in zip(steps, ref.losses):
        assert step.loss == pytest.approx(expected, rel=1e-5)
    assert_states_close(clone_state(trainer.workload.model), ref.final_state)


def test_shrinking_to_one_device_and_back() -> None:
    trainer = seed_trainer(THREE, seed=2, epochs=1)
    rec = Recorder()

    def on_event(event: Event) -> None:
        if isinstance(event, StepFinished) and event.step == 1:
            trainer.set_devices(["cpu:2"])
        if isinstance(event, StepFinished) and event.step == 2:
            trainer.set_devices(["cpu:0", "cpu:1", "cpu:2", "cpu:3"])

    trainer.subscribe(rec)
    trainer.subscribe(on_event)
    result = trainer.run()
    ref = reference_run(builtin_workload("seed", 2), seed=2, epochs=1)

    assert isinstance(result, RunFinished)
    assert [s.record.devices for s in rec.steps] == [
        tuple(THREE), ("cpu:2",), ("cpu:0", "cpu:1", "cpu:2", "cpu:3"), ("cpu:0", "cpu:1", "cpu:2", "cpu:3"),
    ]
    assert [list(s.record.chunk_sizes) for s in rec.steps] == [
        chunk_sizes(30, 3), [30], chunk_sizes(30, 4), chunk_sizes(10, 4),
    ]
    assert_states_close(clone_state(trainer.workload.model), ref.final_state)


# ------------------------------------------------------------------ steering from another thread


def test_changes_from_another_thread_while_paused_apply_on_resume() -> None:
    trainer = seed_trainer(THREE, seed=8, epochs=2)
    rec = Recorder()
    seen: dict = {}

    def pause_after_step_2(event: Event) -> None:
        if isinstance(event, StepFinished) and event.step == 2:
            seen["pause"] = trainer.pause()
            seen["weights"] = clone_state(trainer.workload.model)

    trainer.subscribe(rec)
    trainer.subscribe(pause_after_step_2)
    thread, box = run_in_thread(trainer)

    rec.wait_for(StateChanged, lambda e: e.state == "paused")
    assert trainer.paused
    # A seed step takes milliseconds: a run that ignored the pause would show steps in 0.2 s.
    holds_for(lambda: len(rec.steps) == 2, 0.2, "no step while paused")
    batch = trainer.set_batch_size(45)
    devices = trainer.set_devices(["cpu:3", "cpu:1"])  # another first device, another order
    assert seen["pause"] < batch < devices  # numbered in the order asked
    assert trainer.has_pending_change
    assert trainer.batch_size == 30 and trainer.devices == tuple(THREE)  # not before the boundary
    holds_for(lambda: len(rec.steps) == 2, 0.1, "a change asked for does not end the pause")
    resumed = trainer.resume()
    thread.join(WAIT)
    assert not thread.is_alive()

    result = box["result"]
    ref = reference_run(builtin_workload("seed", 8), seed=8, epochs=2, batch_for_step=lambda s: 30 if s <= 2 else 45)
    assert ref.rows == [30, 30, 40, 45, 45, 10]
    assert isinstance(result, RunFinished) and not result.stopped
    steps = rec.steps
    assert [s.batch_size for s in steps] == ref.rows
    assert [s.record.devices[0] for s in steps] == ["cpu:0", "cpu:0", "cpu:3", "cpu:3", "cpu:3", "cpu:3"]
    assert [list(s.record.chunk_sizes) for s in steps] == (
        [chunk_sizes(30, 3)] * 2 + [chunk_sizes(r, 2) for r in ref.rows[2:]]
    )
    states = [(e.state, e.request) for e in rec.of(StateChanged)]
    assert states == [("paused", seen["pause"]), ("running", resumed)]
    (change,) = rec.of(ConfigChanged)  # one event answers both requests: it carries the newer
    assert (change.batch_size, change.devices, change.step, change.request) == (45, ("cpu:3", "cpu:1"), 3, devices)
    assert_states_close(seen["weights"], ref.states[2])
    for step, expected in zip(steps, ref.losses):
        assert step.loss == pytest.approx(expected, rel=1e-5)
    assert_states_close(clone_state(trainer.workload.model), ref.final_state)


def test_pause_and_resume_from_another_thread_then_stop() -> None:
    trainer = seed_trainer(["cpu:0", "cpu:1"], seed=1, epochs=None)  # until stopped
    rec = Recorder()
    trainer.subscribe(rec)
    thread, box = run_in_thread(trainer)
    try:
        rec.wait_for(StepFinished, lambda e: e.step >= 3)
        trainer.pause()
        rec.wait_for(StateChanged, lambda e: e.state == "paused")
        count = len(rec.steps)
        holds_for(lambda: len(rec.steps) == count, 0.3, "steps ran while paused")
        assert thread.is_alive()

        trainer.resume()
        rec.wait_for(StepFinished, lambda e: e.step >= count + 3)
        assert [e.state for e in rec.of(StateChanged)] == ["paused", "running"]
    finally:
        trainer.stop()
        thread.join(WAIT)
    assert not thread.is_alive()
    result = box["result"]
    assert isinstance(result, RunFinished) and result.stopped
    assert result.steps == len(rec.steps)
    assert rec.events[-1] is result


def test_stop_while_paused_returns_promptly() -> None:
    trainer = seed_trainer(THREE, seed=3, epochs=5)
    rec = Recorder()
    trainer.subscribe(rec)
    trainer.subscribe(lambda e: trainer.pause() if isinstance(e, StepFinished) and e.step == 1 else None)
    thread, box = run_in_thread(trainer)
    rec.wait_for(StateChanged, lambda e: e.state == "paused")

    started = time.monotonic()
    trainer.stop()
    thread.join(WAIT)
    assert not thread.is_alive()
    assert time.monotonic() - started < 2.0

    result = box["result"]
    assert isinstance(result, RunFinished) and result.stopped
    assert (result.steps, result.epochs, result.samples) == (1, 1, 30)
    assert len(rec.steps) == 1
    # Stopped mid-epoch: the final loss is the mean over the part that ran.
    assert result.final_loss == pytest.approx(rec.steps[0].loss)
    assert [e.state for e in rec.of(StateChanged)] == ["paused"]  # never "running" again


def test_stop_from_a_subscriber_stops_at_the_step_boundary() -> None:
    trainer = seed_trainer(THREE, seed=3, epochs=3)
    rec = Recorder()
    trainer.subscribe(rec)
    trainer.subscribe(lambda e: trainer.stop() if isinstance(e, StepFinished) and e.step == 6 else None)
    result = trainer.run()
    assert isinstance(result, RunFinished) and result.stopped
    assert result.steps == 6 and len(rec.steps) == 6
    assert len(rec.of(EpochFinished)) == 1
    # The last epoch's part that ran: steps 5 and 6, 30 rows each.
    assert result.final_loss == pytest.approx((rec.steps[4].loss + rec.steps[5].loss) / 2, rel=1e-6)


# ------------------------------------------------------------------ failures


def test_a_replica_that_raises_gives_run_failed_with_replica_and_device() -> None:
    workload = load_workload(f"{FIXTURES}:failing_workload", seed=0)
    trainer = Trainer(workload, THREE, RunOptions(seed=0, epochs=1, telemetry_interval=None))
    rec = Recorder()
    trainer.subscribe(rec)

    result = trainer.run()  # never raises for a training error

    assert isinstance(result, RunFailed)
    assert rec.events[-1] is result
    # The last batch is 10 rows, cut 4/4/2: only replica 2 gets the 2 rows it fails on.
    assert chunk_sizes(10, 3)[2] == 2
    assert (result.replica, result.device) == (2, "cpu:2")
    assert "boom" in result.error and "\n" not in result.error
    assert "replica 2" in result.error and "cpu:2" in result.error
    assert result.error_type == "RuntimeError"
    assert "boom" in result.traceback
    assert len(rec.steps) == 3  # the three full batches trained
    assert not rec.of(RunFinished)


def test_a_loss_error_outside_the_replicas_has_no_replica() -> None:
    seed_workload = builtin_workload("seed", 0)

    def bad_loss(output, target):
        raise ValueError("the loss is broken")

    workload = dataclasses.replace(seed_workload, loss_fn=bad_loss)
    result = Trainer(workload, THREE, RunOptions(seed=0, epochs=1, telemetry_interval=None)).run()
    assert isinstance(result, RunFailed)
    assert (result.replica, result.device) == (None, None)
    assert result.error == "ValueError: the loss is broken"


# ------------------------------------------------------------------ checkpoints


def test_checkpoint_at_the_end_then_resume_continues_with_weights_and_optimizer_state(tmp_path: Path) -> None:
    path = tmp_path / "ck.pt"
    first = Trainer(momentum_workload(9), THREE, RunOptions(seed=9, epochs=2, telemetry_interval=None, checkpoint=path))
    result = first.run()
    assert isinstance(result, RunFinished)

    saved = torch.load(path, weights_only=True)
    assert (saved["epoch"], saved["position"], saved["step"], saved["seed"]) == (2, 0, 8, 9)
    for name, value in first.workload.model.state_dict().items():
        assert torch.equal(saved["model"][name], value)
    assert any("momentum_buffer" in s for s in saved["optimizer"]["state"].values())
    assert not list(tmp_path.glob("*.partial"))

    resumed = Trainer(momentum_workload(9), THREE, RunOptions(seed=9, epochs=3, telemetry_interval=None, resume=path))
    rec = Recorder()
    resumed.subscribe(rec)
    # The weights it starts from are the saved ones, not the fresh workload's.
    seen: dict = {}
    resumed.subscribe(
        lambda e: seen.setdefault("start", clone_state(resumed.workload.model)) if isinstance(e, StepFinished) else None
    )
    result = resumed.run()

    ref = reference_run(momentum_workload(9), seed=9, epochs=3)
    assert isinstance(result, RunFinished)
    assert (result.epochs, result.steps) == (3, 12)
    assert [s.step for s in rec.steps] == [9, 10, 11, 12]
    assert {s.epoch for s in rec.steps} == {3}
    assert [e.epoch for e in rec.of(EpochFinished)] == [3]
    for step, expected in zip(rec.steps, ref.losses[8:]):
        assert step.loss == pytest.approx(expected, rel=1e-5)
    assert_states_close(seen["start"], ref.states[9])
    # Momentum carried over: without the optimizer state the weights would differ.
    assert_states_close(clone_state(resumed.workload.model), ref.final_state)


def test_checkpoint_on_stop_mid_epoch_then_resume_finishes_the_epoch(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "stopped.pt"
    first = Trainer(momentum_workload(4), THREE, RunOptions(seed=4, epochs=1, telemetry_interval=None, checkpoint=path))
    first.subscribe(lambda e: first.stop() if isinstance(e, StepFinished) and e.step == 2 else None)
    result = first.run()
    assert isinstance(result, RunFinished) and result.stopped

    saved = torch.load(path, weights_only=True)
    assert (saved["epoch"], saved["position"], saved["step"]) == (1, 60, 2)
    for name, value in first.workload.model.state_dict().items():
        assert torch.equal(saved["model"][name], value)

    resumed = Trainer(momentum_workload(4), THREE, RunOptions(seed=4, epochs=1, telemetry_interval=None, resume=path))
    rec = Recorder()
    resumed.subscribe(rec)
    result = resumed.run()
    ref = reference_run(momentum_workload(4), seed=4, epochs=1)
    assert isinstance(result, RunFinished) and not result.stopped
    assert (result.epochs, result.steps) == (1, 4)
    assert [(s.step, s.epoch, s.batch_size) for s in rec.steps] == [(3, 1, 30), (4, 1, 10)]
    assert_states_close(clone_state(resumed.workload.model), ref.final_state)


# ------------------------------------------------------------------ telemetry


def test_cpu_run_publishes_telemetry_for_every_available_device() -> None:
    trainer = seed_trainer(["cpu:0", "cpu:1"], seed=0, epochs=3, telemetry_interval=0.2)
    rec = Recorder()
    trainer.subscribe(rec)
    # Hold the run at a step boundary until a sample arrives, so a fast run cannot miss it.
    trainer.subscribe(lambda e: trainer.pause() if isinstance(e, StepFinished) and e.step == 1 else None)
    thread, box = run_in_thread(trainer)
    try:
        rec.wait_for(StateChanged, lambda e: e.state == "paused")
        sampled = rec.wait_for(TelemetrySampled)
        trainer.resume()
    finally:
        thread.join(WAIT)
        trainer.stop()  # only matters if an assertion above failed
        thread.join(WAIT)
    assert isinstance(box["result"], RunFinished) and not box["result"].stopped

    available = trainer.available_devices
    assert {"cpu:0", "cpu:1"} <= set(available)
    assert [s.device for s in sampled.samples] == list(available)
    for sample in sampled.samples:
        assert sample.name == "virtual"
        assert sample.memory_used_bytes and sample.memory_used_bytes > 0
        assert sample.utilization_pct is not None and 0.0 <= sample.utilization_pct <= 100.0
        assert sample.temperature_c is None and "temperature_c" in sample.missing


def test_telemetry_off_publishes_none_and_a_given_source_is_not_closed() -> None:
    class FakeSource:
        devices = ("cpu:0", "cpu:1", "cpu:2", "cpu:3")

        def __init__(self) -> None:
            self.closed = 0
            self.sampled = threading.Event()

        def sample(self):
            self.sampled.set()
            return ()

        def close(self) -> None:
            self.closed += 1

    rec = Recorder()
    trainer = seed_trainer(THREE, epochs=1, telemetry_interval=None)
    trainer.subscribe(rec)
    trainer.run()
    assert not rec.of(TelemetrySampled)

    source = FakeSource()
    trainer = seed_trainer(THREE, epochs=1, telemetry=source, telemetry_interval=0.2)
    trainer.run()
    assert source.closed == 0  # the caller owns it


def test_cuda_telemetry_without_a_gpu_degrades_to_a_reason() -> None:
    source = open_telemetry(["cuda:0"])
    try:
        (sample,) = source.sample()
    finally:
        source.close()
    assert sample.device == "cuda:0"
    if not torch.cuda.is_available():
        assert sample.missing.get("device"), sample
        assert sample.utilization_pct is None and sample.memory_used_bytes is None
    else:  # a real GPU: NVML may still be missing, but then it says so
        assert sample.utilization_pct is not None or sample.missing


def test_run_finished_final_loss_is_finite() -> None:
    result = seed_trainer(["cpu:0"], seed=1, epochs=1).run()
    assert isinstance(result, RunFinished)
    assert math.isfinite(result.final_loss)
