"""Snapshots of the main screen from a scripted, deterministic run.

Fixed steps, timings, telemetry and clock: the SVGs change only when the UI does.
Regenerate with `pytest tests/test_snapshots.py --snapshot-update` and look at them.
Sync tests on purpose: snap_compare runs the app itself.
"""

from __future__ import annotations

import itertools

import pytest

from tui.app import DptuiApp
from pilot import until
from ui_fakes import ScriptedTrainer, demo_events, factory_of

GPUS = ("cuda:0", "cuda:1", "cuda:2", "cuda:3")
CPUS = ("cpu:0", "cpu:1", "cpu:2")


def scripted(available, devices) -> tuple[DptuiApp, ScriptedTrainer]:
    trainer = ScriptedTrainer(demo_events(available, devices, epochs=3))
    clock = itertools.count(0.0, 0.05).__next__  # log thinning then depends only on the script
    # No timer: the one refresh in run_before draws the whole script, however loaded the machine.
    return DptuiApp(factory_of(trainer), clock=clock, refresh_interval=3600), trainer


def played(trainer: ScriptedTrainer):
    async def run_before(pilot) -> None:
        await until(trainer.published.is_set, "the scripted run")
        pilot.app.refresh_view()
        await pilot.pause()
        # RichLog follows its end lazily, after a refresh; settle it so the picture cannot race.
        pilot.app.log_view.scroll_end(animate=False, immediate=True)
        await pilot.pause()

    return run_before


@pytest.mark.parametrize("size", [(120, 40), (80, 24)], ids=["120x40", "80x24"])
def test_three_gpus_of_four(snap_compare, size):
    app, trainer = scripted(GPUS, GPUS[:3])
    assert snap_compare(app, terminal_size=size, run_before=played(trainer))


def test_three_virtual_cpus_at_80x24(snap_compare):
    app, trainer = scripted(CPUS, CPUS)
    assert snap_compare(app, terminal_size=(80, 24), run_before=played(trainer))


# -- a DDP run's rank panels and straggler line (issue 21) ----------------------------------------


def ddp_scripted(until_step: int) -> tuple[DptuiApp, ScriptedTrainer]:
    """The recorded DDP run (tests/fixtures/ddp_run.jsonl) live up to `until_step`: at 30, rank 1
    is the straggler (its input slowed by 48 ms)."""
    from test_ddp_ui import fixture_events

    from dpengine.eventlog.events import RankStepFinished

    events = list(itertools.takewhile(lambda e: not (isinstance(e, RankStepFinished) and e.step > until_step),
                                      fixture_events()))
    trainer = ScriptedTrainer(events)
    clock = itertools.count(0.0, 0.05).__next__
    return DptuiApp(factory_of(trainer), clock=clock, refresh_interval=3600), trainer


@pytest.mark.parametrize("size", [(80, 24), (160, 48)], ids=["80x24", "160x48"])
def test_ddp_ranks_with_a_straggler(snap_compare, size):
    app, trainer = ddp_scripted(30)
    assert snap_compare(app, terminal_size=size, run_before=played(trainer))


# -- a DataParallel script's steps in phases, input-bound (issue 21) -------------------------------


def test_a_dataparallel_script_input_bound_at_80x24(snap_compare):
    """What `dptui view` of a `dptui run` log shows at its last step: the step's phases and the verdict."""
    from test_dp_phases_ui import script_events

    trainer = ScriptedTrainer(script_events())
    clock = itertools.count(0.0, 0.05).__next__
    app = DptuiApp(factory_of(trainer), clock=clock, refresh_interval=3600)
    assert snap_compare(app, terminal_size=(80, 24), run_before=played(trainer))
