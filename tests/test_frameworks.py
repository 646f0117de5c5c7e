"""dptui run on the real frameworks people train with (CPU, gloo, 2 ranks, a tiny random model)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_ddp_run import free_port_pair, json_events, of_type

FRAMEWORKS = Path(__file__).parent / "fixtures" / "frameworks"
LIGHTNING = str(FRAMEWORKS / "lightning_fit.py")
ACCELERATE = str(FRAMEWORKS / "accelerate_loop.py")
# accelerate's own launcher, as a module and as the console script pip puts beside python.
ACCELERATE_LAUNCH = {"module": ["-m", "accelerate.commands.launch"], "script": ["accelerate", "launch"]}
SLOWED_MS = 50.0  # what the fixtures' SLOW_S adds to rank 1's phase
PHASES = ("data_ms", "forward_ms", "backward_ms", "comm_wait_ms", "optimizer_ms")


def two_cpu_ranks() -> list[str]:
    """accelerate launch's options for 2 CPU ranks, on a free port: its default, 29500, is every
    other launch's too, and the suite runs tests side by side."""
    return ["--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port_pair())]


def with_python_bin_on_path() -> dict[str, str]:
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def dptui_run(launch: str, script: str, *args: str) -> subprocess.CompletedProcess:
    """`launch`: "torchrun" (dptui run --nproc-per-node 2), "self" (plain dptui run: the script's
    framework starts its other ranks itself), or accelerate's launcher ("module" or "script")."""
    ddp = ["--nproc-per-node", "2"] if launch == "torchrun" else []
    target = [*ACCELERATE_LAUNCH[launch], *two_cpu_ranks()] if launch in ACCELERATE_LAUNCH else []
    return subprocess.run([sys.executable, "-m", "tui.cli", "run", *ddp, "--headless", "--json", "--no-telemetry",
                           *target, script, *args], capture_output=True, text=True, timeout=300,
                          env=with_python_bin_on_path())


def assert_steps_phases_and_verdict(events: list[dict], steps_per_rank: int, phase: str) -> None:
    steps = of_type(events, "rank_step")
    assert sorted((s["rank"], s["step"]) for s in steps) == [(r, s) for r in range(2) for s in range(steps_per_rank)]
    for step in steps:
        # Lightning runs forward and backward inside optimizer.step(closure): they are not optimizer time.
        assert sum(step[p] for p in PHASES) <= step["total_ms"] * 1.0001 + 1e-6, step
        assert step["forward_start_ms"] < step["backward_start_ms"] < step["optimizer_start_ms"], step
    verdicts = of_type(events, "straggler")
    if phase == "none":
        # A busy machine (CI, parallel test workers) can make a rank a few ms slower for real, and
        # dptui rightly says so; nothing near the 50 ms the slowed cases add may be blamed.
        assert not [v for v in verdicts if v["excess_ms"] > SLOWED_MS / 2], verdicts
    else:
        assert [(v["rank"], v["phase"]) for v in verdicts][:1] == [(1, phase)], verdicts


def assert_same_lines(watched: subprocess.CompletedProcess, plain: subprocess.CompletedProcess, steps: int) -> None:
    said = [f"rank 0 done: {steps} steps", f"rank 1 done: {steps} steps"]
    assert script_lines(json_events(watched.stdout)) == said
    # Plain, the ranks' unbuffered prints may share a line (their own race): the same text, though.
    assert all(line in plain.stdout for line in said) and len(plain.stdout.replace("\n", "")) == len("".join(said))


# gloo may abort a rank in interpreter teardown after its script ended (torch's own, seen now and then
# on FSDP runs): dptui says so in a notice, rightly, and the run still counts as finished.
TEARDOWN_ABORT = re.compile(r"^rank \d ended with SIGABRT in interpreter teardown after its script finished")


def unexpected_notices(events: list[dict]) -> list[dict]:
    return [n for n in of_type(events, "notice") if not TEARDOWN_ABORT.match(n["text"])]


def script_lines(events: list[dict]) -> list[str]:
    return sorted(e["line"] for e in of_type(events, "output") if e["stream"] == "stdout")


@pytest.mark.parametrize(("script", "launch", "phase"), [
    (LIGHTNING, "torchrun", "none"), (LIGHTNING, "torchrun", "data"), (LIGHTNING, "torchrun", "forward"),
    (LIGHTNING, "self", "forward"),  # "self", "none": in the test after this one
    (ACCELERATE, "torchrun", "none"), (ACCELERATE, "torchrun", "data"), (ACCELERATE, "module", "forward"),
    (ACCELERATE, "torchrun", "other"),  # work after the update (an EMA) was data: before the DataLoader's fetch
    (ACCELERATE, "script", "data")])
def test_lightning_and_accelerate_step_every_rank_with_disjoint_phases_and_the_right_verdict(script, launch, phase):
    # Lightning launching itself recorded rank 0 only, and its phases were wrong under every launch;
    # under `accelerate launch` dptui recorded no rank and said the script built no DataParallel.
    # Each validates every 5 steps here (VALIDATE_EVERY; Lightning's argument after accumulate_grad_batches).
    validate = ["1", str(VALIDATE_EVERY)] if script == LIGHTNING else [str(VALIDATE_EVERY)]
    done = dptui_run(launch, script, phase, "22", *validate)
    events = json_events(done.stdout)
    assert_finished(done, events, launcher=launch in ACCELERATE_LAUNCH)
    assert len(of_type(events, "rank_joined")) == 2
    assert_steps_phases_and_verdict(events, 22, phase)
    assert not unexpected_notices(events), unexpected_notices(events)
    assert_validation_is_evaluation_not_data(events)
    if script == LIGHTNING:  # its on_validation_end (a checkpoint's place) was the next step's data
        validated = [s for s in of_type(events, "rank_step") if s["step"] and s["step"] % VALIDATE_EVERY == 0]
        assert all(s["other_ms"] - s["eval_ms"] > 0.8 * AFTER_VALIDATION_MS for s in validated), validated


VALIDATE_EVERY = 5
VALIDATION_MS = 3 * 10.0  # the fixtures' validation loops: 3 batches of 10 ms
AFTER_VALIDATION_MS = 30.0  # lightning_fit.py's on_validation_end


def assert_validation_is_evaluation_not_data(events: list[dict]) -> None:
    # The validation loop was the next step's data: every 5th step read as waiting for input.
    on_time = {s["step"]: s for s in of_type(events, "rank_step") if s["rank"] == 0}
    for number, step in on_time.items():
        if number and number % VALIDATE_EVERY == 0:
            assert step["eval_ms"] > 0.8 * VALIDATION_MS and step["data_ms"] < 0.8 * VALIDATION_MS, step
        else:
            assert step["eval_ms"] == 0, step  # the sanity check before step 0 is no step's


def test_lightning_launching_itself_under_dptui_does_as_without_it():
    # Lightning starts rank 1 by re-running the script with subprocess.Popen: dptui recorded rank 0
    # only (one rank_joined with world_size 2), and said nothing of rank 1.
    # One launch for this and for the parametrized test's case ("self", "none"): every step, disjoint
    # phases, no verdict.
    plain = subprocess.run([sys.executable, LIGHTNING, "none", "22"], capture_output=True, text=True, timeout=300)
    watched = dptui_run("self", LIGHTNING, "none", "22")
    assert (watched.returncode, plain.returncode) == (0, 0), watched.stderr
    assert_same_lines(watched, plain, 22)
    events = json_events(watched.stdout)
    ended = of_type(events, "rank_ended")
    assert sorted((e["rank"], e["exit_code"], e["script_finished"]) for e in ended) == [(0, 0, True), (1, 0, True)]
    assert len(of_type(events, "rank_joined")) == 2
    assert_steps_phases_and_verdict(events, 22, "none")
    assert not unexpected_notices(events), unexpected_notices(events)


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def test_lightning_accumulating_gradients_counts_each_batchs_input_as_data_and_its_broadcast_as_waiting():
    # Lightning broadcasts a flag at every batch. With accumulate_grad_batches=2 the rank on time waited
    # there for the late one's second batch, and that was its own time (other); the late one's second
    # batch loaded in other too: half the slowdown in the wrong phase, the other half blamed on both.
    done = dptui_run("torchrun", LIGHTNING, "data", "22", "2")
    assert done.returncode == 0, done.stderr
    events = json_events(done.stdout)
    assert_steps_phases_and_verdict(events, 22, "data")
    late = {r: [s for s in of_type(events, "rank_step") if s["rank"] == r and s["step"] >= 4] for r in (0, 1)}
    assert {(s["micro_batches"], s["samples"]) for r in (0, 1) for s in late[r]} == {(2, 16)}
    assert median([s["data_ms"] for s in late[1]]) > 1.8 * SLOWED_MS, late[1]  # both batches' 50 ms
    assert median([s["comm_wait_ms"] for s in late[0]]) > 1.8 * SLOWED_MS, late[0]
    assert median([s["other_ms"] + s["data_ms"] for s in late[0]]) < SLOWED_MS / 5, late[0]
    assert not unexpected_notices(events), unexpected_notices(events)


def assert_finished(done: subprocess.CompletedProcess, events: list[dict], launcher: bool) -> None:
    """dptui ended 0 with every rank's script finished. gloo may abort a rank in interpreter teardown
    after its script's last line (torch's own; seen in CI, plain too): `accelerate launch` then exits
    1, and dptui, whose status is the launcher's, exits 1 too, with the rank's end said."""
    ended = sorted((e["rank"], e["exit_code"], e["script_finished"]) for e in of_type(events, "rank_ended"))
    assert [(rank, finished) for rank, _, finished in ended] == [(0, True), (1, True)], (ended, done.stderr)
    assert (done.returncode, [code for _, code, _ in ended]) == (0, [0, 0]) or \
        (launcher and done.returncode == 1 and any(code != 0 for _, code, _ in ended)), (ended, done.stderr)


def test_accelerate_launch_under_dptui_does_as_without_it():
    plain = subprocess.run(["accelerate", "launch", *two_cpu_ranks(), ACCELERATE, "none", "6"], capture_output=True,
                           text=True, timeout=300, env=with_python_bin_on_path())
    watched = dptui_run("script", ACCELERATE, "none", "6")
    assert_finished(watched, json_events(watched.stdout), launcher=True)
    assert plain.returncode == 0 or ("Signal 6 (SIGABRT)" in plain.stderr and plain.stdout.count("done") == 2), \
        plain.stderr
    assert_same_lines(watched, plain, 6)


FSDP = str(FRAMEWORKS / "fsdp_loop.py")


@pytest.mark.parametrize(("kind", "phase"), [("fsdp2", "none"), ("fsdp2", "data"), ("fsdp2", "forward"),
                                             ("fsdp2", "backward"), ("fsdp1", "none"), ("fsdp1", "data"),
                                             ("fsdp1", "backward")])
def test_fsdp_steps_every_rank_with_its_collective_wait_and_the_right_verdict(kind, phase):
    # FSDP's all-gathers and reduce-scatters: nothing was recorded (no DDP), and a rank waiting on a
    # late one in its forward's all-gather would have been blamed for forward. It validates every 5 steps.
    done = dptui_run("torchrun", FSDP, kind, phase, "22", str(VALIDATE_EVERY))
    assert done.returncode == 0, done.stderr
    events = json_events(done.stdout)
    assert_steps_phases_and_verdict(events, 22, phase)
    assert_validation_is_evaluation_not_data(events)
    assert not unexpected_notices(events), unexpected_notices(events)
    if phase != "none":  # the rank on time waits the slow one's 50 ms in FSDP's collectives
        late = [s for s in of_type(events, "rank_step") if s["rank"] == 0 and s["step"] >= 4]
        assert sorted(s["comm_wait_ms"] for s in late)[len(late) // 2] > 40, late


HF_TRAINER = str(FRAMEWORKS / "hf_trainer.py")


@pytest.mark.parametrize("phase", ["none", "data", "forward"])
def test_hf_trainer_with_accumulation_steps_its_optimizer_steps_of_two_micro_batches(phase, tmp_path):
    # It evaluates every 5 steps here: the module without its DDP, from model.eval() to model.train().
    done = dptui_run("torchrun", HF_TRAINER, phase, "22", str(tmp_path), str(VALIDATE_EVERY))
    assert done.returncode == 0, done.stderr
    events = json_events(done.stdout)
    assert_steps_phases_and_verdict(events, 22, phase)
    assert_validation_is_evaluation_not_data(events)
    assert {(s["micro_batches"], s["samples"]) for s in of_type(events, "rank_step")} == {(2, 16)}
    assert [line for line in script_lines(events) if line.startswith("rank")] == [
        "rank 0 done: 22 steps", "rank 1 done: 22 steps"]
    assert not unexpected_notices(events), unexpected_notices(events)
