"""`dptui run`: real child processes running the programs in tests/fixtures/scripts."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from waiting import gone, wait_for

from dpengine.eventlog.events import ConfigChanged, StateChanged, StepFinished
from dpengine.run.protocol import BALANCE, BATCH_SIZE, Run
from tui.cli import main
from tui.script.events import ScriptOutput
from tui.script.script_run import BATCH_OWNED, ScriptRun
from tui.script.target import ScriptTarget

SCRIPTS = Path(__file__).parent / "fixtures" / "scripts"
EXAMPLE = Path(__file__).parent.parent / "examples" / "train_script.py"
DPTUI = [sys.executable, "-m", "tui.cli", "run"]


def script(name: str) -> str:
    return str(SCRIPTS / name)


def dptui(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*DPTUI, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def json_events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines()]  # fails on any line that is not JSON


def of_type(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["type"] == kind]


# -- running the program as python would --------------------------------------------


def test_a_plain_loop_is_recorded_and_json_stdout_stays_pure():
    done = dptui("--headless", "--json", "--devices", "cpu:0,cpu:1", "--no-telemetry", script("plain_loop.py"), "3")
    assert done.returncode == 0, done.stderr
    events = json_events(done.stdout)
    steps = of_type(events, "step")
    assert [[r["chunk_size"] for r in s["replicas"]] for s in steps] == [[5, 5]] * 3
    assert all(s["replicas"][1]["device"] == "cpu:1" and s["replicas"][0]["backward_ms"] is not None for s in steps)
    assert of_type(events, "run_started")[0]["config"]["devices"] == ["cpu:0", "cpu:1"]
    output = of_type(events, "output")
    assert [o["line"] for o in output if o["stream"] == "stdout"][:3] == [
        line for line in (o["line"] for o in output) if line.startswith("step ")
    ]
    assert {"type": "output", "stream": "stderr", "line": "to stderr"} in output
    assert {"type": "output", "stream": "stdout",
            "line": f"name=__main__ argv={[script('plain_loop.py'), '3']}"} in output
    assert of_type(events, "script_exited") == [{"type": "script_exited", "code": 0, "signal": None}]


def test_steps_finished_before_an_os_exit_reach_dptui():
    # os._exit skips atexit: 1 of the 3 steps came out, the others held on their way.
    done = dptui("--headless", "--json", "--devices", "cpu:0,cpu:1", "--no-telemetry", script("hard_exit.py"),
                 "os_exit")
    assert done.returncode == 3, done.stderr
    events = json_events(done.stdout)
    assert [s["step"] for s in of_type(events, "step")] == [1, 2, 3]
    assert of_type(events, "script_exited") == [{"type": "script_exited", "code": 3, "signal": None}]


@pytest.mark.parametrize("how, code, signal_name", [("sigkill", 137, "SIGKILL"), ("segfault", 139, "SIGSEGV")])
def test_the_last_step_before_a_hard_kill_reaches_dptui(tmp_path, how, code, signal_name):
    # The last step waited in the script for its optimizer time, until a next forward that never
    # came: SIGKILL after 3 steps left 1 in the log.
    log = tmp_path / "run.jsonl"
    done = dptui("--headless", "--json", "--log", str(log), "--devices", "cpu:0,cpu:1", "--no-telemetry",
                 script("hard_exit.py"), how, str(log))
    assert done.returncode == code, done.stderr
    events = json_events(done.stdout)
    steps = of_type(events, "step")
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert steps[-1]["engine"]["optimizer_ms"] > 0  # the optimizer step it waited for, before it went out
    assert of_type(events, "script_exited") == [{"type": "script_exited", "code": code, "signal": signal_name}]


def test_32_threads_calling_one_dataparallel_at_once_have_every_step_in_json():
    # Under dptui run 313 of the 640 steps came out, and no `dropped` said why.
    done = dptui("--headless", "--json", "--devices", "cpu:0,cpu:1,cpu:2", "--no-telemetry",
                 script("threads_share_one.py"))
    assert done.returncode == 0, done.stderr
    events = json_events(done.stdout)
    assert [o["line"] for o in of_type(events, "output")] == ["calls: 640, outputs right: 640"]
    assert sorted(s["step"] for s in of_type(events, "step")) == list(range(1, 641))
    assert of_type(events, "run_finished")[0]["steps"] == 640 and not of_type(events, "dropped")


def test_headless_passes_the_scripts_output_through_and_ends_with_the_summary_dptui_view_prints(tmp_path):
    log = tmp_path / "run.jsonl"
    done = dptui("--headless", "--no-telemetry", "--log", str(log), script("plain_loop.py"), "2")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["step 1", "step 2", "name=__main__ argv=['" + script("plain_loop.py") + "', '2']"]
    # stderr: the script's own, then dptui's: what it did not see, and the per-device summary.
    theirs, notice, *summary = done.stderr.splitlines()
    assert theirs == "to stderr"
    assert notice.startswith("dptui: Tagged(Linear, 12 params)@plain_loop.py:29 was built but never stepped")
    view = subprocess.run([sys.executable, "-m", "tui.cli", "view", "--headless", str(log)],
                          capture_output=True, text=True, timeout=60)
    assert summary == view.stdout.splitlines()  # one table, whichever command prints it
    # The final loss is the last the script called backward on (issue 18.6): as it printed it, to 4 places.
    printed_loss = lines[1].split()[-1]
    assert summary[0] == (f"DataParallel(Linear, 12 params)@plain_loop.py:23 · dptui run: 2 steps, finished, "
                          f"final loss {printed_loss}")
    assert [row.split()[:3] for row in summary[2:4]] == [["cpu:0", "2", "10"], ["cpu:1", "2", "10"]]
    assert summary[4].startswith("phases per step, means over 1 step: data ")  # the first has no input wait


def test_a_script_that_builds_no_dataparallel_says_so_on_stderr_in_json_and_in_the_log(tmp_path):
    # PyTorch's DataParallel tutorial as published: it wraps only `if torch.cuda.device_count() > 1`.
    log = tmp_path / "run.jsonl"
    done = dptui("--headless", "--json", "--no-telemetry", "--log", str(log), script("real/tutorial.py"))
    assert done.returncode == 0, done.stderr
    events = json_events(done.stdout)
    [notice] = of_type(events, "notice")
    assert notice["text"].startswith("the script built no torch.nn.DataParallel, so dptui recorded nothing")
    assert "false without a GPU (if torch.cuda.device_count() > 1, if input.is_cuda)" in notice["text"]
    assert [e["type"] for e in events][-3:] == ["notice", "script_exited", "run_finished"]
    assert notice in json_events(log.read_text())
    assert done.stderr == f"dptui: {notice['text']}\n"  # one line, --json or not


def test_distributed_data_parallel_in_the_scripts_own_process_is_said_to_be_unrecorded():
    done = dptui("--headless", "--no-telemetry", script("ddp_in_process.py"))
    assert done.returncode == 0, done.stderr
    assert done.stdout == "ddp step done\n"
    assert done.stderr.splitlines() == [
        "dptui: the script built torch.nn.parallel.DistributedDataParallel in its own process, which dptui "
        "records only in ranks it launches (dptui run --nproc-per-node N) or the script starts: its steps were "
        "not recorded"]


def test_the_module_form_runs_like_python_m():
    done = dptui("--headless", "--no-telemetry", "-m", "dp_module", "a", "--b", cwd=SCRIPTS)
    assert done.returncode == 0, done.stderr
    assert done.stdout == (
        f"name=__main__ spec=dp_module argv0={SCRIPTS / 'dp_module.py'} args=['a', '--b'] path0={SCRIPTS}\n"
    )


def test_a_progress_bar_comes_as_its_latest_state_at_most_4_times_a_second_in_json():
    done = dptui("--headless", "--json", "--no-telemetry", script("progress_bar.py"), "tqdm", "300", "0.01")
    assert done.returncode == 0, done.stderr
    output = of_type(json_events(done.stdout), "output")
    start, end = (float(o["line"].split()[-1]) for o in output if o["line"].startswith("bar "))
    states = [o["line"] for o in output if o.get("cr")]
    assert all(o["cr"] is True for o in output if "cr" in o)  # marked only where true
    assert len(states) >= 2  # live, while the bar went on
    assert len(states) <= 4 * (end - start) + 2  # however often tqdm redrew (300 times)
    counts = [int(state.removeprefix("train: ").removesuffix("/300")) for state in states]
    assert counts == sorted(counts) and counts[-1] < 300
    assert {"type": "output", "stream": "stderr", "line": "train: 300/300"} in output  # its end, as a line


def test_headless_passes_a_progress_bar_through_byte_for_byte():
    args = [script("progress_bar.py"), "tqdm", "20"]
    plain = subprocess.run([sys.executable, *args], capture_output=True, timeout=60)
    under = subprocess.run([*DPTUI, "--headless", "--no-telemetry", *args], capture_output=True, timeout=120)
    assert plain.returncode == under.returncode == 0
    assert plain.stderr.count(b"\r") == 22 and b"\n" not in plain.stderr[:-1]
    assert under.stderr.startswith(plain.stderr)  # then dptui's own line: no DataParallel in it
    assert under.stderr[len(plain.stderr):].startswith(b"dptui: the script built no torch.nn.DataParallel")


def test_a_packages_init_runs_once_in_the_script_and_a_missing_module_is_one_line():
    done = dptui("--headless", "--no-telemetry", "-m", "side_effect_pkg.train", cwd=SCRIPTS)
    assert done.returncode == 0, done.stderr
    init, train = done.stdout.splitlines()  # dptui looked for it without running __init__
    assert init.startswith("__init__ ran in pid ") and train == f"train ran in pid {init.split()[-1]}"

    missing = dptui("--headless", "--no-telemetry", "-m", "side_effect_pkg.nope", cwd=SCRIPTS)
    assert missing.returncode == 2
    assert missing.stderr == "dptui run: error: No module named side_effect_pkg.nope\n"  # not a traceback
    assert missing.stdout.count("__init__ ran") == 1  # only the script's process ran it, as python -m does


def test_sys_exit_code_is_dptuis_exit_status():
    done = dptui("--headless", "--no-telemetry", script("exits_3.py"))
    assert (done.returncode, done.stdout) == (3, "about to exit 3\n")


def test_an_uncaught_exception_exits_1_with_the_scripts_traceback():
    done = dptui("--headless", "--no-telemetry", script("raises.py"))
    assert done.returncode == 1
    assert done.stderr.startswith("Traceback (most recent call last):\n")
    assert done.stderr.endswith("RuntimeError: boom in the user's script\n")
    assert 'raises.py", line 2, in fail' in done.stderr
    assert "dpengine" not in done.stderr and "runpy" not in done.stderr  # only the user's frames


def test_a_script_named_by_a_relative_path_has_an_absolute_file_as_under_python():
    # __file__ absolute (Python 3.9+), sys.argv[0] as given: the script finds its sibling after a chdir.
    done = dptui("--headless", "--no-telemetry", "file_after_chdir.py", cwd=SCRIPTS)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[:2] == [f"{SCRIPTS / 'file_after_chdir.py'} file_after_chdir.py",
                                            (SCRIPTS / "README.md").read_text().splitlines()[0]]


def test_a_compiled_script_runs_as_under_python(tmp_path):
    import py_compile

    source = tmp_path / "compiled.py"
    source.write_text("import sys\nprint('compiled ran', sys.argv[1:])\n")
    py_compile.compile(str(source), cfile=str(tmp_path / "compiled.pyc"))
    done = dptui("--headless", "--no-telemetry", "compiled.pyc", "a", cwd=tmp_path)
    assert (done.returncode, done.stdout) == (0, "compiled ran ['a']\n"), done.stderr


def test_explicit_device_ids_in_the_script_are_kept():
    done = dptui("--headless", "--json", "--devices", "cpu:0,cpu:1", "--no-telemetry", script("explicit_devices.py"))
    assert done.returncode == 0, done.stderr
    (step,) = of_type(json_events(done.stdout), "step")
    assert [(r["device"], r["chunk_size"]) for r in step["replicas"]] == [("cpu:0", 3), ("cpu:1", 3), ("cpu:2", 3)]


def test_instances_are_told_apart_and_a_rebuilt_one_is_not_new(tmp_path):
    log = tmp_path / "run.jsonl"
    done = dptui("--headless", "--log", str(log), "--no-telemetry", script("instances.py"))
    assert done.returncode == 0, done.stderr
    events = json_events(log.read_text())
    seen = [e["instance"] for e in of_type(events, "dataparallel")]
    # Keyed by the module and the line: the model rebuilt every epoch is one instance, the two
    # models one helper wraps are two (numbered: their labels would read the same).
    helper = "DataParallel(Linear, 12 params)@instances.py:19"
    assert seen == ["DataParallel(Linear, 12 params)@instances.py:10",
                    "DataParallel(Linear, 12 params)@instances.py:12", helper, f"{helper} #2"]
    steps = [(s["instance"], s["step"], s["batch_size"]) for s in of_type(events, "step")]
    assert steps == [(seen[1], 1, 8), (seen[0], 1, 8), (seen[1], 2, 8), (seen[0], 2, 8), (seen[1], 3, 8),
                     (seen[0], 3, 8), (helper, 1, 4), (f"{helper} #2", 1, 6)]
    # The panels follow the first DataParallel that stepped.
    assert of_type(events, "run_started")[0]["config"]["workload"] == seen[1]


def test_spawned_dataloader_workers_find_the_script_as_main():
    done = dptui("--headless", "--no-telemetry", script("spawn_loader.py"))
    assert (done.returncode, done.stdout) == (0, "spawned workers fine\n"), done.stderr


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_gpus_the_example_script_is_recorded_per_gpu():
    done = dptui("--headless", "--json", "--telemetry-interval", "0.2", str(EXAMPLE), "--epochs", "1")
    assert done.returncode == 0, done.stderr
    events = json_events(done.stdout)
    gpus = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    steps = of_type(events, "step")
    assert steps and [r["device"] for r in steps[0]["replicas"]] == gpus
    assert all(r["peak_memory_bytes"] for r in steps[-1]["replicas"])
    samples = [s for e in of_type(events, "telemetry") for s in e["samples"]]
    assert {s["device"] for s in samples} == set(gpus) and all(s["name"] != "virtual" for s in samples)


def test_a_subclass_that_overrides_scatter_is_called_and_recorded_as_it_split():
    done = dptui("--headless", "--no-telemetry", "--devices", "cpu:0,cpu:1", script("scatter_override.py"))
    assert done.returncode == 0, done.stderr
    assert done.stdout == "scatter calls: [2]\n"
    done = dptui("--headless", "--json", "--no-telemetry", "--devices", "cpu:0,cpu:1", script("scatter_override.py"))
    (step,) = of_type(json_events(done.stdout), "step")
    # The record shows the override's 2/8, not torch.chunk's 5/5.
    assert [(r["device"], r["chunk_size"]) for r in step["replicas"]] == [("cpu:0", 2), ("cpu:1", 8)]


# -- the run contract the UI drives ---------------------------------------------------


def test_a_script_run_refuses_what_a_script_does_not_allow_in_a_sentence():
    run = ScriptRun(ScriptTarget("train.py"), ("cpu:0", "cpu:1"))
    with pytest.raises(ValueError, match=f"^{BATCH_OWNED}$"):
        run.set_batch_size(64)
    with pytest.raises(ValueError, match="splits batches as the script built it"):
        run.set_balance("auto")
    assert isinstance(run, Run) and BALANCE not in run.controls and BATCH_SIZE not in run.controls
    with pytest.raises(ValueError, match="^The script is not running.$"):
        run.pause()
    with pytest.raises(ValueError, match="^Choose at least one device.$"):
        run.set_devices([])
    assert (run.config(), run.devices) == (None, ())
    run.stop()
    assert run.run() is None  # stopped before it began: nothing was started


def test_a_paused_script_stops_at_the_first_signal():
    run = ScriptRun(ScriptTarget(script("endless.py")), ("cpu:0", "cpu:1"), telemetry_interval=None, grace_s=30)
    seen: list = []
    run.subscribe(seen.append)
    thread = threading.Thread(target=run.run)
    thread.start()
    try:
        wait_for(lambda: any(isinstance(e, StepFinished) for e in seen), "a step")
        run.pause()
        wait_for(lambda: any(isinstance(e, StateChanged) and e.state == "paused" for e in seen), "paused")
        started = time.monotonic()
        run.stop()
        assert run.wait(20)
        assert run.exit_code == 130 and time.monotonic() - started < 20  # SIGINT did it, not the grace
        assert ScriptOutput("stdout", "interrupted: cleaning up") in seen
    finally:
        run.kill()
        thread.join(30)


def test_device_changes_and_pauses_answer_their_requests_and_auto_balance_follows():
    # Three devices to two under balance="auto" raised "one chunk size and one time per device (3)
    # expected" at the next step (issue 18 point 10): set_devices gives it a fresh balancer.
    run = ScriptRun(ScriptTarget(script("auto_balanced.py")), ("cpu:0", "cpu:1", "cpu:2"),
                    telemetry_interval=None, grace_s=30)
    seen: list = []
    run.subscribe(seen.append)
    thread = threading.Thread(target=run.run)
    thread.start()

    def steps_on(devices: tuple[str, ...]) -> list[StepFinished]:
        return [e for e in list(seen) if isinstance(e, StepFinished) and e.record.devices == devices]

    def answer(kind: type, request: int):
        wait_for(lambda: any(isinstance(e, kind) and e.request == request for e in list(seen)),
                 f"the {kind.__name__} answering request {request}")
        return next(e for e in seen if isinstance(e, kind) and e.request == request)

    try:
        wait_for(lambda: len(steps_on(("cpu:0", "cpu:1", "cpu:2"))) >= 8, "auto-balanced steps on three")
        request = run.set_devices(["cpu:0", "cpu:1"])
        assert answer(ConfigChanged, request).devices == ("cpu:0", "cpu:1")
        wait_for(lambda: len(steps_on(("cpu:0", "cpu:1"))) >= 8, "steps on two after the change")
        assert run.exit_code is None  # still training
        paused = run.pause()
        assert paused > request and answer(StateChanged, paused).state == "paused"
        resumed = run.resume()
        assert answer(StateChanged, resumed).state == "running"
    finally:
        run.stop()
        run.wait(30)
        run.kill()
        thread.join(30)
    assert run.exit_code == 130


def test_json_piped_into_head_stops_the_script_quietly():
    proc = subprocess.Popen([*DPTUI, "--headless", "--json", "--no-telemetry", script("endless.py")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert json.loads(proc.stdout.readline())["type"] == "script_started"
    proc.stdout.close()  # as `| head -1` does once it has its line
    assert proc.wait(60) == 0
    assert proc.stderr.read() == ""


# -- bad input -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "no/such/script.py"], "dptui run: error: no such script: no/such/script.py"),
        (["run", "-m", "no_such_module_here"], "dptui run: error: no module named 'no_such_module_here'"),
        (["run", "--json", "x.py"], "dptui run: error: --json needs --headless"),
        (["run"], "dptui run: error: name a script or -m MODULE to run"),
        (["run", "--devices", "cpu:0,cpu:0", script("exits_3.py")], "dptui run: error: --devices: device 'cpu:0'"),
        (["run", "--grace", "soon", script("exits_3.py")], "dptui run: error: argument --grace: --grace must be a number, not 'soon' (see dptui run --help)"),
        (["run", "--grace", "inf", script("exits_3.py")], "dptui run: error: argument --grace: --grace must be a finite number"),
        (["run", "--log", "/tmp", script("exits_3.py")], "dptui run: error: --log /tmp: is a folder; name a file in it"),
        (["run", "--log", "/dev/full", script("exits_3.py")], "dptui run: error: --log /dev/full: cannot write it"),
        (["run", "--log", script("exits_3.py"), script("exits_3.py")],
         f"dptui run: error: --log {script('exits_3.py')}: that is the script itself; name another file"),
        (["run", "--trace", script("exits_3.py"), script("exits_3.py")],
         f"dptui run: error: --trace {script('exits_3.py')}: that is the script itself; name another file"),
        (["run", "-m", "no_such_package.train"], "dptui run: error: no module named 'no_such_package'"),
        (["run", "no_such_program_on_path"], "dptui run: error: no such script: no_such_program_on_path"),
        (["run", "sh"], f"dptui run: error: sh on PATH ({shutil.which('sh')}) is not a Python script; dptui run"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_anything_starts(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1


def test_a_fifo_log_that_nothing_reads_is_refused_and_one_that_is_read_gets_the_events(tmp_path):
    fifo = tmp_path / "events"
    os.mkfifo(fifo)
    refused = dptui("--headless", "--log", str(fifo), script("exits_3.py"))
    assert refused.returncode == 2  # at once: opening it would have waited for a reader forever
    assert refused.stderr == f"dptui run: error: --log {fifo}: a FIFO that nothing reads; start its reader first\n"

    reader = os.open(fifo, os.O_RDWR)  # Linux: a reader at once, that never reads EOF while open
    try:
        done = dptui("--headless", "--no-telemetry", "--log", str(fifo), script("exits_3.py"))
        assert done.returncode == 3, done.stderr
        os.set_blocking(reader, False)
        events = json_events(os.read(reader, 1 << 16).decode())
    finally:
        os.close(reader)
    assert of_type(events, "script_exited") == [{"type": "script_exited", "code": 3, "signal": None}]


def test_help_says_json_gives_the_script_a_terminal_without_input(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert "the script's stdin is a terminal that never has input" in " ".join(capsys.readouterr().out.split())


def test_a_script_that_asks_stty_for_the_terminal_size_runs_and_its_input_is_at_end(tmp_path, monkeypatch):
    # kuangliu/pytorch-cifar's progress bar runs `stty size` at import: on an empty stdin it raised
    # ValueError in dptui's UI, where under python in a terminal it ran.
    monkeypatch.setenv("COLUMNS", "100")
    ckpt = tmp_path / "checkpoint" / "ckpt.pth"
    done = dptui("--headless", "--json", "--no-telemetry", "--devices", "cpu:0,cpu:1",
                 script("real/cifar_progress_bar.py"), str(ckpt))
    assert done.returncode == 0, done.stderr
    events = json_events(done.stdout)
    lines = [o["line"] for o in of_type(events, "output") if not o.get("cr")]
    assert lines[0] == "term_width 100"
    assert lines[-1] == "input() EOFError"  # reads end at once, as on an empty stdin
    assert [[r["chunk_size"] for r in s["replicas"]] for s in of_type(events, "step")] == [[4, 4]] * 3
    state = torch.load(ckpt, weights_only=True)["net"]
    net = torch.nn.DataParallel(torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10)))
    net.load_state_dict(state)
    assert "module.0.weight" in state


def test_without_a_pseudo_terminal_the_script_gets_an_empty_stdin(monkeypatch):
    def no_pty():
        raise OSError("out of pty devices")

    monkeypatch.setattr(os, "openpty", no_pty)
    out: list[str] = []
    run = ScriptRun(ScriptTarget(script("plain_loop.py"), ("1",)), ("cpu:0", "cpu:1"), telemetry_interval=None)
    run.subscribe(lambda e: out.append(e.line) if isinstance(e, ScriptOutput) else None)
    run.run()
    assert run.exit_code == 0 and "step 1: loss" in " ".join(out)


def test_dptui_help_lists_the_run_subcommand(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "dptui run [OPTIONS] (SCRIPT.py | -m MODULE)" in capsys.readouterr().out


# -- stopping: nothing is left behind ------------------------------------------------


class Started:
    """`dptui run --headless --json endless.py`, once the script has printed its pids."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [*DPTUI, "--headless", "--json", "--no-telemetry", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        self.lines: list[dict] = []
        for line in self.proc.stdout:
            event = json.loads(line)
            self.lines.append(event)
            if event["type"] == "output" and event["line"].startswith('{"child"'):
                self.pids = json.loads(event["line"])
                break
        assert self.pids, self.proc.stderr.read()
        wait_for(lambda: any(p.pid == self.pids["grandchild"] for p in psutil.Process(self.pids["child"]).children()),
                 "the grandchild")

    def finish(self) -> tuple[int, list[dict]]:
        out, _err = self.proc.communicate(timeout=60)
        return self.proc.returncode, self.lines + json_events(out)

    def assert_all_gone(self) -> None:
        wait_for(lambda: gone(self.pids["child"]) and gone(self.pids["grandchild"]), "the group to be gone")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_to_dptui_interrupts_the_script_and_its_children(signum):
    run = Started("--grace", "10", script("endless.py"))
    run.proc.send_signal(signum)
    code, events = run.finish()
    assert code == 130  # the script's KeyboardInterrupt: its own handling ran
    assert {"type": "output", "stream": "stdout", "line": "interrupted: cleaning up"} in events
    assert of_type(events, "script_exited")[0]["code"] == 130
    run.assert_all_gone()  # the grandchild ignores SIGINT and SIGTERM: SIGKILL took it


