"""Auto-balance in a training run: the trainer, its events, the CLI and the gradients."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixtures.slow_device import slow_device_workload

from dpengine.eventlog.events import SplitChanged, StepFinished, to_json_dict
from dpengine.run.options import RunOptions
from dpengine.run.trainer import Trainer
from dpengine.run.workloads import builtin_workload
from tui.cli import EXIT_OK, EXIT_USAGE, main

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
    trainer = Trainer(slow_device_workload(0), THREE,
                      RunOptions(seed=1, epochs=2, telemetry_interval=None, balance="auto"))
    events = run(trainer)
    steps = [e for e in events if isinstance(e, StepFinished)]
    changes = [e for e in events if isinstance(e, SplitChanged)]
    assert changes[0] == SplitChanged(1, "auto", ())
    by_balancer = [c for c in changes if c.by_balancer]
    assert by_balancer, changes
    assert all(c.request is None for c in changes)  # --balance and the balancer: nobody pressed a key
    # cpu:2 is twice as slow per row: over the second epoch it gets fewer rows than either other
    # device (summed, so that one step measured on a busy machine, or a probe share, cannot decide).
    second = [s.record for s in steps if s.epoch == 2]
    assert all(r.balanced for r in second)
    rows = [sum(r.chunk_sizes[i] for r in second) for i in range(3)]
    assert rows[2] < min(rows[:2]), rows
    # Every change is announced at the step that first runs with it.
    for change in by_balancer:
        assert steps[change.step - 1].record.split_weights == change.weights
    assert json.loads(json.dumps(to_json_dict(by_balancer[0])))["type"] == "split"


def test_set_balance_applies_at_the_next_step_and_weights_must_fit():
    trainer = Trainer(builtin_workload("seed", 3), THREE, RunOptions(seed=3, telemetry_interval=None))
    with pytest.raises(ValueError, match="one per device"):
        trainer.set_balance((1.0, 2.0))

    asked = []

    def on_step(event: StepFinished) -> None:
        if event.step == 1:
            asked.append(trainer.set_balance((2.0, 1.0, 1.0)))
            assert trainer.has_pending_change

    events = run(trainer, on_step)
    steps = [e for e in events if isinstance(e, StepFinished)]
    assert steps[0].record.chunk_sizes == (10, 10, 10)
    assert steps[1].record.chunk_sizes == (15, 8, 7) and steps[1].record.split == "weights"
    (change,) = [e for e in events if isinstance(e, SplitChanged)]
    assert change.step == 2 and change.balance == "weights" and change.weights == pytest.approx((0.5, 0.25, 0.25))
    assert change.request == asked[0]
    assert trainer.balance == (2.0, 1.0, 1.0)


def test_the_loss_curve_does_not_depend_on_the_split():
    def losses(balance) -> list[float]:
        trainer = Trainer(builtin_workload("mlp", 4), THREE,
                          RunOptions(seed=4, telemetry_interval=None, balance=balance))
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


# -- the DDP backend ---------------------------------------------------------------------------


def _ddp_run(balance, model: str = SLOW, epochs: int = 2) -> list:
    from dpengine.distributed import DdpTrainer, WorkloadSpec

    trainer = DdpTrainer(WorkloadSpec(model, seed=1), THREE,
                         RunOptions(seed=1, epochs=epochs, telemetry_interval=None, balance=balance))
    events = run(trainer)
    assert not [e for e in events if type(e).__name__ == "RunFailed"], events[-1]
    return events


def test_ddp_weights_cut_as_the_threaded_backend_and_train_alike():
    ddp = _ddp_run((2.0, 1.0, 1.0), model="seed", epochs=1)
    threaded = run(Trainer(builtin_workload("seed", 1), THREE,
                           RunOptions(seed=1, telemetry_interval=None, balance=(2.0, 1.0, 1.0))))
    ddp_steps = [e for e in ddp if isinstance(e, StepFinished)]
    dp_steps = [e for e in threaded if isinstance(e, StepFinished)]
    assert [s.record.chunk_sizes for s in ddp_steps] == [s.record.chunk_sizes for s in dp_steps]
    assert ddp_steps[0].record.chunk_sizes == (15, 8, 7)
    assert [s.loss for s in ddp_steps] == pytest.approx([s.loss for s in dp_steps], abs=1e-5)


def test_ddp_auto_balance_gives_every_rank_the_same_split_and_the_same_loss_curve():
    events = _ddp_run("auto")
    steps = [e for e in events if isinstance(e, StepFinished)]
    changes = [e for e in events if isinstance(e, SplitChanged) and e.by_balancer]
    assert changes, "the balancer never moved"
    last = steps[-2].record
    assert last.balanced and sum(last.chunk_sizes) == 60
    # rank 2 is twice as slow per row: it ends with fewer rows than either other rank.
    assert last.chunk_sizes[2] < min(last.chunk_sizes[:2])
    # The ranks agreed on every split (a disagreement would have failed the run or lost rows),
    # and the loss curve is the threaded even split's: the split never changes the gradients.
    even = run(Trainer(slow_device_workload(1), THREE, RunOptions(seed=1, epochs=2, telemetry_interval=None)))
    assert [s.loss for s in steps] == pytest.approx(
        [e.loss for e in even if isinstance(e, StepFinished)], abs=1e-5)


def test_ddp_set_balance_applies_at_the_next_step_on_every_rank():
    from dpengine.distributed import DdpTrainer, WorkloadSpec

    trainer = DdpTrainer(WorkloadSpec("seed", seed=3), THREE, RunOptions(seed=3, epochs=1, telemetry_interval=None))
    with pytest.raises(ValueError, match="one per device"):
        trainer.set_balance((1.0, 2.0))

    asked = []

    def on_step(event: StepFinished) -> None:
        if event.step == 1:
            asked.append(trainer.set_balance((2.0, 1.0, 1.0)))

    events = run(trainer, on_step)
    steps = [e for e in events if isinstance(e, StepFinished)]
    assert [s.record.chunk_sizes for s in steps[:2]] == [(10, 10, 10), (15, 8, 7)]
    (change,) = [e for e in events if isinstance(e, SplitChanged)]
    assert (change.step, change.balance, change.request) == (2, "weights", asked[0])
    # The host keeps what rank 0 applied: the same weights, as shares of the batch.
    assert trainer.balance == pytest.approx((0.5, 0.25, 0.25)) and not trainer.has_pending_change


def test_weights_asked_with_a_device_change_of_another_count_fall_back_to_even():
    trainer = Trainer(builtin_workload("seed", 3), THREE,
                      RunOptions(seed=3, telemetry_interval=None, balance=(3.0, 2.0, 1.0)))

    def on_step(event: StepFinished) -> None:
        if event.step == 1:
            trainer.set_devices(["cpu:0", "cpu:1"])

    events = run(trainer, on_step)
    steps = [e for e in events if isinstance(e, StepFinished)]
    assert steps[0].record.chunk_sizes == (15, 10, 5)
    assert steps[1].record.chunk_sizes == (15, 15) and steps[1].record.split == "even"
    changes = [e for e in events if isinstance(e, SplitChanged)]
    assert [(c.step, c.balance) for c in changes] == [(1, "weights"), (2, "even")]
