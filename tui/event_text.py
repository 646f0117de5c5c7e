"""Events as text: the lines the UI's log shows and the headless printer prints.

Both read the same events; where they word one alike (the model lines, a config change, a
pause) they share the function, and where the headless output keeps the DataParallel
tutorial's wording and the log is terser, both wordings live here side by side.
"""

from __future__ import annotations

from dpengine.eventlog.events import (
    ConfigChanged,
    EpochFinished,
    RunConfig,
    RunFailed,
    RunFinished,
    SplitChanged,
    StateChanged,
    StepFinished,
)
from dpengine.records import Shape

from . import format as fmt


def torch_size(shape: Shape | None) -> str:
    """How torch prints a shape: torch.Size([10, 5])."""
    return f"torch.Size([{', '.join(str(n) for n in shape or ())}])"


def model_lines(event: StepFinished) -> list[str]:
    """The classic DataParallel tutorial's lines: one per replica, then the whole batch."""
    lines = []
    for replica in event.record.replicas:
        inp = replica.input_shapes[0] if replica.input_shapes else None
        out = replica.output_shapes[0] if replica.output_shapes else None
        lines.append(f"[{replica.device}] In Model: input size {torch_size(inp)} output size {torch_size(out)}")
    lines.append(f"Outside: input size {torch_size(event.input_shape)} output size {torch_size(event.output_shape)}")
    return lines


def config_line(event: ConfigChanged) -> str:
    return f"from step {event.step}: batch {event.batch_size} on {', '.join(event.devices)}"


def split_line(event: SplitChanged) -> str:
    """"from step 9: split auto, balancer: 40/40/20%" or "from step 1: split even"."""
    shares = "/".join(f"{100 * w:.0f}" for w in event.weights)
    who = ", balancer" if event.by_balancer else ""
    words = f"{event.balance}{who}: {shares}%" if event.weights else event.balance
    return f"from step {event.step}: split {words}"


def state_line(event: StateChanged) -> str:
    return event.state


# -- the headless printer ---------------------------------------------------------------------


def devices_line(config: RunConfig) -> str:
    return f"Use {len(config.devices)} devices: {', '.join(config.devices)}"


def epoch_summary(event: EpochFinished) -> str:
    return (
        f"epoch {event.epoch}: loss {event.mean_loss:.6f}, {event.steps} steps, "
        f"{event.samples} samples, {event.samples_per_s:,.0f} samples/s"
    )


def result_lines(event: RunFinished) -> list[str]:
    lines = ["stopped at a step boundary"] if event.stopped else []
    if event.final_loss is not None:
        lines.append(f"final loss {event.final_loss:.6f}")
    else:  # --epochs 0, or stopped before the first step: still a summary
        lines.append(f"no final loss: {event.steps} steps run")
    return lines


def failure_line(event: RunFailed) -> str:
    return f"dptui: training failed: {event.error}"


# -- the UI's log -----------------------------------------------------------------------------


def started_log_line(config: RunConfig) -> str:
    epochs = "until stopped" if config.epochs is None else f"{config.epochs} epoch(s)"
    return (
        f"run started: {config.workload} on {', '.join(config.devices)}, "
        f"batch {config.batch_size}, {epochs}, lr {fmt.number(config.lr)}, seed {config.seed}"
    )


def epoch_log_line(event: EpochFinished) -> str:
    return (
        f"epoch {event.epoch} done: mean loss {fmt.loss(event.mean_loss)}, {event.samples} samples "
        f"in {event.seconds:.2f} s ({fmt.rate(event.samples_per_s)} samples/s)"
    )


def finished_log_line(event: RunFinished) -> str:
    what = "stopped" if event.stopped else "finished"
    return (
        f"run {what}: {event.epochs} epoch(s), {event.steps} steps, {event.samples} samples "
        f"in {event.seconds:.1f} s, loss {fmt.loss(event.final_loss)}"
    )


def failed_log_line(event: RunFailed) -> str:
    text = f"run failed: {event.error}"
    if event.device and event.device not in event.error:
        replica = f"replica {event.replica} on " if event.replica is not None else ""
        text += f" ({replica}{event.device})"
    return text
