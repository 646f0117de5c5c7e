"""scripts/gpu_check.sh's parts that run without a GPU: the run-ahead measurement in its CPU dry
run, the event checker on real and on broken event files, and the script's own syntax."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from importlib import metadata
from pathlib import Path

from tui.cli import main as dptui

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_run_ahead_check_runs_both_candidates_with_and_without_grad(tmp_path: Path, capsys) -> None:
    runahead = load("gpu_runahead")
    assert runahead.main(["--cpu-dry-run", str(tmp_path / "runahead.json")]) == 0
    results = json.loads((tmp_path / "runahead.json").read_text())
    assert [(r["candidate"], r["grad"]) for r in results] == [
        ("torch", False), ("dpengine", False), ("torch", True), ("dpengine", True)]
    assert all(r["host_s"] > 0 and r["steps"] == runahead.STEPS for r in results)
    assert capsys.readouterr().out.count(": dry run") == 2
    # the verdict on a GPU: dpengine must run ahead about as well as torch
    waits = [dict(r, host_over_device=0.05 if r["candidate"] == "torch" else 0.97) for r in results]
    assert [ok for ok, _ in runahead.verdicts(waits)] == [False, False]
    assert all(ok for ok, _ in runahead.verdicts([dict(r, host_over_device=0.05) for r in results]))


def test_the_event_check_passes_a_real_run_and_names_what_is_wrong(tmp_path: Path, capsys) -> None:
    check = load("gpu_events_check")
    log = tmp_path / "run.jsonl"
    assert dptui(["--headless", "--every", "0", "--devices", "cpu:0,cpu:1", "--epochs", "1", "--seed", "1",
                  "--telemetry-interval", "0.2", "--log", str(log)]) == 0
    events = [json.loads(line) for line in log.read_text().splitlines()]
    capsys.readouterr()
    assert check.main([str(log), "--steps", "4", "--starts"]) == 0
    assert all(line.startswith("ok: ") for line in capsys.readouterr().out.splitlines())
    step = next(e for e in events if e["type"] == "step")
    older = dict(step, replicas=[{k: v for k, v in r.items() if k != "forward_start_ms"} for r in step["replicas"]])
    (ok, line), *_ = [v for v in check.check([*events, older], steps=None, nvml=False, starts=True)
                      if "phase starts" in v[1]]
    assert not ok and "all but 1 steps" in line

    step = next(e for e in events if e["type"] == "step")
    untimed = dict(step, replicas=[dict(step["replicas"][0], forward_ms=0.0), *step["replicas"][1:]])
    stand_in = {"type": "telemetry", "samples": [{"device": "cuda:0", "name": "GPU",
                                                  "missing": {"device": "NVML unavailable: Driver Not Loaded"}}]}
    failed = {"type": "script_exited", "code": 1, "signal": None}
    verdicts = check.check([*events, untimed, stand_in, failed], steps=4, nvml=True)
    assert [ok for ok, _ in verdicts] == [False, False, False, False]
    assert "on all but 1" in verdicts[0][1] and "5 steps published, 4 expected" in verdicts[1][1]
    assert "NVML unavailable: Driver Not Loaded" in verdicts[2][1]


def test_the_check_script_parses_and_says_what_it_needs() -> None:
    script = SCRIPTS / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    for part in ("pytest -q -m cuda", "gpu_runahead.py", "--backend \"$backend\"", "examples/train_script.py",
                 "bench --gpu-only", ".whl"):
        assert part in text, part


def test_the_readme_names_the_wheels_textual_needs_at_the_versions_tested_here() -> None:
    """The GPU machine lacks textual: README.md's download list holds it and what it needs, pinned to
    the versions this suite runs with."""
    readme = (SCRIPTS.parent / "README.md").read_text()
    section = readme[readme.index("## Checking on a GPU"):readme.index("## Development")]
    pinned = dict(re.findall(r"([A-Za-z][\w.-]*)==([\w.]+)", section))
    # what the GPU machine's image lacks (/work/.library/device/KINDS.md lists what it has)
    for needed in ("textual", "mdit-py-plugins", "platformdirs", "linkify-it-py", "pytest-asyncio"):
        assert needed in pinned, needed
    for name, version in pinned.items():
        assert metadata.version(name) == version, name
