"""Issue 11: no run is lost to a signal, a bad path, a NaN or a stuck replica.

Signals go to real `python -m tui.cli` processes, sent once the run is provably mid-training
(its first step event was printed); every wait is for a condition, never a fixed pause.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tui.cli import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_TERMINATED, EXIT_USAGE, main

ROOT = Path(__file__).resolve().parents[1]
FIX = Path(__file__).resolve().parent / "fixtures" / "dptui_test_workloads.py"

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals and paths")


def spawn(*args: str, **popen) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "tui.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, **popen)


def read_until(stream, wanted, limit: int = 10_000) -> list[str]:
    """Lines of `stream` up to and including the first for which `wanted(line)` holds."""
    lines = []
    for _ in range(limit):
        line = stream.readline()
        assert line, f"the stream ended before the line wanted; it had: {lines[-5:]}"
        lines.append(line)
        if wanted(line):
            return lines
    raise AssertionError(f"no wanted line in {limit} lines")


def is_step(line: str) -> bool:
    return line.startswith("{") and json.loads(line)["type"] == "step"


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def usage_error(capsys, *argv: str) -> str:
    code = main(list(argv))
    captured = capsys.readouterr()
    assert code == EXIT_USAGE, captured
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dptui: error: "), lines
    assert "Traceback" not in captured.err and captured.out == ""
    return lines[0]


# ------------------------------------------------------------------ 1. SIGTERM, --checkpoint-every


@pytest.mark.parametrize("backend", ["dp", "ddp"])
def test_sigterm_stops_at_a_step_boundary_saves_and_exits_143(tmp_path: Path, backend: str) -> None:
    ck = tmp_path / "run.pt"
    proc = spawn("--headless", "--json", "--no-telemetry", "--backend", backend, "--devices", "cpu:0,cpu:1",
                 "--model", "mlp", "--epochs", "1000", "--seed", "0", "--checkpoint", str(ck))
    seen = read_until(proc.stdout, is_step)
    proc.send_signal(signal.SIGTERM)
    out, err = finish(proc)
    events = [json.loads(line) for line in [*seen, *out.splitlines()] if line.strip()]
    assert proc.returncode == EXIT_TERMINATED, err
    assert "Traceback" not in err and "stopping at the next step boundary" in err
    last = events[-1]
    assert last["type"] == "run_finished" and last["stopped"] and last["final_loss"] is not None
    steps = [e for e in events if e["type"] == "step"]
    assert torch.load(ck, weights_only=True)["step"] == len(steps) == last["steps"]


@pytest.mark.parametrize("backend", ["dp", "ddp"])
def test_checkpoint_every_bounds_what_a_kill_9_loses(tmp_path: Path, backend: str) -> None:
    ck = tmp_path / "run.pt"
    proc = spawn("--headless", "--json", "--no-telemetry", "--backend", backend, "--devices", "cpu:0,cpu:1",
                 "--model", "mlp",
                 "--epochs", "1000", "--seed", "0", "--checkpoint", str(ck), "--checkpoint-every", "2")
    read_until(proc.stdout, lambda line: is_step(line) and json.loads(line)["step"] == 5)
    proc.kill()  # no handler runs: only what was saved before survives
    finish(proc)
    assert proc.returncode == -signal.SIGKILL
    # Step 5 started only after step 4's save: at most 2 steps are lost.
    assert torch.load(ck, weights_only=True)["step"] >= 4


def test_a_failed_save_leaves_no_partial_and_the_next_save_replaces_a_stale_one(tmp_path: Path) -> None:
    from dpengine.run.checkpoint import save_checkpoint

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot be saved")

    path = tmp_path / "run.pt"
    partial = tmp_path / "run.pt.partial"
    partial.write_bytes(b"left by a save that was killed")
    with pytest.raises(RuntimeError, match="cannot be saved"):
        save_checkpoint({"model": {"w": torch.ones(2)}, "bad": Unpicklable()}, path)
    assert not partial.exists() and not path.exists()
    partial.write_bytes(b"left by a save that was killed")
    save_checkpoint({"w": torch.ones(2)}, path)
    assert not partial.exists() and torch.equal(torch.load(path, weights_only=True)["w"], torch.ones(2))


# ------------------------------------------------------------------ 2, 4. paths checked before training


def test_unwritable_checkpoint_and_log_paths_are_refused_before_training(capsys, tmp_path: Path) -> None:
    run = ["--headless", "--devices", "cpu:0"]
    assert "is a folder" in usage_error(capsys, *run, "--checkpoint", str(tmp_path))
    assert "does not exist" in usage_error(capsys, *run, "--checkpoint", str(tmp_path / "no" / "x.pt"))
    assert "cannot write" in usage_error(capsys, *run, "--log", "/dev/full")
    assert "is a folder" in usage_error(capsys, *run, "--log", str(tmp_path))
    if os.path.isdir("/sys"):
        assert "/sys/x.pt" in usage_error(capsys, *run, "--checkpoint", "/sys/x.pt")
        assert "/sys/x.jsonl" in usage_error(capsys, *run, "--log", "/sys/x.jsonl")
    assert "--checkpoint" in usage_error(capsys, *run, "--checkpoint-every", "5")
    assert list(tmp_path.iterdir()) == []  # no .partial, no probe left behind


def _limit_file_size() -> None:
    # Files this process writes may not pass 40 kB: the log fills that "disk" mid-run; the
    # checkpoint (a few kB) still fits. Ignored SIGXFSZ turns the limit into EFBIG.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, 40_000))


def test_a_log_write_error_mid_run_is_one_line_a_clean_stop_and_exit_1(tmp_path: Path) -> None:
    log, ck = tmp_path / "run.jsonl", tmp_path / "run.pt"
    proc = spawn("--headless", "--no-telemetry", "--every", "0", "--devices", "cpu:0,cpu:1", "--epochs", "1000",
                 "--seed", "0", "--log", str(log), "--checkpoint", str(ck), preexec_fn=_limit_file_size)
    out, err = finish(proc)
    assert proc.returncode == EXIT_FAILED, err
    assert err.splitlines() == [f"dptui: error: --log {log}: File too large; stopping at the next step boundary"]
    assert "stopped at a step boundary" in out and "final loss" in out
    state = torch.load(ck, weights_only=True)
    assert 0 < state["step"] < 4000


# ------------------------------------------------------------------ 3. --log in the UI; SIGTERM in the UI


def test_the_ui_writes_log_and_sigterm_quits_it_with_143(tmp_path: Path) -> None:
    import pty

    log = tmp_path / "ui.jsonl"
    leader, follower = pty.openpty()
    env = dict(os.environ, TERM="xterm-256color", COLUMNS="100", LINES="30")
    proc = subprocess.Popen([sys.executable, "-m", "tui.cli", "--no-telemetry", "--devices", "cpu:0,cpu:1",
                             "--log", str(log)], stdin=follower, stdout=follower, stderr=follower, env=env,
                            cwd=ROOT, start_new_session=True)
    os.close(follower)
    try:
        deadline = time.monotonic() + 90
        while '"type":"step"' not in (log.read_text() if log.exists() else ""):
            assert proc.poll() is None and time.monotonic() < deadline, "the UI trained no step"
            _drain(leader)
        proc.send_signal(signal.SIGTERM)
        while proc.poll() is None:
            assert time.monotonic() < deadline, "SIGTERM did not end the UI"
            _drain(leader)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        os.close(leader)
    assert proc.returncode == EXIT_TERMINATED
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert events[0]["type"] == "run_started"
    assert events[-1]["type"] == "run_finished" and events[-1]["stopped"]


def _drain(fd: int) -> None:
    """Read what the app drew, so that it never blocks on a full terminal."""
    import select

    if select.select([fd], [], [], 0.05)[0]:
        try:
            os.read(fd, 65536)
        except OSError:
            pass


# ------------------------------------------------------------------ 5. device numbers


@pytest.mark.parametrize("spec", ["cpu:0,cpu:128", "cpu:0,cpu:256", "cpu:1000000", "cpu:64", "cuda:300", "256"])
def test_device_numbers_past_the_maximum_are_refused(capsys, spec: str) -> None:
    line = usage_error(capsys, "--headless", "--devices", spec)
    assert "cpu:63" in line or "cuda:127" in line


def test_the_highest_virtual_device_runs_under_its_own_name(capsys) -> None:
    assert main(["--headless", "--no-telemetry", "--devices", "cpu:0,cpu:63", "--every", "1"]) == EXIT_OK
    assert "Use 2 devices: cpu:0, cpu:63" in capsys.readouterr().out


# ------------------------------------------------------------------ 6. the second Ctrl-C


def test_a_second_ctrl_c_gives_up_within_a_second_with_replicas_stuck(tmp_path: Path) -> None:
    proc = spawn("--headless", "--no-telemetry", "--devices", "cpu:0,cpu:1", "--model", f"{FIX}:stuck_after_step_1",
                 "--epochs", "5")
    read_until(proc.stdout, lambda line: line.startswith("Outside:"))  # step 1 done; step 2 is stuck
    proc.send_signal(signal.SIGINT)
    read_until(proc.stderr, lambda line: "stopping at the next step boundary" in line)
    proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    try:
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    elapsed = time.monotonic() - sent
    assert proc.returncode == EXIT_INTERRUPTED
    assert elapsed < 1.5, f"exited {elapsed:.1f} s after the second Ctrl-C"
    assert "Traceback" not in proc.stderr.read()


# ------------------------------------------------------------------ 8. values that cannot train


@pytest.mark.parametrize("lr", ["inf", "1e400", "nan", "-inf"])
def test_a_learning_rate_that_is_not_finite_is_refused(capsys, lr: str) -> None:
    assert "learning rate" in usage_error(capsys, "--headless", f"--lr={lr}")


def test_a_non_finite_loss_stops_the_run_naming_the_step_and_keeps_finite_weights(capsys, tmp_path: Path) -> None:
    ck = tmp_path / "run.pt"
    code = main(["--headless", "--no-telemetry", "--devices", "cpu:0", "--every", "0", "--epochs", "3",
                 "--model", f"{FIX}:nan_at_step_3", "--checkpoint", str(ck)])
    captured = capsys.readouterr()
    assert code == EXIT_FAILED
    lines = captured.err.splitlines()
    assert len(lines) == 1 and "step 3" in lines[0] and "nan" in lines[0], lines
    state = torch.load(ck, weights_only=True)
    assert state["step"] == 2
    assert all(torch.isfinite(t).all() for t in state["model"].values())


# ------------------------------------------------------------------ 9. smaller ones


def test_epochs_0_still_prints_a_summary(capsys) -> None:
    assert main(["--headless", "--no-telemetry", "--devices", "cpu:0", "--epochs", "0"]) == EXIT_OK
    assert capsys.readouterr().out.splitlines()[-1] == "no final loss: 0 steps run"


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("true",))


def test_a_malicious_checkpoint_is_refused_without_unsafe_advice(capsys, tmp_path: Path) -> None:
    evil = tmp_path / "evil.pt"
    torch.save({"model": _RunsCode(), "optimizer": {}, "epoch": 0, "position": 0, "step": 0}, evil)
    line = usage_error(capsys, "--headless", "--resume", str(evil))
    assert "refused" in line and "system" in line
    assert "weights_only" not in line and "False" not in line


@pytest.mark.parametrize("flag", ["--telemetry-interval", "--step-timeout"])
def test_other_times_must_be_finite_too(capsys, flag: str) -> None:
    assert "finite" in usage_error(capsys, "--headless", flag, "inf")
