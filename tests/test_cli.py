"""The `dptui` command: argument checking, exit statuses, JSON Lines, --log, checkpoints, Ctrl-C.

Most runs go through `tui.cli.main([...])` in-process; a few run the real console script, as a
user would, to see exit statuses, stderr and SIGINT handling end to end.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from reference_loop import chunk_sizes

from dpengine.eventlog.events import RunFinished
from dpengine.eventlog.writer import JsonLinesWriter
from tui.cli import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, main

ROOT = Path(__file__).resolve().parents[1]
FIX = Path(__file__).resolve().parent / "fixtures" / "dptui_test_workloads.py"
EXAMPLE = ROOT / "examples" / "custom_workload.py"
RUN_TYPES = {"run_started", "step", "epoch", "telemetry", "run_finished"}
THREE = "cpu:0,cpu:1,cpu:2"


def console_script() -> str:
    script = Path(sys.executable).with_name("dptui")
    if not script.exists():
        pytest.skip("the dptui console script is not installed next to this Python")
    return str(script)


def json_run(capsys, *args: str) -> tuple[int, list[dict]]:
    code = main(["--headless", "--json", *args])
    captured = capsys.readouterr()
    events = [json.loads(line) for line in captured.out.splitlines()]  # every line is one object
    return code, events


def of(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["type"] == kind]


def assert_usage_error(capsys, argv: list[str], *fragments: str) -> str:
    code = main(argv)
    captured = capsys.readouterr()
    assert code == EXIT_USAGE, (argv, captured)
    lines = captured.err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("dptui: error: ")
    assert "Traceback" not in captured.err
    assert captured.out == ""  # nothing ran
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


# ------------------------------------------------------------------ bad input: one line, exit 2


BAD_ARGS = [
    (["--devices", "gpu:0"], ["gpu:0"]),
    (["--devices", "cpu:0,cpu:0"], ["twice"]),
    (["--devices", "cpu:1,1"] if torch.cuda.device_count() < 2 else ["--devices", "cpu:1,cuda:0"], ["--devices"]),
    (["--devices", ""], ["empty"]),
    (["--devices", "cpu:0,,cpu:1"], ["empty"]),
    (["--devices", "cpu:-1"], ["--devices"]),
    (["--batch-size", "0"], ["batch size", "0"]),
    (["--batch-size", "-4"], ["batch size", "-4"]),
    (["--batch-size", "abc"], ["batch size", "abc"]),
    (["--batch-size", "2.5"], ["batch size"]),
    (["--epochs", "-1"], ["epochs", "-1"]),
    (["--epochs", "many"], ["epochs"]),
    (["--lr", "0"], ["learning rate"]),
    (["--seed", "-3"], ["seed"]),
    (["--telemetry-interval", "0.05"], ["telemetry interval"]),
    (["--backend", "horovod"], ["--backend"]),
    (["--no-such-option"], ["--no-such-option"]),
    (["--model", "bogus"], ["bogus"]),
    (["--model", "no_such_package_dptui.models:make"], ["no_such_package_dptui.models", "not found"]),
]


@pytest.mark.parametrize(("args", "fragments"), BAD_ARGS, ids=[" ".join(a) or "empty" for a, _ in BAD_ARGS])
def test_bad_arguments_give_one_line_and_exit_2(capsys, args, fragments) -> None:
    assert_usage_error(capsys, ["--headless", *args], *fragments)


def test_a_cuda_device_that_does_not_exist(capsys) -> None:
    if torch.cuda.is_available() and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    assert_usage_error(capsys, ["--headless", "--devices", "cuda:7"], "cuda:7", "does not exist")
    assert_usage_error(capsys, ["--headless", "--devices", "7"], "does not exist")


def test_json_needs_headless(capsys) -> None:
    assert_usage_error(capsys, ["--json"], "--json")


def test_bad_files_give_one_line_and_exit_2(capsys, tmp_path: Path) -> None:
    broken = tmp_path / "broken_model.py"
    broken.write_text("import torch\n\ndef make(:\n    return None\n")
    assert_usage_error(capsys, ["--headless", "--model", f"{broken}:make"], "broken_model.py", "line 3")

    assert_usage_error(capsys, ["--headless", "--model", f"{tmp_path / 'missing.py'}:make"], "missing.py", "not found")
    assert_usage_error(capsys, ["--headless", "--model", f"{FIX}:no_such_factory"], "no_such_factory")
    assert_usage_error(capsys, ["--headless", "--model", f"{FIX}:not_a_model"], "not_a_model", "str")
    assert_usage_error(capsys, ["--headless", "--model", f"{FIX}:needs_arguments"], "width")
    assert_usage_error(capsys, ["--headless", "--model", f"{FIX}:linear_5_2"], "dataset")
    assert_usage_error(capsys, ["--headless", "--model", f"{FIX}:linear_5_2", "--dataset", f"{FIX}:linear_5_2"],
                       "map-style Dataset")
    # Items that do not fit the model: caught on a trial batch, before any training.
    assert_usage_error(
        capsys, ["--headless", "--model", f"{FIX}:linear_5_2", "--dataset", f"{FIX}:three_features"],
        "do not fit the model",
    )
    assert_usage_error(capsys, ["--headless", "--model", f"{FIX}:misfit_workload"], "do not fit the model")

    assert_usage_error(capsys, ["--headless", "--resume", str(tmp_path / "none.pt")], "none.pt")
    junk = tmp_path / "junk.pt"
    junk.write_text("not a checkpoint\n")
    assert_usage_error(capsys, ["--headless", "--resume", str(junk)], "junk.pt", "checkpoint")
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(2)}, other)
    assert_usage_error(capsys, ["--headless", "--resume", str(other)], "other.pt", "dptui checkpoint")
    assert_usage_error(capsys, ["--headless", "--log", str(tmp_path / "no" / "such" / "dir" / "log.jsonl")], "--log")


def test_a_checkpoint_of_another_model_is_a_usage_error(capsys, tmp_path: Path) -> None:
    ck = tmp_path / "seed.pt"
    assert main(["--headless", "--no-telemetry", "--devices", "cpu:0", "--every", "0", "--checkpoint", str(ck)]) == 0
    capsys.readouterr()
    assert_usage_error(capsys, ["--headless", "--model", "mlp", "--resume", str(ck)], "seed.pt", "does not fit")


# ------------------------------------------------------------------ JSON Lines


def test_json_stream_parses_and_has_every_event_of_a_run(capsys) -> None:
    code, events = json_run(capsys, "--devices", THREE, "--seed", "2", "--epochs", "20", "--telemetry-interval", "0.2")
    assert code == EXIT_OK
    assert RUN_TYPES <= {e["type"] for e in events}
    assert events[0]["type"] == "run_started" and events[-1]["type"] == "run_finished"
    config = events[0]["config"]
    assert config["devices"] == THREE.split(",") and config["seed"] == 2 and config["epochs"] == 20

    steps = of(events, "step")
    assert len(steps) == 80 and len(of(events, "epoch")) == 20
    for step in steps:
        assert step["batch_size"] == sum(r["chunk_size"] for r in step["replicas"])
        assert [r["chunk_size"] for r in step["replicas"]] == chunk_sizes(step["batch_size"], 3)
        for index, replica in enumerate(step["replicas"]):
            assert replica["device"] == f"cpu:{index}"
            assert replica["forward_ms"] >= 0
            assert replica["memory_bytes"] >= 0
            assert {"device", "chunk_size", "forward_ms", "memory_bytes"} <= replica.keys()
        assert step["loss"] > 0 and step["samples_per_s"] > 0
    for telemetry in of(events, "telemetry"):
        assert [s["device"] for s in telemetry["samples"]] == config["available_devices"]
    finished = events[-1]
    assert finished["stopped"] is False and finished["steps"] == 80
    assert finished["final_loss"] == pytest.approx(of(events, "epoch")[-1]["mean_loss"])


def test_same_seed_same_run_different_seed_different_loss(capsys) -> None:
    args = ("--devices", THREE, "--epochs", "2", "--no-telemetry")
    runs = [json_run(capsys, *args, "--seed", seed)[1] for seed in ("5", "5", "6")]

    def summary(events):
        steps = of(events, "step")
        return (
            events[-1]["final_loss"],
            [[r["chunk_size"] for r in s["replicas"]] for s in steps],
            [s["loss"] for s in steps],
        )

    first, second, other = (summary(events) for events in runs)
    assert first == second
    assert other[0] != first[0]


def test_a_failing_replica_exits_1_with_one_line(capsys) -> None:
    args = ["--headless", "--no-telemetry", "--devices", THREE, "--seed", "0", "--model", f"{FIX}:failing_workload"]
    code = main(args)
    captured = capsys.readouterr()
    assert code == EXIT_FAILED
    assert captured.err.splitlines() == [captured.err.strip()]
    assert captured.err.startswith("dptui: training failed: ")
    assert "replica 2" in captured.err and "cpu:2" in captured.err and "boom" in captured.err
    assert "Traceback" not in captured.err + captured.out
    assert captured.out.count("Outside:") == 3  # the three full batches ran

    code, events = json_run(capsys, *args[1:])
    assert code == EXIT_FAILED
    failed = events[-1]
    assert failed["type"] == "run_failed"
    assert (failed["replica"], failed["device"]) == (2, "cpu:2")
    assert not of(events, "run_finished")


# ------------------------------------------------------------------ user workloads


def test_a_user_workload_from_a_file(capsys) -> None:
    if not EXAMPLE.exists():
        pytest.skip("examples/custom_workload.py is not there")
    code = main(["--headless", "--no-telemetry", "--devices", "cpu:0,cpu:1", "--seed", "0",
                 "--model", f"{EXAMPLE}:make_workload", "--every", "8"])
    out = capsys.readouterr().out.splitlines()
    assert code == EXIT_OK
    # 512 samples at its batch of 64, cut 32/32, 8 features in and 1 value out.
    assert out[:4] == [
        "Use 2 devices: cpu:0, cpu:1",
        "[cpu:0] In Model: input size torch.Size([32, 8]) output size torch.Size([32, 1])",
        "[cpu:1] In Model: input size torch.Size([32, 8]) output size torch.Size([32, 1])",
        "Outside: input size torch.Size([64, 8]) output size torch.Size([64, 1])",
    ]
    assert out[-2].startswith("epoch 1: loss ") and ", 8 steps, 512 samples" in out[-2]
    assert out[-1].startswith("final loss ")


def test_a_bare_module_with_a_dataset_from_a_file(capsys) -> None:
    code, events = json_run(capsys, "--no-telemetry", "--devices", THREE, "--seed", "1",
                            "--model", f"{FIX}:linear_5_2", "--dataset", f"{FIX}:five_features")
    assert code == EXIT_OK
    # 48 items at the Workload default batch of 32: 32 then 16.
    assert [s["batch_size"] for s in of(events, "step")] == [32, 16]
    assert [[r["chunk_size"] for r in s["replicas"]] for s in of(events, "step")] == [
        chunk_sizes(32, 3), chunk_sizes(16, 3)
    ]
    assert events[-1]["type"] == "run_finished"


# ------------------------------------------------------------------ --log


def test_log_writes_every_event_as_json_lines(capsys, tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    code = main(["--headless", "--devices", "cpu:0,cpu:1", "--seed", "3", "--epochs", "20", "--every", "0",
                 "--telemetry-interval", "0.2", "--log", str(log)])
    out = capsys.readouterr().out
    assert code == EXIT_OK
    said = [line for line in out.splitlines() if not line.startswith("advice: ")]
    assert said[-1].startswith("final loss ")  # the text still goes to stdout
    lines = log.read_text().splitlines()
    events = [json.loads(line) for line in lines]
    assert all(isinstance(e, dict) and "type" in e for e in events)
    assert RUN_TYPES <= {e["type"] for e in events}
    assert events[0]["type"] == "run_started" and events[-1]["type"] == "run_finished"
    assert len(of(events, "step")) == 80
    assert f"final loss {events[-1]['final_loss']:.6f}" == said[-1]


def test_json_lines_writer_flushes_each_event(tmp_path: Path) -> None:
    path = tmp_path / "live.jsonl"
    with open(path, "w", encoding="utf-8") as stream:
        writer = JsonLinesWriter(stream)
        writer(RunFinished(final_loss=float("nan"), epochs=1, steps=2, samples=3, seconds=0.5, stopped=False))
        # Readable before the file is closed: flushed as it goes.
        (line,) = path.read_text().splitlines()
    event = json.loads(line)
    assert event["type"] == "run_finished" and event["final_loss"] is None  # NaN is not JSON

    buffer = io.StringIO()
    JsonLinesWriter(buffer)(RunFinished(final_loss=0.25, epochs=1, steps=2, samples=3, seconds=0.5, stopped=True))
    assert json.loads(buffer.getvalue())["stopped"] is True


# ------------------------------------------------------------------ checkpoints


def test_checkpoint_then_resume_continues_the_run(capsys, tmp_path: Path) -> None:
    first, resumed, straight = tmp_path / "epoch1.pt", tmp_path / "epoch2.pt", tmp_path / "straight.pt"
    common = ["--devices", THREE, "--no-telemetry"]
    # No --seed: the resumed run must take the saved run's seed, or it would train on other data.
    code, events = json_run(capsys, *common, "--epochs", "1", "--checkpoint", str(first))
    assert code == EXIT_OK
    seed = events[0]["config"]["seed"]
    saved = torch.load(first, weights_only=True)
    assert (saved["epoch"], saved["step"], saved["position"]) == (1, 4, 0)

    code, events = json_run(capsys, *common, "--epochs", "2", "--resume", str(first), "--checkpoint", str(resumed))
    assert code == EXIT_OK
    assert events[0]["config"]["seed"] == seed
    steps = of(events, "step")
    assert [(s["epoch"], s["step"]) for s in steps] == [(2, 5), (2, 6), (2, 7), (2, 8)]
    assert (events[-1]["epochs"], events[-1]["steps"]) == (2, 8)

    code, straight_events = json_run(capsys, *common, "--epochs", "2", "--seed", str(seed),
                                     "--checkpoint", str(straight))
    assert code == EXIT_OK
    for got, expected in zip(steps, of(straight_events, "step")[4:]):
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    after_resume, after_straight = torch.load(resumed, weights_only=True), torch.load(straight, weights_only=True)
    for name, value in after_straight["model"].items():
        torch.testing.assert_close(after_resume["model"][name], value)
    assert after_resume["epoch"] == after_straight["epoch"] == 2


class _ClosedAfterFirstLine(io.StringIO):
    """stdout whose reader goes away after one line, like `dptui --headless | head -1`."""

    def write(self, text: str) -> int:
        if self.getvalue():
            raise BrokenPipeError(32, "Broken pipe")
        return super().write(text)


@pytest.mark.parametrize("mode", [[], ["--json"]], ids=["text", "json"])
def test_a_closed_stdout_stops_quietly_with_status_0(capsys, monkeypatch, mode) -> None:
    stdout = _ClosedAfterFirstLine()
    monkeypatch.setattr(sys, "stdout", stdout)
    code = main(["--headless", *mode, "--devices", "cpu:0", "--seed", "0", "--epochs", "100000",
                 "--telemetry-interval", "0.2"])
    err = capsys.readouterr().err
    assert code == EXIT_OK  # not "training failed: BrokenPipeError" (1)
    assert err == ""
    assert len(stdout.getvalue().splitlines()) == 1  # and it stopped instead of training on


# ------------------------------------------------------------------ the real console script


def _spawn(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [console_script(), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )


def test_console_script_bad_device_and_good_run() -> None:
    # Started together: each pays the interpreter and torch start-up, in parallel.
    bad = _spawn("--headless", "--devices", "gpu:0")
    good = _spawn("--headless", "--no-telemetry", "--devices", THREE, "--seed", "0")
    bad_out, bad_err = bad.communicate(timeout=60)
    good_out, good_err = good.communicate(timeout=60)

    assert bad.returncode == EXIT_USAGE
    assert bad_out == ""
    assert len(bad_err.splitlines()) == 1 and "gpu:0" in bad_err and "Traceback" not in bad_err

    assert good.returncode == EXIT_OK, good_err
    lines = good_out.splitlines()
    assert lines[0] == "Use 3 devices: cpu:0, cpu:1, cpu:2"
    assert lines.count("Outside: input size torch.Size([30, 5]) output size torch.Size([30, 2])") == 3
    assert lines[-1].startswith("final loss ") and len(lines[-1].split()[-1].split(".")[1]) == 6
    assert good_err == ""


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child is POSIX")
def test_ctrl_c_stops_at_a_step_boundary_prints_the_summary_and_exits_130(tmp_path: Path) -> None:
    ck = tmp_path / "interrupted.pt"
    proc = _spawn("--headless", "--no-telemetry", "--model", "mlp", "--epochs", "50", "--devices", "cpu:0,cpu:1",
                  "--seed", "0", "--checkpoint", str(ck))
    try:
        seen = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, f"dptui ended before its first step: {proc.stderr.read()}"
            seen.append(line)
            if line.startswith("Outside:"):
                break
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = "".join(seen) + out
    assert proc.returncode == EXIT_INTERRUPTED, err
    assert "stopped" in out
    assert out.splitlines()[-1].startswith("final loss ")
    assert "Traceback" not in err
    assert "stopping at the next step boundary" in err
    # Stopped long before 50 epochs, and the checkpoint was written on stop.
    state = torch.load(ck, weights_only=True)
    assert state["epoch"] == 1 and state["step"] >= 1
    assert out.count("Outside:") == state["step"]
