"""`dptui --headless`: the classic In Model / Outside text, epoch summaries and the final loss.

The expected per-step lines are computed from torch.chunk's rule and the seed workload's
batches (100 samples, batch 30: 30, 30, 30, 10), never pasted from a run.
"""

from __future__ import annotations

import io
import re

import pytest
import torch
from reference_loop import chunk_sizes, reference_run

from dpengine.eventlog.events import (
    ConfigChanged,
    EpochFinished,
    RunConfig,
    RunFailed,
    RunFinished,
    RunStarted,
    StateChanged,
    StepFinished,
    TelemetrySampled,
)
from dpengine.records import ReplicaRecord, StepRecord
from dpengine.run.workloads import builtin_workload
from dpengine.telemetry.sample import DeviceSample
from tui.cli import main
from tui.event_text import torch_size
from tui.headless import TextPrinter

SEED_BATCHES = [30, 30, 30, 10]  # 100 samples at batch 30
EPOCH_LINE = re.compile(r"^epoch (\d+): loss (\d+\.\d{6}), (\d+) steps, (\d+) samples, [\d,]+ samples/s$")
FINAL_LINE = re.compile(r"^final loss (\d+\.\d{6})$")


def expected_step_lines(batch: int, devices: list[str], features: int = 5, outputs: int = 2) -> list[str]:
    lines = [
        f"[{device}] In Model: input size torch.Size([{rows}, {features}]) "
        f"output size torch.Size([{rows}, {outputs}])"
        for device, rows in zip(devices, chunk_sizes(batch, len(devices)))
    ]
    lines.append(
        f"Outside: input size torch.Size([{batch}, {features}]) output size torch.Size([{batch}, {outputs}])"
    )
    return lines


def run_cli(capsys, *args: str) -> tuple[int, list[str], str]:
    code = main(["--headless", "--no-telemetry", *args])
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err


# ------------------------------------------------------------------ the whole text of a run


@pytest.mark.parametrize("count", [1, 2, 3])
def test_headless_text_for_virtual_cpu_devices(capsys, count: int) -> None:
    devices = [f"cpu:{i}" for i in range(count)]
    code, lines, err = run_cli(capsys, "--devices", ",".join(devices), "--seed", "7")

    assert code == 0
    assert err == ""
    expected = [f"Use {count} devices: {', '.join(devices)}"]
    for batch in SEED_BATCHES:
        expected += expected_step_lines(batch, devices)
    assert lines[: len(expected)] == expected
    # Spot-check the rule itself on the three-device case the issue spells out.
    if count == 3:
        assert [chunk_sizes(b, 3) for b in SEED_BATCHES] == [[10, 10, 10]] * 3 + [[4, 4, 2]]
    if count == 2:
        assert [chunk_sizes(b, 2) for b in SEED_BATCHES] == [[15, 15]] * 3 + [[5, 5]]

    rest = lines[len(expected) :]
    assert len(rest) == 2, rest
    epoch = EPOCH_LINE.match(rest[0])
    final = FINAL_LINE.match(rest[1])
    assert epoch and final, rest
    assert (epoch[1], epoch[3], epoch[4]) == ("1", "4", "100")
    assert epoch[2] == final[1]  # one epoch: the final loss is that epoch's mean loss

    # The loss is the one a plain single-process loop gets on the same batches.
    ref = reference_run(builtin_workload("seed", 7), seed=7, epochs=1)
    assert float(final[1]) == pytest.approx(ref.epoch_losses[-1], abs=2e-6)


def test_every_thins_the_step_lines_but_keeps_the_summary(capsys) -> None:
    devices = ["cpu:0", "cpu:1"]
    code, lines, _ = run_cli(capsys, "--devices", "cpu:0,cpu:1", "--seed", "1", "--every", "3")
    assert code == 0
    # Steps 1 and 4 of 4.
    expected = ["Use 2 devices: cpu:0, cpu:1"]
    expected += expected_step_lines(SEED_BATCHES[0], devices) + expected_step_lines(SEED_BATCHES[3], devices)
    assert lines[:-2] == expected
    assert EPOCH_LINE.match(lines[-2]) and FINAL_LINE.match(lines[-1])

    code, lines, _ = run_cli(capsys, "--devices", "cpu:0,cpu:1", "--seed", "1", "--every", "0")
    assert code == 0
    assert len(lines) == 3
    assert lines[0] == "Use 2 devices: cpu:0, cpu:1"
    assert EPOCH_LINE.match(lines[1]) and FINAL_LINE.match(lines[2])


def test_several_epochs_print_one_summary_each_and_the_last_loss(capsys) -> None:
    code, lines, _ = run_cli(capsys, "--devices", "cpu:0,cpu:1,cpu:2", "--seed", "3", "--epochs", "3", "--every", "0")
    assert code == 0
    summaries = [EPOCH_LINE.match(line) for line in lines[1:-1]]
    assert all(summaries) and [m[1] for m in summaries] == ["1", "2", "3"]
    assert FINAL_LINE.match(lines[-1])[1] == summaries[-1][2]
    ref = reference_run(builtin_workload("seed", 3), seed=3, epochs=3)
    for match, expected in zip(summaries, ref.epoch_losses):
        assert float(match[2]) == pytest.approx(expected, abs=2e-6)
    assert float(summaries[-1][2]) < float(summaries[0][2])  # it learns


