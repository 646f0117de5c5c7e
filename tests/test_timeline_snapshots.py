"""Snapshots of the step timeline (key t): a balanced and an unbalanced DataParallel step and a
DDP step, at 80x24 and 160x48. Regenerate with `make snapshots` and look at them."""

from __future__ import annotations

import itertools

import pytest
from pilot import until
from timeline_fixtures import balanced_step, ddp_run, dp_run, unbalanced_step
from ui_fakes import ScriptedTrainer, factory_of

from tui.app import DptuiApp

SIZES = pytest.mark.parametrize("size", [(80, 24), (160, 48)], ids=["80x24", "160x48"])


def timeline_of(events):
    trainer = ScriptedTrainer(events)
    clock = itertools.count(0.0, 0.05).__next__
    app = DptuiApp(factory_of(trainer), clock=clock, refresh_interval=3600)  # drawn once, in run_before

    async def run_before(pilot) -> None:
        await until(trainer.published.is_set, "the scripted run")
        await pilot.press("t")
        await pilot.pause()
        pilot.app.refresh_view()
        await pilot.pause()
        pilot.app.log_view.scroll_end(animate=False, immediate=True)
        await pilot.pause()

    return app, run_before


@SIZES
def test_an_unbalanced_dataparallel_step(snap_compare, size):
    app, run_before = timeline_of(dp_run(unbalanced_step))
    assert snap_compare(app, terminal_size=size, run_before=run_before)


@SIZES
def test_a_balanced_dataparallel_step(snap_compare, size):
    app, run_before = timeline_of(dp_run(balanced_step))
    assert snap_compare(app, terminal_size=size, run_before=run_before)


@SIZES
def test_a_ddp_step(snap_compare, size):
    app, run_before = timeline_of(ddp_run())
    assert snap_compare(app, terminal_size=size, run_before=run_before)
