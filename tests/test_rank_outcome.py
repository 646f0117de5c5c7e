"""How a DDP script's ranks ended and dptui's exit status (tui/script/rank_outcome.py), without processes."""

from __future__ import annotations

import signal

from dpengine.eventlog.events import RankJoined
from tui.script.failure_record import FailureRecord
from tui.script.rank_outcome import Generation, exit_status, rank_end


def generation(world: int = 2) -> Generation:
    gen = Generation(0, world_size=world)
    for rank in range(world):
        gen.joined[rank] = RankJoined(rank=rank, local_rank=rank, world_size=world, host=f"node{rank}",
                                      pid=100 + rank, device="cpu")
    return gen


def record(*failures: tuple[int, int]) -> FailureRecord:
    """torchrun's record: the first (rank, exitcode) is the root cause, the others follow."""
    lines = ["Failures:"]
    for rank, code in failures[1:]:
        lines += [f"  host      : node{rank}", f"  rank      : {rank} (local_rank: {rank})",
                  f"  exitcode  : {code} (pid: {100 + rank})"]
    rank, code = failures[0]
    lines += ["Root Cause (first observed failure):", f"  host      : node{rank}",
              f"  rank      : {rank} (local_rank: {rank})", f"  exitcode  : {code} (pid: {100 + rank})"]
    parsed = FailureRecord()
    for line in lines:
        parsed.feed(line)
    return parsed


def test_every_rank_finished_is_0():
    gen = generation()
    gen.finished.update({0: 0, 1: 0})
    assert exit_status(gen, FailureRecord(), None, 0).code == 0


def test_an_abort_in_teardown_after_the_script_finished_counts_as_finished_with_a_note():
    gen = generation()
    gen.finished.update({0: 0, 1: 0})
    status = exit_status(gen, record((1, -signal.SIGABRT)), None, 1)
    assert (status.code, status.failed_rank) == (0, None)
    assert status.notes == ("rank 1 ended with SIGABRT in interpreter teardown after its script finished: "
                            "counted as finished",)
    ended = rank_end(gen, 1, -signal.SIGABRT)
    assert (ended.exit_code, ended.script_finished) == (0, True)


def test_an_abort_before_the_script_finished_is_a_failure():
    gen = generation()
    gen.finished[0] = 0
    status = exit_status(gen, record((1, -signal.SIGABRT)), None, 1)
    assert (status.code, status.signal, status.failed_rank, status.notes) == (134, "SIGABRT", 1, ())
    assert rank_end(gen, 1, -signal.SIGABRT).exit_code == -signal.SIGABRT


def test_an_abort_in_teardown_after_the_script_raised_counts_as_pythons_exit_1_with_a_note():
    # Seen in CI: rank 1 raised, gloo aborted it in teardown, and dptui exited 134 where torchrun says 1.
    gen = generation()
    gen.failed[1] = {"host": "node1", "error": "RuntimeError: bad batch at step 5"}
    status = exit_status(gen, record((1, -signal.SIGABRT), (0, -signal.SIGTERM)), None, 1)
    assert (status.code, status.signal, status.failed_rank) == (1, None, 1)
    assert status.notes == ("rank 1 ended with SIGABRT in interpreter teardown after its script raised: "
                            "counted as exit 1",)
    ended = rank_end(gen, 1, -signal.SIGABRT)
    assert (ended.exit_code, ended.error, ended.script_finished) == (1, "RuntimeError: bad batch at step 5", False)
    gen = generation()  # without torchrun's record: the same
    gen.failed[1] = {"host": "node1", "error": "RuntimeError: bad batch at step 5"}
    gen.remote_codes[1] = -signal.SIGABRT
    assert exit_status(gen, FailureRecord(), None, 1).code == 1


def test_the_first_failed_ranks_status_is_dptuis_and_the_ranks_torchrun_ended_after_it_are_not():
    gen = generation()
    gen.failed[1] = {"host": "node1", "error": "ValueError: boom", "traceback": "Traceback ..."}
    status = exit_status(gen, record((1, 1), (0, -signal.SIGTERM)), None, 1)
    assert (status.code, status.failed_rank) == (1, 1)
    raised = rank_end(gen, 1, 1)
    assert (raised.exit_code, raised.error, raised.host, raised.traceback) == (1, "ValueError: boom", "node1",
                                                                              "Traceback ...")
    assert rank_end(gen, 1, 1) is None  # said once
    assert rank_end(gen, 0, -signal.SIGTERM).exit_code == -signal.SIGTERM


