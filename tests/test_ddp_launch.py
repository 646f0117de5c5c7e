"""`dptui run --nproc-per-node N`: its command line, the side channel's server, torchrun's failure record.
Nothing here starts a rank (tests/test_ddp_run.py does)."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import pytest
from waiting import wait_for

from tui.cli import main
from tui.script.ddp_launch import ddp_requested, parse_launch, split_options
from tui.script.failure_record import FailureRecord
from tui.script.rank_server import RankServer
from tui.script.target import ScriptTarget

SCRIPT = str(Path(__file__).parent / "fixtures" / "ranks" / "fake_rank.py")
DPTUI_OPTIONS = {"--headless": False, "--json": False, "--log": True}


def usage_error(capsys, *argv: str) -> str:
    assert main(["run", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_nproc_per_node_before_the_script_asks_for_ranks():
    values = frozenset({"--devices", "--log"})
    assert ddp_requested(["--nproc-per-node", "2", "train.py"], values)
    assert ddp_requested(["--headless", "--rdzv-backend", "c10d", "--nproc_per_node=gpu", "train.py"], values)
    assert not ddp_requested(["--devices", "cpu:0", "train.py", "--nproc-per-node", "2"], values)
    assert not ddp_requested(["-m", "pkg", "--nproc-per-node", "2"], values)


def test_options_dptui_does_not_know_pass_through_to_torchrun_as_given():
    ours, torchrun, rest = split_options(
        ["--headless", "--nproc-per-node", "gpu", "--rdzv-backend", "c10d", "--rdzv-endpoint=h:29400",
         "--log", "run.jsonl", "--max-restarts", "2", "-m", "pkg.train", "--lr", "0.1"], DPTUI_OPTIONS)
    assert ours == ["--headless", "--log", "run.jsonl"]
    assert torchrun == ["--nproc-per-node", "gpu", "--rdzv-backend", "c10d", "--rdzv-endpoint=h:29400",
                        "--max-restarts", "2"]
    assert rest == ["-m", "pkg.train", "--lr", "0.1"]
    launch = parse_launch(torchrun, ScriptTarget("pkg.train", ("--lr", "0.1"), module=True))
    assert launch.world_size is None and launch.max_restarts == 2
    argv = launch.argv(tag_lines=True)
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    assert argv[3:argv.index("--tee")] == torchrun
    assert argv[argv.index("--tee") + 2:] == ["-m", "dpengine.script.rank_bootstrap", "-m", "pkg.train",
                                              "--lr", "0.1"]


def test_the_flags_mean_what_they_mean_to_torchrun():
    launch = parse_launch(["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                           "--master-port", "29500", "--nproc-per-node", "4"], ScriptTarget(SCRIPT))
    assert (launch.world_size, launch.node_rank, launch.master_addr, launch.master_port) == (8, 1, "10.0.0.1", 29500)
    assert launch.several_nodes
    # The user's own --tee: their choice of where lines go stands, and dptui adds none.
    users = parse_launch(["--nproc-per-node", "2", "--tee", "1"], ScriptTarget(SCRIPT))
    assert users.output_is_users and users.argv(tag_lines=True).count("--tee") == 1


@pytest.mark.parametrize("argv, says", [
    (["--nproc-per-node", "0", SCRIPT], "--nproc-per-node 0"),
    (["--nproc-per-node", "two", SCRIPT], "--nproc-per-node two"),
    (["--nproc-per-node", "2", "--standalone", "--nnodes", "2", SCRIPT], "--standalone"),
    (["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "2", SCRIPT], "--node-rank 2"),
    (["--nproc-per-node", "2", "--master-port", "70000", SCRIPT], "--master-port 70000"),
    (["--nproc-per-node", "2", "--max-restarts", "-1", SCRIPT], "--max-restarts -1"),
    (["--nproc-per-node", "2", "--bogus", SCRIPT], "unknown option --bogus"),
    (["--nproc-per-node", "2", "--no-python", SCRIPT], "--no-python"),
    (["--nproc-per-node", "2", "--json", SCRIPT], "--json needs --headless"),
    (["--nproc-per-node", "2", "no_such_script.py"], "no such script"),
    (["--nproc-per-node", "2"], "name a script"),
    (["--nproc-per-node"], "needs a value"),
    (["--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "1", SCRIPT], "run headless (add --headless)"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, says):
    assert says in usage_error(capsys, *argv)


# -- the side channel's server --------------------------------------------------------------------


def served(token: str = "secret") -> tuple[RankServer, list, list]:
    lines: list = []
    closed: list = []
    server = RankServer(token, lambda conn, body: lines.append(body), closed.append).start()
    return server, lines, closed


def connect(server: RankServer) -> socket.socket:
    return socket.create_connection(server.address)


def say(sock: socket.socket, *bodies: dict) -> None:
    sock.sendall(b"".join((json.dumps(b) + "\n").encode() for b in bodies))


def test_a_rank_with_the_token_is_heard_and_answered():
    server, lines, closed = served()
    try:
        sock = connect(server)
        say(sock, {"type": "hello", "token": "secret", "rank": 0}, {"type": "rank_step", "rank": 0, "step": 0})
        wait_for(lambda: len(lines) == 2, "the hello and the step")
        assert server.send_all({"op": "pause", "step": 5}) == 1
        assert json.loads(sock.makefile("rb").readline()) == {"op": "pause", "step": 5}
        sock.close()
        wait_for(lambda: len(closed) == 1, "the end of the connection")
        assert closed[0].hello["rank"] == 0
    finally:
        server.close()


@pytest.mark.parametrize("first", [
    {"type": "hello", "token": "wrong", "rank": 0},
    {"type": "hello", "rank": 0},
    {"type": "rank_step", "token": "secret", "rank": 0, "step": 0},  # anything but a hello first
    {"type": "node_hello", "token": "secret", "node_rank": 1},  # no node token: no other node taken
])
def test_a_connection_without_the_right_hello_is_closed_unheard(first):
    server, lines, closed = served()
    try:
        sock = connect(server)
        say(sock, first, {"type": "rank_step", "rank": 0, "step": 0, "token": "secret"})
        wait_for(lambda: server.refused == 1, "the refusal")
        assert sock.recv(1) == b""  # closed on it
        assert lines == [] and closed == [] and server.connections() == []
    finally:
        server.close()


def test_closing_the_server_ends_every_connection():
    server, lines, closed = served()
    sock = connect(server)
    say(sock, {"type": "hello", "token": "secret", "rank": 3})
    wait_for(lambda: len(lines) == 1, "the hello")
    threading.Thread(target=server.close).start()
    wait_for(lambda: len(closed) == 1, "the connection's end")
    assert sock.recv(1) == b""


# -- torchrun's failure record --------------------------------------------------------------------

RECORD = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
/tmp/fail.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-04_19:19:32
  host      : node0
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 8759)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 8759
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-04_19:19:32
  host      : node1
  rank      : 3 (local_rank: 1)
  exitcode  : -6 (pid: 8760)
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 8760
============================================================
"""


def test_the_failure_record_gives_each_failed_rank_the_root_cause_first():
    record = FailureRecord()
    for line in RECORD.splitlines():
        record.feed(line)
    assert [(f.rank, f.exit_code, f.pid, f.host, f.root_cause) for f in record.failures] == [
        (3, -6, 8760, "node1", True), (0, -15, 8759, "node0", False)]
    assert record.exit_code_of(0) == -15 and record.exit_code_of(1) is None