def test_auto_devices_say_why_they_are_virtual(capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("auto picks the GPUs here")
    code, lines, _ = run_cli(capsys, "--seed", "0", "--every", "0")
    assert code == 0
    assert lines[0] == "no CUDA device found: using 2 virtual CPU devices"
    assert lines[1] == "Use 2 devices: cpu:0, cpu:1"


# ------------------------------------------------------------------ the printer on its own


def _record(devices: list[str], rows: list[int]) -> StepRecord:
    replicas = tuple(
        ReplicaRecord(index=i, device=d, chunk_size=r, input_shapes=((r, 5),), output_shapes=((r, 2),),
                      forward_ms=1.0, memory_bytes=100)
        for i, (d, r) in enumerate(zip(devices, rows))
    )
    total = sum(rows)
    return StepRecord(step=1, dim=0, batch_size=total, input_shapes=((total, 5),), output_shapes=((total, 2),),
                      replicas=replicas, scatter_ms=0.1, replicate_ms=0.1, apply_ms=1.0, gather_ms=0.1,
                      total_ms=1.5)


def _step(step: int, devices: list[str], rows: list[int]) -> StepFinished:
    total = sum(rows)
    return StepFinished(epoch=1, step=step, step_in_epoch=step, steps_in_epoch=4, batch_size=total,
                        input_shape=(total, 5), output_shape=(total, 2), loss=0.5, samples_per_s=1000.0,
                        record=_record(devices, rows), seconds=0.1)


def _printer(every: int = 1) -> tuple[TextPrinter, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    return TextPrinter(out, err, every=every), out, err


def test_printer_lines_for_each_event() -> None:
    printer, out, err = _printer()
    config = RunConfig(workload="seed", backend="dp", devices=("cpu:0", "cpu:1", "cpu:2"),
                       available_devices=("cpu:0", "cpu:1", "cpu:2", "cpu:3"), batch_size=30, epochs=1,
                       lr=0.05, seed=0, samples=100)
    printer(RunStarted(config))
    printer(_step(1, ["cpu:0", "cpu:1", "cpu:2"], [4, 4, 2]))
    printer(TelemetrySampled((DeviceSample("cpu:0", "virtual", 0.0),)))
    printer(StateChanged("paused"))
    printer(ConfigChanged(60, ("cpu:1",), 5))
    printer(EpochFinished(epoch=1, steps=4, samples=100, mean_loss=0.1234564, seconds=0.01, samples_per_s=12345.6))
    printer(RunFinished(final_loss=0.1234564, epochs=1, steps=4, samples=100, seconds=0.01, stopped=True))
    assert out.getvalue().splitlines() == [
        "Use 3 devices: cpu:0, cpu:1, cpu:2",
        *expected_step_lines(10, ["cpu:0", "cpu:1", "cpu:2"]),
        "paused",
        "from step 5: batch 60 on cpu:1",
        "epoch 1: loss 0.123456, 4 steps, 100 samples, 12,346 samples/s",
        "stopped at a step boundary",
        "final loss 0.123456",
    ]
    assert err.getvalue() == ""

    printer(RunFailed(error="replica 2 on cpu:2 failed: RuntimeError: boom", error_type="RuntimeError",
                      replica=2, device="cpu:2", traceback="Traceback (most recent call last): ..."))
    assert err.getvalue() == "dptui: training failed: replica 2 on cpu:2 failed: RuntimeError: boom\n"
    assert "Traceback" not in out.getvalue() + err.getvalue()


def test_printer_every_counts_global_steps() -> None:
    printer, out, _ = _printer(every=2)
    for step in range(1, 6):
        printer(_step(step, ["cpu:0"], [step]))
    outside = [line for line in out.getvalue().splitlines() if line.startswith("Outside")]
    assert outside == [f"Outside: input size {torch_size((n, 5))} output size {torch_size((n, 2))}" for n in (1, 3, 5)]


def test_printer_finished_without_loss_still_prints_a_summary() -> None:
    printer, out, _ = _printer()
    printer(RunFinished(final_loss=None, epochs=0, steps=0, samples=0, seconds=0.0, stopped=False))
    assert out.getvalue() == "no final loss: 0 steps run\n"  # --epochs 0: no silent exit


def test_printer_writes_to_the_current_stdout(capsys) -> None:
    # Built without streams, it writes where sys.stdout points now, not at import time.
    printer = TextPrinter()
    printer(RunFinished(final_loss=1.5, epochs=1, steps=1, samples=1, seconds=0.0, stopped=False))
    assert capsys.readouterr().out == "final loss 1.500000\n"


def test_torch_size_matches_torch() -> None:
    for shape in [(10, 5), (3,), (), (2, 3, 32, 32)]:
        assert torch_size(shape) == str(torch.Size(shape))
