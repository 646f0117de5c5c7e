"""dpengine/run/checkpoint.py: one reader and writer for checkpoints, and each --resume file read once."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

import dpengine.run.checkpoint as checkpoint_module
from dpengine.run.checkpoint import CheckpointError, check_fits, read_checkpoint, save_checkpoint
from dpengine.run.options import RunOptions
from dpengine.run.pending import PendingChanges
from dpengine.run.run_state import RunState
from dpengine.run.trainer import Trainer
from dpengine.run.workloads import builtin_workload
from tui.cli import main


def momentum_trainer(**options) -> Trainer:
    # SGD with momentum: optimizer state that training changes in place.
    workload = dataclasses.replace(
        builtin_workload("seed", 3), optimizer_factory=lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9)
    )
    return Trainer(workload, ["cpu:0", "cpu:1"], RunOptions(seed=3, telemetry_interval=None, **options))


def test_a_file_that_is_not_a_dptui_checkpoint_is_one_line_naming_it(tmp_path: Path) -> None:
    junk = tmp_path / "junk.pt"
    junk.write_text("not a checkpoint\n")
    with pytest.raises(CheckpointError, match=r"junk\.pt: not a checkpoint torch can load") as caught:
        read_checkpoint(junk)
    assert "\n" not in str(caught.value)
    other = tmp_path / "other.pt"
    save_checkpoint({"weights": torch.zeros(2)}, other)
    with pytest.raises(CheckpointError, match=r"other\.pt: not a dptui checkpoint \(expected the keys model, "):
        read_checkpoint(other)
    assert not (tmp_path / "other.pt.partial").exists()  # written whole, then renamed


def test_a_checkpoint_read_once_restarts_the_same_run_every_time(tmp_path: Path) -> None:
    path = tmp_path / "one.pt"
    assert momentum_trainer(epochs=1, checkpoint=path).run().stopped is False
    saved = read_checkpoint(path)
    before = {k: v.clone() for k, v in saved.state["optimizer"]["state"][0].items() if isinstance(v, torch.Tensor)}
    first = momentum_trainer(epochs=2, resume=saved).run()
    second = momentum_trainer(epochs=2, resume=saved).run()  # as `r` in the UI restarts
    assert (first.epochs, first.steps) == (second.epochs, second.steps) == (2, 8)
    assert first.final_loss == second.final_loss
    for key, value in before.items():
        torch.testing.assert_close(saved.state["optimizer"]["state"][0][key], value)  # not trained in place
    check_fits(saved, builtin_workload("seed", 0), None)
    with pytest.raises(CheckpointError, match="does not fit workload 'mlp'"):
        check_fits(saved, builtin_workload("mlp", 0), None)


def test_the_cli_reads_a_resume_file_once(tmp_path: Path, capsys, monkeypatch) -> None:
    path = tmp_path / "one.pt"
    common = ["--headless", "--no-telemetry", "--devices", "cpu:0,cpu:1", "--every", "0", "--seed", "3"]
    assert main([*common, "--epochs", "1", "--checkpoint", str(path)]) == 0
    reads: list[Path] = []
    load = checkpoint_module.load_checkpoint
    monkeypatch.setattr(checkpoint_module, "load_checkpoint", lambda p: reads.append(Path(p)) or load(p))
    assert main([*common, "--epochs", "2", "--resume", str(path)]) == 0
    assert reads == [path]
    assert "epoch 2:" in capsys.readouterr().out


def test_run_counters_carry_over_whole() -> None:
    run = RunState(started=0.0)
    run.begin_epoch()
    run.after_step(10, 0.5)
    run.after_step(4, 0.25)
    carried = RunState(started=0.0)
    carried.go_on_from(run.counters())
    assert carried.counters() == run.counters()
    assert carried.final_loss() == run.final_loss() == pytest.approx((10 * 0.5 + 4 * 0.25) / 14)


def test_pending_changes_keep_the_newest_until_applied() -> None:
    pending = PendingChanges()
    assert not pending and pending.take() is None
    first = pending.ask(batch_size=60)
    devices = pending.ask(devices=("cpu:0",))
    newer = pending.ask(batch_size=90)
    assert [c.seq for c in (first, devices, newer)] == [1, 2, 3]
    assert pending.waiting() == (devices, newer)
    pending.applied(2)  # someone else applied up to the device change
    assert pending.waiting() == (newer,)
    taken = pending.take()
    assert (taken.batch_size, taken.devices, taken.seq) == (90, None, 3) and not pending
    assert pending.ask(batch_size=5, seq=9).seq == 9 and pending.ask(batch_size=6).seq == 10


def test_a_save_reaches_the_disk_before_the_rename_and_the_rename_after(tmp_path: Path, monkeypatch) -> None:
    """fsync of the file, then the rename, then fsync of its folder: a power loss leaves old or new."""
    order: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(descriptor: int) -> None:
        order.append(f"fsync {os.readlink(f'/proc/self/fd/{descriptor}')}")
        real_fsync(descriptor)

    def replace(source, target) -> None:
        order.append(f"rename {Path(source).name} -> {Path(target).name}")
        real_replace(source, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = tmp_path / "run.pt"
    save_checkpoint({"weights": torch.ones(3)}, path)
    assert order == [f"fsync {tmp_path / 'run.pt.partial'}", "rename run.pt.partial -> run.pt", f"fsync {tmp_path}"]
    torch.testing.assert_close(torch.load(path)["weights"], torch.ones(3))


def test_a_failed_save_keeps_the_old_checkpoint_and_leaves_no_partial(tmp_path: Path) -> None:
    path = tmp_path / "run.pt"
    save_checkpoint({"weights": torch.ones(3)}, path)
    (tmp_path / "run.pt.partial").write_bytes(b"left by a save that was killed")
    with pytest.raises(Exception, match="pickle"):
        save_checkpoint({"weights": torch.zeros(3), "unpicklable": lambda: None}, path)
    assert not (tmp_path / "run.pt.partial").exists()
    torch.testing.assert_close(torch.load(path)["weights"], torch.ones(3))  # the old one, whole
    save_checkpoint({"weights": torch.zeros(3)}, path)  # and the next save replaces it
    torch.testing.assert_close(torch.load(path)["weights"], torch.zeros(3))


def test_checkpoint_every_0_is_the_one_line_usage_error(tmp_path: Path, capsys) -> None:
    """Not the engine's own check stopping the run with a traceback later."""
    code = main(["--headless", "--no-telemetry", "--devices", "cpu:0", "--epochs", "1",
                 "--checkpoint", str(tmp_path / "run.pt"), "--checkpoint-every", "0"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dptui: error: ") and "--checkpoint-every" in lines[0]
    assert not (tmp_path / "run.pt").exists()