def test_a_script_exit_status_and_a_signal_death():
    gen = generation()
    gen.finished.update({0: 0, 1: 3})
    assert exit_status(gen, record((1, 3)), None, 1).code == 3
    gen = generation()
    gen.finished[0] = 0
    status = exit_status(gen, record((1, -signal.SIGKILL)), None, 1)
    assert (status.code, status.signal) == (137, "SIGKILL")


def test_stopped_by_dptui_is_130_or_143_whatever_the_ranks_did():
    gen = generation()
    assert exit_status(gen, record((0, -signal.SIGINT)), signal.SIGINT, 1).code == 130
    assert exit_status(gen, record((0, -signal.SIGTERM)), signal.SIGTERM, 1).code == 143


def test_another_nodes_rank_ended_by_a_signal_is_the_failure():
    gen = generation()
    gen.finished[0] = 0
    gen.remote_codes[1] = -signal.SIGKILL
    status = exit_status(gen, FailureRecord(), None, 1)
    assert (status.code, status.failed_rank) == (137, 1)


def test_without_any_word_from_the_ranks_torchruns_own_status():
    assert exit_status(Generation(0), FailureRecord(), None, 1).code == 1
    assert exit_status(Generation(0), FailureRecord(), None, -signal.SIGKILL).code == 137


def test_torchruns_first_failure_is_the_cause_and_a_rank_heard_raising_first_is_noted():
    # Both ranks raised; rank 1 said it first, torchrun saw rank 0 exit first and SIGTERMed rank 1.
    # Was: "rank 1: script exited 143", exit 143, where plain torchrun names rank 0 (exit 1).
    gen = generation()
    gen.failed[1] = {"host": "node1", "error": "ValueError: boom"}
    gen.failed[0] = {"host": "node0", "error": "ValueError: boom"}
    status = exit_status(gen, record((0, 1), (1, -signal.SIGTERM)), None, 1)
    assert (status.code, status.signal, status.failed_rank) == (1, None, 0)
    assert status.notes == ("rank 1 raised first (ValueError: boom); torchrun names rank 0 as its first failure",)
    # A peer that aborted in its collective, named by torchrun: named by dptui too, with the raiser noted.
    gen = generation()
    gen.failed[1] = {"host": "node1", "error": "ValueError: boom"}
    status = exit_status(gen, record((0, -signal.SIGABRT), (1, 1)), None, 1)
    assert (status.code, status.signal, status.failed_rank) == (134, "SIGABRT", 0)
    assert status.notes[0].startswith("rank 1 raised first (ValueError: boom)")


def test_without_torchruns_record_the_first_rank_that_raised_is_the_cause():
    gen = generation()
    gen.failed[1] = {"host": "node1", "error": "ValueError: boom"}
    gen.remote_codes[0] = -signal.SIGABRT
    status = exit_status(gen, FailureRecord(), None, 1)
    assert (status.code, status.failed_rank) == (1, 1)


def test_the_first_rank_to_raise_is_the_cause_not_a_peer_that_raised_after_it():
    gen = generation()
    gen.failed[1] = {"host": "node1", "error": "RuntimeError: bad batch"}
    gen.failed[0] = {"host": "node0", "error": "RuntimeError: Connection closed by peer"}  # said after rank 1
    status = exit_status(gen, record((1, 1), (0, -signal.SIGTERM)), None, 1)
    assert (status.code, status.failed_rank) == (1, 1)


def test_a_finished_rank_that_torchrun_ended_in_its_teardown_gets_no_note():
    gen = generation()
    gen.finished.update({0: 0, 1: 0})
    status = exit_status(gen, record((1, -signal.SIGABRT), (0, -signal.SIGTERM)), None, 1)
    assert status.code == 0 and len(status.notes) == 1 and status.notes[0].startswith("rank 1 ended with SIGABRT")


def test_a_rank_interrupted_by_ctrl_c_ended_by_sigint_as_python_does():
    # Ctrl-C under dptui on pytorch/examples minGPT-ddp: each rank said KeyboardInterrupt, then died of
    # SIGINT; torchrun, interrupted too, kept no record of them. It was said to have exited 1.
    gen = generation()
    gen.failed[0] = {"error": "KeyboardInterrupt", "traceback": ""}
    gen.failed[1] = {"error": "RuntimeError: bad batch", "traceback": ""}
    assert rank_end(gen, 0, None).exit_code == -signal.SIGINT
    assert rank_end(gen, 1, None).exit_code == 1


def test_the_agents_log_line_gives_a_workers_status_by_pid():
    parsed = FailureRecord()
    parsed.feed("E1204 22:53:38.010000 4689 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
                "(exitcode: -9) local_rank: 1 (pid: 4803) of binary: /usr/bin/python3")
    assert (parsed.exit_code_of_pid(4803), parsed.exit_code_of_pid(4802), parsed.failures) == (-9, None, [])
