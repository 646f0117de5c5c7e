"""5. UI cost: training throughput with the Textual app running against headless.

The same training run (mlp workload, 2 virtual devices, seed 0, a fixed number of epochs,
telemetry at the CLI's default 1 s) is made by dpengine.run.trainer.Trainer either
- headless: `Trainer.run()` on this (the main) thread, nothing else running, and the same
  on a thread of its own, since that is how the app runs it; or
- under the UI: tui.app.DptuiApp inside `App.run_test()` (Textual's headless driver, which
  still lays out and renders every frame; only the terminal writes are dropped), the
  trainer in the app's thread worker, as `dptui` runs it: with the device panels, and with
  the step timeline (key t) in their place; the charts drawn in both.
Where the UI's cost goes, two more: headless on its own thread while an asyncio loop on the
main thread wakes ten times a second and does nothing (the hand-offs of the GIL between the
trainer's threads and an event loop, without Textual), and the app refreshing once a second.
Throughput is read from the trainer's own StepFinished events (samples/s per step); the
modes alternate run by run. The harness waits for the run's end on an event, not by polling
(a poll is an event-loop wake-up of its own, which dptui does not make).
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import Callable

from dpengine.eventlog.events import RunFailed, RunFinished, StepFinished
from dpengine.run.options import RunOptions
from dpengine.run.trainer import Trainer
from dpengine.run.workloads import builtin_workload

from .common import Goal, Row, Section

DEVICES = ("cpu:0", "cpu:1")
GOAL = 0.95
SKIP_STEPS = 3  # the first steps start threads and warm caches


class Collector:
    def __init__(self) -> None:
        self.steps: list[StepFinished] = []
        self.result: RunFinished | RunFailed | None = None
        self.done = threading.Event()
        self.ui_cores: float | None = None  # the UI thread's CPU time over wall time (app runs only)
        self.on_warm: Callable[[], None] | None = None  # called once SKIP_STEPS steps ran
        self.on_done: Callable[[], None] | None = None

    def __call__(self, event) -> None:
        if isinstance(event, StepFinished):
            self.steps.append(event)
            if len(self.steps) == SKIP_STEPS and self.on_warm is not None:
                self.on_warm()
        elif isinstance(event, (RunFinished, RunFailed)):
            self.result = event
            self.done.set()
            if self.on_done is not None:
                self.on_done()

    def throughput(self) -> float:
        """Median samples/s of the steps after the first few."""
        if isinstance(self.result, RunFailed):
            raise RuntimeError(f"training failed: {self.result.error}")
        steps = self.steps[SKIP_STEPS:] or self.steps
        return statistics.median(s.samples_per_s for s in steps)

    def overall(self) -> float:
        """Samples over wall time from the end of the first few steps to the last."""
        steps = self.steps
        if len(steps) <= SKIP_STEPS + 1:
            return float("nan")
        first = steps[SKIP_STEPS - 1]
        rows = sum(s.batch_size for s in steps[SKIP_STEPS:])
        return rows / (steps[-1].seconds - first.seconds)


def make_trainer(collector: Collector, epochs: int) -> Trainer:
    trainer = Trainer(builtin_workload("mlp", seed=0), list(DEVICES),
                      RunOptions(epochs=epochs, seed=0, telemetry_interval=1.0))
    trainer.subscribe(collector)
    return trainer


def headless_run(epochs: int) -> Collector:
    collector = Collector()
    make_trainer(collector, epochs).run()
    return collector


def headless_thread_run(epochs: int) -> Collector:
    """Trainer.run() on a thread of its own, as the app runs it (its worker thread)."""
    box: dict[str, Collector] = {}
    thread = threading.Thread(target=lambda: box.setdefault("run", headless_run(epochs)), name="trainer")
    thread.start()
    thread.join()
    return box["run"]


async def _until_done(collector: Collector, timeout: float) -> None:
    """Wait, on this thread's event loop, for the run's end; note this thread's CPU over the
    steps timed in `collector.ui_cores`. Woken by the trainer's thread, never by polling."""
    loop = asyncio.get_running_loop()
    warm, done = asyncio.Event(), asyncio.Event()
    since: list[tuple[float, float]] = []

    def warmed() -> None:
        since.append((time.thread_time(), time.perf_counter()))
        warm.set()

    collector.on_warm = lambda: loop.call_soon_threadsafe(warmed)
    collector.on_done = lambda: loop.call_soon_threadsafe(done.set)
    if collector.done.is_set():
        done.set()
    await asyncio.wait_for(done.wait(), timeout)
    if since:
        collector.ui_cores = (time.thread_time() - since[0][0]) / (time.perf_counter() - since[0][1])


def ui_run(epochs: int, timeout: float = 300.0, refresh_interval: float | None = None,
           timeline: bool = False, dialog: bool = False) -> Collector:
    from tui.app import DptuiApp

    collector = Collector()
    options = {} if refresh_interval is None else {"refresh_interval": refresh_interval}

    async def main() -> None:
        app = DptuiApp(lambda: make_trainer(collector, epochs), **options)
        async with app.run_test(size=(120, 40)):
            if timeline:
                app.action_toggle_timeline()  # key t: the timeline in the panels' place
            if dialog:
                app.action_ask_batch()  # key b: the batch-size dialog open over the panels
            await _until_done(collector, timeout)
            app.session.stop()

    asyncio.run(main())
    return collector


