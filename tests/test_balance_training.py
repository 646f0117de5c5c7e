"""Auto-balance in a training run: the trainer, its events, the CLI and the gradients."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from dpengine.events import SplitChanged, StepFinished, to_json_dict
from dpengine.trainer import Trainer
from dpengine.workloads import builtin_workload
from tui.cli import EXIT_OK, EXIT_USAGE, main

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from slow_device import slow_device_workload  # noqa: E402

THREE = ["cpu:0", "cpu:1", "cpu:2"]
SLOW = str(Path(__file__).parent / "fixtures" / "slow_device.py") + ":slow_device_workload"


def run(trainer: Trainer, on_step=None) -> list:
    events = []

    def record(event) -> None:
        events.append(event)
        if on_step is not None and isinstance(event, StepFinished):
            on_step(event)

    trainer.subscribe(record)
    trainer.run()
    return events


def test_auto_balance_moves_rows_off_the_slow_device_and_says_so():
    trainer = Trainer(slow_device_workload(0), THREE, seed=1, epochs=2, telemetry_interval=None, balance="auto")
    events = run(trainer)
    steps = [e for e in events if isinstance(e, StepFinished)]
    changes = [e for e in events if isinstance(e, SplitChanged)]
    assert changes[0] == SplitChanged(1, "auto", ())
    by_balancer = [c for c in changes if c.by_balancer]
    assert by_balancer, changes
    # cpu:2 is twice as slow per row: it ends with fewer rows than either other device.
    last = steps[-2].record  # the last step is the epoch's (here full) batch too; any full one will do
    assert last.balanced and last.chunk_sizes[2] < min(last.chunk_sizes[:2])
    # Every change is announced at the step that first runs with it.
    for change in by_balancer:
        assert steps[change.step - 1].record.split_weights == change.weights
    assert json.loads(json.dumps(to_json_dict(by_balancer[0])))["type"] == "split"


def test_set_balance_applies_at_the_next_step_and_weights_must_fit():
    trainer = Trainer(builtin_workload("seed", 3), THREE, seed=3, telemetry_interval=None)
    with pytest.raises(ValueError, match="one per device"):
        trainer.set_balance((1.0, 2.0))

    def on_step(event: StepFinished) -> None:
        if event.step == 1:
            trainer.set_balance((2.0, 1.0, 1.0))
            assert trainer.has_pending_change

    events = run(trainer, on_step)
    steps = [e for e in events if isinstance(e, StepFinished)]
    assert steps[0].record.chunk_sizes == (10, 10, 10)
    assert steps[1].record.chunk_sizes == (15, 8, 7) and steps[1].record.split == "weights"
    (change,) = [e for e in events if isinstance(e, SplitChanged)]
    assert change.step == 2 and change.balance == "weights" and change.weights == pytest.approx((0.5, 0.25, 0.25))
    assert trainer.balance == (2.0, 1.0, 1.0)


def test_the_loss_curve_does_not_depend_on_the_split():
    def losses(balance) -> list[float]:
        trainer = Trainer(builtin_workload("mlp", 4), THREE, seed=4, telemetry_interval=None, balance=balance)
        return [e.loss for e in run(trainer) if isinstance(e, StepFinished)]

    even = losses("even")
    for other in (losses((5.0, 2.0, 1.0)), losses((1.0, 1.0, 6.0))):
        assert other == pytest.approx(even, rel=1e-4, abs=1e-6)


def test_cli_balance_auto_logs_every_change_of_split(tmp_path, capsys):
    log = tmp_path / "run.jsonl"
    code = main(["--headless", "--devices", ",".join(THREE), "--model", SLOW, "--balance", "auto",
                 "--seed", "1", "--every", "0", "--no-telemetry", "--log", str(log)])
    out = capsys.readouterr().out
    assert code == EXIT_OK
    events = [json.loads(line) for line in log.read_text().splitlines()]
    splits = [e for e in events if e["type"] == "split"]
    assert splits[0]["balance"] == "auto" and any(s["by_balancer"] for s in splits)
    assert "split auto, balancer:" in out
    steps = [e for e in events if e["type"] == "step"]
    assert steps[-1]["engine"]["balanced"] and steps[-1]["engine"]["even_ms"] > 0


@pytest.mark.parametrize("value, fragment", [("fast", "expected even, auto or weights"),
                                             ("1,2", "2 weights"), ("0,0,0", "not all zero")])
def test_cli_bad_balance_is_one_line_and_exit_2(capsys, value, fragment):
    code = main(["--headless", "--devices", ",".join(THREE), "--balance", value])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE
    assert err.count("\n") == 1 and fragment in err and "Traceback" not in err
