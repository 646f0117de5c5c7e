"""dptui compare on real runs: a slowdown is found where it is, and the same code twice is no change."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from dpengine.compare.diff import compare_runs, regressions
from dpengine.compare.figures import RunFigures
from tui.cli import check_args, main, make_trainer_factory

SLOWED = f"{Path(__file__).parent / 'fixtures' / 'compare_workloads.py'}:seed_slowed"
THREE = "cpu:0,cpu:1,cpu:2"


def train(tmp_path: Path, name: str, monkeypatch, slow: str = "", *extra: str) -> Path:
    """The built-in seed workload on three virtual devices, 100 steps, slowed as `slow` says."""
    monkeypatch.setenv("DPTUI_TEST_SLOW", slow)
    log = tmp_path / f"{name}.jsonl"
    code = main(["--headless", "--devices", THREE, "--model", SLOWED, "--epochs", "25", "--every", "0",
                 "--no-telemetry", "--seed", "0", "--log", str(log), *extra])
    assert code == 0
    return log


def compare(capsys, *args: str) -> tuple[int, dict]:
    capsys.readouterr()
    code = main(["compare", *map(str, args), "--json"])
    return code, json.loads(capsys.readouterr().out)


def changed(report: dict) -> set[tuple[str, str, str]]:
    return {(r["unit"], r["metric"], r["verdict"]) for r in report["rows"] if r["verdict"] in ("slower", "faster")}


def test_a_data_delay_is_found_in_the_data_phase_and_nowhere_else(tmp_path, monkeypatch, capsys):
    before = train(tmp_path, "before", monkeypatch)
    after = train(tmp_path, "after", monkeypatch, "data:0.5")  # 15 ms on a full batch
    code, report = compare(capsys, before, after)
    assert code == 0
    assert {("run", "data", "slower"), ("run", "step", "slower")} <= changed(report), report["rows"]
    rate = next(r for r in report["rows"] if (r["unit"], r["metric"]) == ("run", "samples_per_s"))
    assert rate["b"] < rate["a"] / 3, rate
    # Run A's ~1 ms steps on a busy machine (CI) can drift within the run by as much as the change in
    # samples/s; compare then rightly withholds that verdict (stats.Change.held_by_drift), and only then.
    assert rate["verdict"] == "slower" or abs(rate["b"] - rate["a"]) <= rate["drift"], rate
    # The input's delay is most of the step's change; the devices' own times moved by next to nothing.
    assert report["verdict"].startswith("B is slower: step time +"), report["verdict"]
    step = next(r for r in report["rows"] if (r["unit"], r["metric"]) == ("run", "step"))
    assert 0 <= step["drift"] < step["b"] - step["a"], step  # each run steadier than the change
    where = report["where"]
    assert (where[0]["unit"], where[0]["metric"]) == ("run", "data") and where[0]["share"] > 0.75, where
    assert not [w for w in where if w["unit"] != "run"], where
    # and back again: the same figures the other way round
    code, report = compare(capsys, after, before)
    assert ("run", "data", "faster") in changed(report)


def test_a_slow_replica_is_found_on_its_device(tmp_path, monkeypatch, capsys):
    before = train(tmp_path, "before", monkeypatch)
    after = train(tmp_path, "after", monkeypatch, "cpu:1:3")
    code, report = compare(capsys, before, after)
    assert {("cpu:1", "forward", "slower"), ("run", "forward", "slower"), ("run", "step", "slower")} <= \
        changed(report), report["rows"]
    devices = [w for w in report["where"] if w["unit"] != "run"]
    assert [(w["unit"], w["metric"]) for w in devices] == [("cpu:1", "forward")], report["where"]
    # the slowed run's own advice names the device, with its figures
    slow = [a for a in report["b"]["advice"] if a["kind"] == "slow_device"]
    assert [a["figures"]["device"] for a in slow] == ["cpu:1"] and slow[0]["figures"]["ratio"] > 2, report["b"]


def test_the_same_code_twice_is_no_change_in_ten_of_ten_pairs(monkeypatch):
    # Each pair side by side, at the same time: a shared machine's load then falls on both runs alike,
    # and what is left is the steps' own noise, which must not read as a change.
    monkeypatch.setenv("DPTUI_TEST_SLOW", "")
    settings = check_args(["--headless", "--devices", THREE, "--model", SLOWED, "--epochs", "100", "--no-telemetry"])
    factory = make_trainer_factory(settings, headless=True)
    said = []
    for _ in range(10):
        trainers, figures = [factory(), factory()], [RunFigures(), RunFigures()]
        for trainer, watch in zip(trainers, figures):
            trainer.subscribe(watch)
        threads = [threading.Thread(target=trainer.run) for trainer in trainers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        comparison = compare_runs(*figures)
        assert comparison.steps == (397, 397)
        said.append((comparison.row("step").verdict, regressions(comparison, 5.0)))
    assert said == [("same", [])] * 10, said


def test_max_regression_fails_ci_with_one_line_naming_what_and_how_much(tmp_path, monkeypatch, capsys):
    before = train(tmp_path, "before", monkeypatch)
    after = train(tmp_path, "after", monkeypatch, "data:0.15")
    capsys.readouterr()
    assert main(["compare", str(before), str(before), "--max-regression", "0"]) == 0  # itself: never
    assert main(["compare", str(before), str(after), "--max-regression", "5"]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dptui compare: step time regressed "), lines
    assert main(["compare", str(before), str(after), "--max-regression", "5", "--phases"]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert any(line.startswith("dptui compare: data phase regressed ") for line in lines), lines


def test_summary_files_compare_as_their_logs_do(tmp_path, monkeypatch, capsys):
    before = train(tmp_path, "before", monkeypatch, "", "--summary", str(tmp_path / "before.json"))
    after = train(tmp_path, "after", monkeypatch, "data:0.15", "--summary", str(tmp_path / "after.json"))
    summary = json.loads((tmp_path / "after.json").read_text())
    assert (summary["format"], summary["version"]) == ("dptui-summary", 1)
    assert (tmp_path / "after.json").stat().st_size < after.stat().st_size / 4
    _, from_logs = compare(capsys, before, after)
    _, from_summaries = compare(capsys, tmp_path / "before.json", tmp_path / "after.json")
    assert changed(from_summaries) == changed(from_logs)
    # a log and a summary of the same run: no change
    _, mixed = compare(capsys, after, tmp_path / "after.json")
    assert changed(mixed) == set()
    # dptui view writes the same summary from the log
    assert main(["view", str(after), "--summary", str(tmp_path / "viewed.json")]) == 0
    assert json.loads((tmp_path / "viewed.json").read_text())["run"] == summary["run"]


def test_runs_of_different_workloads_are_refused_unless_forced(tmp_path, monkeypatch, capsys):
    three = train(tmp_path, "three", monkeypatch)
    monkeypatch.setenv("DPTUI_TEST_SLOW", "")
    two = tmp_path / "two.jsonl"
    assert main(["--headless", "--devices", "cpu:0,cpu:1", "--model", SLOWED, "--epochs", "5", "--every", "0",
                 "--no-telemetry", "--batch-size", "20", "--log", str(two)]) == 0
    capsys.readouterr()
    assert main(["compare", str(three), str(two)]) == 2
    error = capsys.readouterr().err.strip()
    assert error == ("dptui compare: error: the runs differ: batch 30 against 20; devices cpu:0,cpu:1,cpu:2 "
                     "against cpu:0,cpu:1; world size 3 against 2 (--force compares them anyway)"), error
    assert main(["compare", str(three), str(two), "--force"]) == 0
    assert "compared with --force although they differ: batch 30 against 20" in capsys.readouterr().out


@pytest.mark.parametrize(("content", "said"), [
    ("", "empty"), ("not json\n", "line 1 is not JSON"), ('{"format": "dptui-summary", "version": 99}',
                                                          "summary version 99 is newer than this dptui reads")])
def test_a_file_that_is_not_a_run_gets_one_line_and_status_2(tmp_path, capsys, content, said):
    good = tmp_path / "good.jsonl"
    good.write_text((Path(__file__).parent / "fixtures" / "ddp_run.jsonl").read_text())
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    assert main(["compare", str(good), str(bad)]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith(f"dptui compare: error: {bad}: ") and said in error[0], error
    assert main(["compare", str(good), str(tmp_path / "missing.jsonl")]) == 2
    assert capsys.readouterr().err.strip() == f"dptui compare: error: {tmp_path / 'missing.jsonl'}: no such file"


@pytest.mark.parametrize("size", [(80, 24), (120, 36)])
async def test_the_ui_advises_from_the_live_run_in_the_status_bar_and_the_log(monkeypatch, size):
    from pilot import log_text, quit_app, status, until

    from dpengine.run.options import RunOptions
    from dpengine.run.trainer import Trainer
    from dpengine.run.workloads import load_workload
    from tui.app import DptuiApp

    monkeypatch.setenv("DPTUI_TEST_SLOW", "data:0.15")
    devices = ["cpu:0", "cpu:1", "cpu:2"]
    options = RunOptions(epochs=None, telemetry_interval=None)
    app = DptuiApp(lambda: Trainer(load_workload(SLOWED), devices, options), advice_interval=0.2)
    async with app.run_test(size=size):
        await until(lambda: "⚑ advice: input-bound: data " in status(app), "the advice in the status bar")
        assert len(status(app).splitlines()[-1]) <= size[0]
        await until(lambda: "advice: input-bound: waiting for data " in log_text(app), "the advice in the log")
        await quit_app(app)


@pytest.mark.parametrize("size", [(80, 24), (120, 36)])
async def test_the_compare_ui_shows_both_runs_on_one_timeline_and_one_chart(tmp_path, monkeypatch, size):
    from pilot import quit_app, until

    from dpengine.compare.recorded import read_figures
    from tui.compare.app import CompareApp
    from tui.widgets.runs_chart import RunsChart
    from tui.widgets.step_timeline import StepTimeline

    before = train(tmp_path, "before", monkeypatch)
    after = train(tmp_path, "after", monkeypatch, "data:0.15")
    a, b = read_figures(before, 3), read_figures(after, 3)
    comparison = compare_runs(a.figures, b.figures, warmup=3)
    app = CompareApp(comparison, (str(before), str(after)), (a.figures, b.figures), 3)
    async with app.run_test(size=size):
        timeline = app.query_one(StepTimeline)
        await until(lambda: timeline.timeline is not None, "the timeline")
        rows = {row.name: {s.kind: s.duration_ms for s in row.spans} for row in timeline.timeline.rows}
        assert set(rows) == {"A", "B"} and rows["B"]["data"] > rows["A"].get("data", 0.0) + 3  # the 4.5 ms delay
        assert timeline.timeline.span_ms == pytest.approx(max(sum(r.values()) for r in rows.values()))
        chart = app.query_one(RunsChart)
        drawn = [chart.render_line(y).text for y in range(chart.size.height)]
        assert [line[0] for line in drawn[1:] if line[:1] in ("A", "B")] == ["A", "B"], drawn
        assert "B is slower" in str(app.query_one("#verdict").content)
        await quit_app(app)


def test_compare_ui_and_json_are_one_or_the_other(tmp_path, capsys):
    log = Path(__file__).parent / "fixtures" / "ddp_run.jsonl"
    assert main(["compare", str(log), str(log), "--ui", "--json"]) == 2
    assert capsys.readouterr().err.strip() == (
        "dptui compare: error: --ui shows the comparison on screen, --json prints it: choose one")