def loop_thread_run(epochs: int, timeout: float = 300.0) -> Collector:
    """Headless on its own thread while this thread's asyncio loop wakes at the UI's 10 Hz and
    does nothing: what the hand-offs with an event loop cost, without Textual's drawing."""
    collector = Collector()

    async def main() -> None:
        loop = asyncio.get_running_loop()

        def tick() -> None:
            nonlocal handle
            handle = loop.call_later(0.1, tick)

        handle = loop.call_later(0.1, tick)
        thread = threading.Thread(target=lambda: make_trainer(collector, epochs).run(), name="trainer")
        thread.start()
        try:
            await _until_done(collector, timeout)
        finally:
            handle.cancel()
            thread.join()

    asyncio.run(main())
    return collector


def run(quick: bool = False) -> Section:
    section = Section(5, "UI cost")
    goal_text = f"training throughput with the UI >= {GOAL:.0%} of headless (mlp, 2 virtual devices)"
    ui_run(1)  # warm-up: imports, CSS parsing, first layout

    # 8 runs of each: run to run, throughput moves by +-10% on these machines.
    rounds, epochs = (1, 1) if quick else (8, 3)
    # Besides the app as shipped (panels, or the timeline), the pieces of its cost: an event loop
    # that only wakes, and the app refreshing once a second.
    modes = ["headless", "headless_thread", "loop_thread", "ui", "ui_timeline", "ui_1hz", "ui_dialog"]
    runners = {
        "headless": headless_run, "headless_thread": headless_thread_run, "loop_thread": loop_thread_run,
        "ui": ui_run, "ui_timeline": lambda e: ui_run(e, timeline=True),
        "ui_1hz": lambda e: ui_run(e, refresh_interval=1.0), "ui_dialog": lambda e: ui_run(e, dialog=True),
    }
    runs: dict[str, list[Collector]] = {m: [] for m in modes}
    for r in range(rounds):
        shift = r % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            runs[mode].append(runners[mode](epochs))
    per_step = {m: statistics.median(c.throughput() for c in cs) for m, cs in runs.items()}
    overall = {m: statistics.median(c.overall() for c in cs) for m, cs in runs.items()}
    steps = len(runs["headless"][0].steps)
    case = f"mlp, {len(DEVICES)} virtual devices, {steps} steps a run, {rounds} runs each"
    labels = {"headless": "headless Trainer.run()", "headless_thread": "headless Trainer.run() on its own thread",
              "loop_thread": "headless on its own thread, an idle asyncio loop waking at 10 Hz (informational)",
              "ui": "DptuiApp in run_test() (renders), as shipped: panels and charts",
              "ui_timeline": "DptuiApp in run_test(), the step timeline (key t) and charts",
              "ui_1hz": "DptuiApp in run_test(), refresh_interval=1.0 (informational)",
              "ui_dialog": "DptuiApp in run_test(), the batch-size dialog (key b) open the whole run"}
    for mode in modes:
        ratio = per_step[mode] / per_step["headless"] if mode != "headless" else None
        section.rows.append(Row("5 UI", case + ", median step throughput", labels[mode], per_step[mode],
                                "samples/s", n=rounds, ratio=ratio, ratio_of="of headless" if ratio else ""))
    for mode in modes:
        ratio = overall[mode] / overall["headless"] if mode != "headless" else None
        section.rows.append(Row("5 UI", case + ", whole-run throughput", labels[mode], overall[mode],
                                "samples/s", n=rounds, ratio=ratio, ratio_of="of headless" if ratio else ""))
    for mode in ("loop_thread", "ui", "ui_timeline", "ui_1hz", "ui_dialog"):
        cores = statistics.median(c.ui_cores for c in runs[mode] if c.ui_cores is not None)
        section.rows.append(Row("5 UI", case + ", the UI thread's CPU while training", labels[mode], cores,
                                "cores", n=rounds))
    # Judged against `dptui --headless`, which trains on the main thread; with the panels and with
    # the timeline (the lower counts). The threaded baseline is reported beside it.
    ratio = min(per_step["ui"], per_step["ui_timeline"]) / per_step["headless"]
    same_thread = min(per_step["ui"], per_step["ui_timeline"]) / per_step["headless_thread"]
    section.goals.append(Goal(
        5, goal_text,
        f"{ratio:.1%} of headless Trainer.run() (per-step median, the lower of panels "
        f"{per_step['ui'] / per_step['headless']:.1%} and timeline {per_step['ui_timeline'] / per_step['headless']:.1%}"
        f"; whole run {min(overall['ui'], overall['ui_timeline']) / overall['headless']:.1%}); "
        f"{same_thread:.1%} of headless on a thread of its own; an idle event loop beside the thread "
        f"{per_step['loop_thread'] / per_step['headless_thread']:.1%} of it; refreshing at 1 Hz "
        f"{per_step['ui_1hz'] / per_step['headless_thread']:.1%} of it; with the batch dialog open "
        f"{per_step['ui_dialog'] / per_step['headless']:.1%} of headless",
        "met" if ratio >= GOAL else "MISSED",
    ))
    section.notes.append(
        "the goal is judged against `dptui --headless` (Trainer.run() on the main thread), with the panels "
        "and with the timeline shown, the lower counting; the app trains on a worker thread, so headless on a "
        "thread of its own is reported beside it."
    )
    return section
