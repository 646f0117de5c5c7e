"""`dptui run --nproc-per-node N`: real torchrun, whose ranks are tests/fixtures/ranks/fake_rank.py, a
stand-in for the rank bootstrap that speaks the side channel. dptui's side end to end: the launch,
the token, events, output with its rank, exit status, signals, no process left, pause in lockstep."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from waiting import gone, wait_for

from dpengine.eventlog.events import RankJoined, RankStepFinished, StateChanged, StragglerFound, TelemetrySampled
from dpengine.run.protocol import PAUSE, Run
from tui.script.ddp_launch import parse_launch
from tui.script.ddp_run import DdpRun
from tui.script.events import ScriptNotice
from tui.script.script_run import ScriptRun
from tui.script.target import ScriptTarget

RANKS = Path(__file__).parent / "fixtures" / "ranks"
FAKE = str(RANKS / "fake_rank.py")
DPTUI = [sys.executable, str(RANKS / "dptui_fake_ranks.py"), "run"]
TIMEOUT = 180  # torchrun starts slowly on a busy 2-core machine


def dptui(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*DPTUI, *args], capture_output=True, text=True, timeout=TIMEOUT)


def json_events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines()]


def of_type(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["type"] == kind]


def test_headless_output_as_under_torchrun_then_a_summary_with_the_verdict():
    done = dptui("--nproc-per-node", "2", "--headless", FAKE, "steps=30", "slow_rank=1", "slow_phase=backward")
    assert done.returncode == 0, done.stderr
    # Each rank's lines, unchanged: no prefix, no events.
    assert sorted(done.stdout.splitlines()) == sorted(f"rank {r} step {s}" for r in range(2) for s in range(30))
    summary = done.stderr.splitlines()  # what `dptui view --headless` of its log would print
    header = next(i for i, line in enumerate(summary) if line.startswith("rank  host"))
    rows = [line.split() for line in summary[header + 1:header + 3]]
    assert [(row[0], row[4], row[-1]) for row in rows] == [("0", "30", "finished"), ("1", "30", "finished")]
    assert "  step 16: rank 1 is the straggler: backward +48.0 ms/step over 15 steps" in summary


def test_json_events_carry_each_lines_rank_and_every_step(tmp_path):
    log = tmp_path / "run.jsonl"
    done = dptui("--nproc-per-node", "2", "--headless", "--json", "--log", str(log), "--telemetry-interval", "0.2",
                 FAKE, "steps=25", "step_s=0.03", "slow_rank=0", "slow_phase=data")
    assert done.returncode == 0, done.stderr
    events = json_events(done.stdout)
    started = of_type(events, "run_started")
    assert len(started) == 1 and started[0]["config"]["backend"] == "ddp"
    assert started[0]["config"]["devices"] == ["cpu", "cpu"]
    assert events.index(started[0]) < events.index(of_type(events, "rank_step")[0])
    assert sorted(e["rank"] for e in of_type(events, "rank_joined")) == [0, 1]
    steps = of_type(events, "rank_step")
    assert sorted((s["rank"], s["step"]) for s in steps) == [(r, s) for r in range(2) for s in range(25)]
    for rank in range(2):
        lines = [o["line"] for o in of_type(events, "output") if o.get("rank") == rank]
        assert lines == [f"rank {rank} step {s}" for s in range(25)]  # the prefix torchrun adds, stripped
    verdicts = of_type(events, "straggler")
    assert [(v["rank"], v["phase"]) for v in verdicts] == [(0, "data")]
    ended = of_type(events, "rank_ended")
    assert sorted((e["rank"], e["exit_code"], e["script_finished"]) for e in ended) == [(0, 0, True), (1, 0, True)]
    assert of_type(events, "script_exited") == [{"type": "script_exited", "code": 0, "signal": None}]
    assert sampled_ranks(events) == {"rank 0", "rank 1"}  # each rank's process, sampled from dptui
    # --log holds every event too, output and all.
    logged = json_events(log.read_text())
    assert [e["type"] for e in logged] == [e["type"] for e in events]


def sampled_ranks(events: list[dict]) -> set[str]:
    return {s["device"] for t in of_type(events, "telemetry") for s in t["samples"] if s["memory_used_bytes"]}


def test_a_rank_that_raises_is_named_and_its_status_is_dptuis():
    done = dptui("--nproc-per-node", "2", "--headless", "--json", FAKE, "forever=1", "fail_rank=1", "fail_step=3")
    assert done.returncode == 1, done.stderr
    events = json_events(done.stdout)
    failed = [e for e in of_type(events, "rank_ended") if e["rank"] == 1][0]
    assert failed["exit_code"] == 1 and not failed["script_finished"]
    assert failed["error"] == "ValueError: rank 1 broke at step 3"
    assert "Traceback (most recent call last)" in failed["traceback"] and failed["host"]
    # The other rank, which would train forever, was ended by torchrun.
    other = [e for e in of_type(events, "rank_ended") if e["rank"] == 0][0]
    assert not other["script_finished"] and other["exit_code"] != 0
    assert f"dptui: rank 1 on {failed['host']} failed: ValueError: rank 1 broke at step 3" in done.stderr
    for joined in of_type(events, "rank_joined"):
        assert gone(joined["pid"])


def test_when_both_ranks_raise_dptui_names_torchruns_first_failure_and_exits_as_it(tmp_path):
    # Rank 1 raises first but is slow to exit; rank 0 raises (only after rank 1 has: ranks start
    # apart on a busy machine) and exits: torchrun names rank 0 and SIGTERMs rank 1. dptui said
    # "rank 1: script exited 143" and exited 143 (2 of 4 tries).
    for attempt in range(2):
        marks = tmp_path / str(attempt)
        marks.mkdir()
        done = dptui("--nproc-per-node", "2", "--headless", FAKE, "forever=1", "fail_rank=1,0",
                     "fail_step=3,6", "linger=1:4", f"fail_after=1:{marks}")
        root = done.stderr[done.stderr.index("Root Cause"):]
        torchruns_rank = int(root.split("rank      : ", 1)[1].split()[0])
        assert torchruns_rank == 0, root
        assert done.returncode == 1, done.stderr
        assert "ddp: 6 steps, failed: rank 0: script exited 1" in done.stderr
        assert "dptui: rank 1 raised first (ValueError: rank 1 broke at step 3); torchrun names rank 0" in done.stderr


def test_a_script_exit_status_is_the_first_failed_ranks():
    done = dptui("--nproc-per-node", "2", "--headless", FAKE, "steps=3", "exit_code=3")
    assert done.returncode == 3, done.stderr


def test_a_rank_that_aborts_in_teardown_after_its_script_finished_counts_as_finished(tmp_path):
    done = dptui("--nproc-per-node", "2", "--headless", "--json", FAKE, "steps=5", f"abort_rank=1:{tmp_path}")
    assert done.returncode == 0, done.stderr
    notices = [n["text"] for n in of_type(json_events(done.stdout), "notice")]
    assert notices == ["rank 1 ended with SIGABRT in interpreter teardown after its script finished: "
                       "counted as finished"]


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_torchrun_and_every_rank_and_nothing_is_left(signum, status):
    proc = subprocess.Popen([*DPTUI, "--nproc-per-node", "2", "--headless", "--json", "--grace", "3", FAKE,
                             "forever=1", "child=1", "step_s=0.05"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    pids: list[int] = []
    lines: list[dict] = []

    def read() -> None:
        for raw in proc.stdout:
            body = json.loads(raw)
            lines.append(body)
            if body["type"] == "rank_joined":
                pids.append(body["pid"])
            if body["type"] == "output" and " child " in body["line"]:
                pids.append(int(body["line"].split()[-1]))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_for(lambda: len(pids) == 4 and len(of_type(lines, "rank_step")) >= 4, "both ranks stepping",
                 timeout=TIMEOUT)
        launcher = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        proc.send_signal(signum)
        assert proc.wait(timeout=60) == status
        reader.join(timeout=10)
        for pid in pids + launcher:
            wait_for(lambda: gone(pid), f"process {pid} ended", timeout=10)
    finally:
        proc.kill()
        proc.wait()


# -- the Run, in process --------------------------------------------------------------------------


@pytest.fixture
def fake_ranks(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(RANKS), os.environ.get("PYTHONPATH")) if p))

    def make(*args: str, nproc: int = 2) -> DdpRun:
        launch = parse_launch(["--nproc-per-node", str(nproc)], ScriptTarget(FAKE, args))
        return DdpRun(dataclasses.replace(launch, bootstrap="fake_rank"), grace_s=3)

    return make


@pytest.mark.parametrize("chosen, remains", [((), "30 min, the process group's collective timeout (torch's default)"),
                                             (("pg_timeout=120",), "2 min, the process group's collective "
                                                                    "timeout (the script's)")])
def test_pause_stops_every_rank_before_the_same_step_until_resume(fake_ranks, chosen, remains):
    run = fake_ranks("forever=1", "step_s=0.02", *chosen)
    assert isinstance(run, Run) and run.controls == {PAUSE}
    events: list = []
    run.subscribe(events.append)
    thread = threading.Thread(target=run.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: sum(isinstance(e, RankStepFinished) for e in events) >= 6, "steps", timeout=TIMEOUT)
        request = run.pause()
        wait_for(lambda: any(isinstance(e, StateChanged) and e.state == "paused" for e in events), "paused")
        paused = next(e for e in events if isinstance(e, StateChanged))
        assert paused.request == request
        last = {r: max(e.step for e in events if isinstance(e, RankStepFinished) and e.rank == r) for r in (0, 1)}
        assert last[0] == last[1]  # lockstep: both stopped before the same step
        notice = next(e.text for e in events if isinstance(e, ScriptNotice) and "paused" in e.text)
        assert remains in notice  # 30 min: gloo's default in this torch
        minutes = float(remains.split()[0])
        assert run.pause_deadline() - time.monotonic() == pytest.approx(minutes * 60, abs=30)
        run.resume()
        wait_for(lambda: any(isinstance(e, StateChanged) and e.state == "running" for e in events), "resumed")
        wait_for(lambda: any(isinstance(e, RankStepFinished) and e.step > last[0] for e in events), "steps again")
    finally:
        run.stop()
        thread.join(timeout=60)
    assert not thread.is_alive() and run.exit_code == 130
    assert all(gone(e.pid) for e in events if isinstance(e, RankJoined))


def test_a_rank_with_a_wrong_token_is_not_heard(fake_ranks):
    run = fake_ranks("steps=3", "token=guessed")
    events: list = []
    run.subscribe(events.append)
    run.run()
    assert not any(isinstance(e, (RankJoined, RankStepFinished, StragglerFound)) for e in events)


async def test_the_app_shows_the_ranks_output_and_space_pauses_them_in_lockstep(fake_ranks):
    from pilot import log_text, press, quit_app, status, until

    from tui.script.app import ScriptApp
    from tui.widgets.rank_panel import RankPanel

    run = fake_ranks("forever=1", "step_s=0.02", "slow_rank=1")
    joined: list = []
    run.subscribe(lambda e: joined.append(e.pid) if isinstance(e, RankJoined) else None)
    app = ScriptApp(run)
    async with app.run_test(size=(120, 40)):
        await until(lambda: "rank 1 step 3" in log_text(app), what="rank 1's output in the log", timeout=TIMEOUT)
        await until(lambda: len(app.query(RankPanel)) == 2, what="a panel per rank")
        await until(lambda: "rank 1 is the straggler: data +48.0 ms/step" in status(app), what="the verdict")
        assert [p.has_class("-straggler") for p in app.query(RankPanel)] == [False, True]
        # No DataParallel to steer: its keys are left out of the Footer, and do nothing.
        footer = {k.key_display for k in app.query("FooterKey")}
        assert footer.isdisjoint({"+", "-", "b", "1-9", "i"}) and {"space", "t", "q"} <= footer, footer
        await press(app, "b")
        assert not app.screen_stack[-1].is_modal
        await press(app, "space")
        await until(lambda: "● paused" in status(app), what="every rank paused")
        await press(app, "space")
        await until(lambda: "● paused" not in status(app), what="running again")
        await quit_app(app)
    assert run.wait(60)
    assert run.exit_code == 130  # q stops the ranks as Ctrl-C does
    assert len(joined) == 2 and all(gone(pid) for pid in joined)


def test_a_restart_starts_a_new_run_in_the_same_log(tmp_path):
    log = tmp_path / "run.jsonl"
    # Rank 1 fails once both ranks said hello: on a busy machine it failed before rank 0 had joined
    # (tests/test_rank_hub.py has that case).
    done = dptui("--nproc-per-node", "2", "--max-restarts", "1", "--headless", "--log", str(log), FAKE,
                 "steps=6", "step_s=0.5", "fail_rank=1", "fail_step=0", "fail_once=1", f"joined={tmp_path}")
    assert done.returncode == 0, done.stderr
    events = json_events(log.read_text())
    starts = [i for i, e in enumerate(events) if e["type"] == "run_started"]
    assert len(starts) == 2
    first, second = events[starts[0]:starts[1]], events[starts[1]:]
    assert sorted((e["rank"], e["restart"]) for e in of_type(first, "rank_joined")) == [(0, 0), (1, 0)]
    assert sorted((e["rank"], e["restart"]) for e in of_type(second, "rank_joined")) == [(0, 1), (1, 1)]
    assert sorted((s["rank"], s["step"]) for s in of_type(second, "rank_step")) == [
        (r, s) for r in range(2) for s in range(6)]
    assert sorted((e["rank"], e["exit_code"]) for e in of_type(first, "rank_ended")) == [(0, -15), (1, 1)]
    assert sorted((e["rank"], e["exit_code"]) for e in of_type(second, "rank_ended")) == [(0, 0), (1, 0)]


def free_port_pair() -> int:
    """A port P with P + 1 free too: torchrun's store takes P, node 0's dptui P + 1."""
    import socket

    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise AssertionError("no two free ports in a row")


def test_two_nodes_on_loopback_node_0_shows_both_ranks_and_names_the_other_nodes_straggler():
    port = free_port_pair()
    nodes = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    nodes += ["--telemetry-interval", "0.2"]
    script = [FAKE, "steps=30", "step_s=0.03", "slow_rank=1", "slow_phase=forward"]
    node1 = subprocess.Popen([*DPTUI, *nodes, "--node-rank", "1", "--headless", *script],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        node0 = dptui(*nodes, "--node-rank", "0", "--headless", "--json", *script)
        out1, err1 = node1.communicate(timeout=TIMEOUT)
    finally:
        node1.kill()
    assert node0.returncode == 0, node0.stderr
    assert node1.returncode == 0, err1
    assert out1.splitlines() == [f"rank 1 step {s}" for s in range(30)]  # node 1: its rank's output, as it is
    events = json_events(node0.stdout)
    joined = of_type(events, "rank_joined")
    assert sorted((e["rank"], e["node_rank"], e["world_size"]) for e in joined) == [(0, 0, 2), (1, 1, 2)]
    assert of_type(events, "run_started")[0]["config"]["devices"] == ["cpu", "cpu"]
    assert sorted((s["rank"], s["step"]) for s in of_type(events, "rank_step")) == [
        (r, s) for r in range(2) for s in range(30)]
    assert [(v["rank"], v["phase"]) for v in of_type(events, "straggler")] == [(1, "forward")]
    assert sorted((e["rank"], e["exit_code"], e["script_finished"]) for e in of_type(events, "rank_ended")) == [
        (0, 0, True), (1, 0, True)]
    assert sampled_ranks(events) == {"rank 0", "rank 1"}  # node 1's rank sampled there, shown here
    for e in joined:
        assert gone(e["pid"])


def test_a_node_with_the_wrong_rendezvous_is_not_taken():
    from tui.script.node_link import NodeLink, node_channel, node_token
    from tui.script.rank_server import RankServer

    port = free_port_pair()
    launch = parse_launch(["--nnodes", "2", "--nproc-per-node", "1", "--master-port", str(port)], ScriptTarget(FAKE))
    other = parse_launch(["--nnodes", "2", "--nproc-per-node", "1", "--master-port", str(port), "--rdzv-id", "x"],
                         ScriptTarget(FAKE))
    assert node_token(launch) != node_token(other)
    lines: list = []
    host, node_port = node_channel(launch)
    server = RankServer("rank-token", lambda conn, body: lines.append(body), lambda conn: None, host=host,
                        port=node_port, node_token=node_token(launch)).start()
    try:
        for link_launch, taken in ((other, False), (launch, True)):
            link = NodeLink(node_channel(link_launch), node_token(link_launch), 1, lambda body: None).start()
            link.send({"type": "rank_step", "rank": 1, "step": 0})
            link.close()
            if taken:
                wait_for(lambda: [b["type"] for b in lines] == ["node_hello", "rank_step"], "the node's lines")
            else:
                wait_for(lambda: server.refused == 1, "the refusal")
                assert lines == []
    finally:
        server.close()


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_the_ui_in_a_real_terminal_stops_every_rank_when_dptui_is_signalled(signum, status):
    import pty

    master, slave = pty.openpty()
    env = dict(os.environ, TERM="xterm-256color")
    proc = subprocess.Popen([*DPTUI, "--nproc-per-node", "2", FAKE, "forever=1", "child=1", "step_s=0.05"],
                            stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True)
    os.close(slave)
    screen = bytearray()

    def drain() -> None:  # a terminal that is not read would block the UI
        while True:
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:
                return
            if not chunk:
                return
            screen.extend(chunk)

    threading.Thread(target=drain, daemon=True).start()
    try:
        # dptui, torchrun, two ranks and their children (and the spawner's fork helpers, if any).
        wait_for(lambda: len(psutil.Process(proc.pid).children(recursive=True)) >= 5 and b"step" in screen,
                 "the ranks to get going", timeout=TIMEOUT)
        family = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signum)
        assert proc.wait(60) == status
        for process in family:
            wait_for(lambda: gone(process.pid), f"process {process.pid} ended", timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)


@pytest.mark.parametrize("output", ["pipe", "file", "terminal"])
def test_when_dptui_is_killed_torchrun_and_its_ranks_end_too(output, tmp_path):
    # --json: torchrun tees the ranks' output through its TailLog threads, which a SIGTERM at the
    # wrong moment left running; the interpreter's shutdown then joined them for good (a torchrun
    # left with PPID 1, seen 3 times in 14 tries with the output on a terminal).
    log = tmp_path / "run.jsonl"
    command = [*DPTUI, "--nproc-per-node", "2", "--headless", "--json", "--log", str(log), FAKE, "forever=1",
               "step_s=0.05"]
    if output == "terminal":
        import pty

        reader, terminal = pty.openpty()  # a terminal that stays open, as a user's does
        proc = subprocess.Popen(command, stdin=terminal, stdout=terminal, stderr=terminal, start_new_session=True)
        os.close(terminal)
        threading.Thread(target=_drain, args=(reader,), daemon=True).start()
    elif output == "file":
        with open(tmp_path / "out.txt", "w") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=out)
    else:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        threading.Thread(target=proc.stdout.read, daemon=True).start()
    try:
        wait_for(lambda: len(_rank_pids(log)) == 2, "both ranks", timeout=TIMEOUT)
        family = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        proc.kill()  # SIGKILL: dptui cannot clean up; torchrun's parent-death signal does
        proc.wait()
        left = family + _rank_pids(log)
        wait_for(lambda: all(gone(pid) for pid in left), f"processes {left} ended", timeout=10)
    finally:
        proc.kill()


def _rank_pids(log: Path) -> list[int]:
    lines = log.read_text().splitlines() if log.exists() else []
    return [body["pid"] for body in map(json.loads, lines[:-1]) if body["type"] == "rank_joined"]


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 65536):
            pass
    except OSError:  # the last writer closed the terminal
        pass


def test_plain_dptui_run_pauses_the_ranks_a_script_spawns_in_lockstep(monkeypatch):
    for name in [k for k in os.environ if k.startswith("DPTUI_")]:
        monkeypatch.delenv(name)
    script = Path(__file__).parent / "fixtures" / "scripts" / "spawned_ranks.py"
    run = ScriptRun(ScriptTarget(str(script), (str(free_port_pair()), "100000")), ("cpu:0", "cpu:1"),
                    telemetry_interval=0.2, grace_s=3)
    events: list = []
    run.subscribe(events.append)
    thread = threading.Thread(target=run.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: sum(isinstance(e, RankStepFinished) for e in events) >= 6, "spawned ranks stepping",
                 timeout=TIMEOUT)
        request = run.pause()
        wait_for(lambda: any(isinstance(e, StateChanged) and e.state == "paused" for e in events), "paused")
        assert next(e for e in events if isinstance(e, StateChanged)).request == request
        last = {r: max(e.step for e in events if isinstance(e, RankStepFinished) and e.rank == r) for r in (0, 1)}
        assert last[0] == last[1]
        assert run.pause_deadline() is not None
        run.resume()
        wait_for(lambda: any(isinstance(e, RankStepFinished) and e.step > last[0] for e in events), "steps again")
        # Each spawned rank's process, sampled from dptui as torchrun's ranks are.
        wait_for(lambda: {s.device for e in list(events) if isinstance(e, TelemetrySampled) for s in e.samples
                          if s.memory_used_bytes} >= {"rank 0", "rank 1"}, "each rank's telemetry")
    finally:
        run.stop()
        thread.join(timeout=60)
    assert all(gone(e.pid) for e in events if isinstance(e, RankJoined))


def test_node_0_whose_channel_port_is_taken_says_so_in_one_line():
    import socket

    port = free_port_pair()
    with socket.create_server(("127.0.0.1", port + 1)):
        done = dptui("--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
                     "--master-port", str(port), "--headless", FAKE)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"dptui run: error: cannot listen for the other nodes on 127.0.0.1:{port + 1} (the master port + 1): "
        "Address already in use; choose another --master-port"]