def test_a_script_that_ignores_sigint_gets_sigterm_after_the_grace_period():
    run = Started("--grace", "0.5", script("endless.py"), "stubborn")
    run.proc.send_signal(signal.SIGINT)
    code, events = run.finish()
    assert code == 128 + signal.SIGTERM
    assert of_type(events, "script_exited")[0] == {"type": "script_exited", "code": 143, "signal": "SIGTERM"}
    run.assert_all_gone()


def test_a_second_stop_while_stopping_sends_sigterm_at_once_not_after_the_grace_period():
    run = ScriptRun(ScriptTarget(script("endless.py"), ("stubborn",)), ("cpu:0", "cpu:1"),
                    telemetry_interval=None, grace_s=600)
    lines: list[str] = []
    run.subscribe(lambda e: lines.append(e.line) if isinstance(e, ScriptOutput) else None)
    threading.Thread(target=run.run, daemon=True).start()
    wait_for(lambda: any(line.startswith('{"child"') for line in lines), "the script's pids", timeout=60)
    run.stop()  # SIGINT, which this script ignores: SIGTERM would come 600 s later
    run.hurry()  # Ctrl-C after q
    assert run.wait(30)
    assert run.exit_code == 128 + signal.SIGTERM


def test_if_dptui_is_killed_the_lifeline_ends_the_script_and_its_children():
    run = Started(script("endless.py"))
    run.proc.kill()
    run.proc.wait(timeout=10)
    run.assert_all_gone()


def test_if_dptui_is_killed_while_the_script_holds_the_gil_the_group_still_ends_within_seconds():
    # No Python thread of the script can run (it lived 50 s): the parent-death signal ends the
    # script, the keeper process the grandchild that ignores SIGTERM.
    run = Started(script("holds_gil.py"))
    run.proc.kill()
    run.proc.wait(timeout=10)
    wait_for(lambda: gone(run.pids["child"]) and gone(run.pids["grandchild"]), "the group to be gone", timeout=15)
