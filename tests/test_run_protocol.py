"""The run contract (`dpengine.Run`): both trainers keep it, and the UI copes with runs that offer less."""

from __future__ import annotations

from ui_fakes import ScriptedTrainer, demo_events

from dpengine import ControlUnsupported, Run
from dpengine.distributed import DdpTrainer, WorkloadSpec
from dpengine.run.options import RunOptions
from dpengine.run.protocol import ALL_CONTROLS, BALANCE, BATCH_SIZE, DEVICES, PAUSE
from dpengine.run.trainer import Trainer
from dpengine.run.workloads import builtin_workload
from tui.session import Session
from tui.state import RunView


def test_both_trainers_are_runs_with_every_control():
    threaded = Trainer(builtin_workload("seed", seed=0), ["cpu:0", "cpu:1"], RunOptions(seed=0))
    ddp = DdpTrainer(WorkloadSpec("seed", seed=0), ["cpu:0", "cpu:1"], RunOptions(seed=0))
    for run in (threaded, ddp):
        assert isinstance(run, Run)
        assert run.controls == ALL_CONTROLS == {PAUSE, BATCH_SIZE, DEVICES, BALANCE}
        assert run.devices == ("cpu:0", "cpu:1") == run.config().devices


def test_an_unsupported_control_is_a_value_error_with_a_sentence():
    error = ControlUnsupported(BATCH_SIZE, "A script sets its own batch size.")
    assert isinstance(error, ValueError) and error.control == BATCH_SIZE
    assert str(error) == "A script sets its own batch size."


def test_the_session_shows_why_a_control_does_not_apply():
    events = demo_events(epochs=0)
    view = RunView(lambda: 0.0)
    view.feed(events[0])  # RunStarted
    run = ScriptedTrainer(events, controls=frozenset({PAUSE}))
    assert isinstance(run, Run)
    session = Session(view)
    session.attach(run)
    assert session.set_batch_size(64) == "This run cannot change its batch size."
    assert session.toggle_device(0) == "This run cannot change its devices."
    assert session.toggle_auto_balance() == "This run cannot change its split."
    assert view.snapshot().pending == ""  # nothing refused shows as pending
    assert session.toggle_pause() is None and run.calls == [("pause",)]

    replay = ScriptedTrainer(events, controls=frozenset())
    session = Session(view)
    session.attach(replay)
    assert session.toggle_pause() == "This run cannot be paused."
    assert replay.calls == []
