"""One completion path for step records (issue 20.3/20.5, 18.4), the replica dropped for a
device without rows (20.1), the user's peak memory kept (20.4) and the phases' start times
(22.2): their logic, on CPU.

A record is finished once every span it reads is done() (HostSpan on the host, CudaSpan's
events on a GPU): the same code on both. Here a span that completes when the test says so
stands where the device would, so what waits and what is published is checked without a GPU.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from waiting import wait_for

from dpengine import DataParallel, StepRecord
from dpengine.cuda_memory import PeakKeeper
from dpengine.instrument import HostSpan
from dpengine.replicate import replicate_from_source

ROOT = Path(__file__).parent.parent


class LateSpan(HostSpan):
    """A span whose end the test releases, as a device would complete an event later."""

    __slots__ = ("released", "waited")

    def __init__(self, span: HostSpan) -> None:
        super().__init__()
        self.started, self.ended = span.started, span.ended
        self.released = False
        self.waited = False

    def done(self) -> bool:
        return self.released and super().done()

    def wait(self) -> None:
        self.waited = self.released = True


def delay_backward(dp) -> list[LateSpan]:
    """Make the in-flight step's backward spans complete only when released."""
    late = []
    for probe in dp._records._open[-1].probes:
        timer = probe.backward
        timer.span = LateSpan(timer.span)
        late.append(timer.span)
    return late


def test_a_step_whose_spans_are_not_done_is_published_once_they_are(make_dp):
    dp = make_dp(nn.Linear(4, 2), ["cpu:0", "cpu:1"])
    got: list[StepRecord] = []
    dp.subscribe(got.append)
    x = torch.randn(6, 4)
    out = dp(x)
    late = delay_backward(dp)
    out.sum().backward()  # the backward ran on the host; its spans are not done
    assert got == [] and dp.last_step.backward_ms is None  # the forward's half, without waiting
    out = dp(x)  # the next forward does not wait for it either
    out.sum().backward()
    assert got == [], "a later step must not overtake an earlier one"
    for span in late:
        span.released = True
    wait_for(lambda: len(got) == 2, "the watcher to publish both steps, in order, without another forward")
    assert [r.step for r in got] == [1, 2]
    assert all(r.backward_ms is not None for r in got)
    assert dp.last_step is got[-1]


def test_flush_waits_for_what_is_open_and_seals_the_step_in_flight(make_dp):
    dp = make_dp(nn.Linear(4, 2), ["cpu:0", "cpu:1"])
    got: list[StepRecord] = []
    dp.subscribe(got.append)
    out = dp(torch.randn(6, 4))
    late = delay_backward(dp)
    out.sum().backward()
    dp(torch.randn(6, 4))  # forward only, under grad: its backward may still come
    assert [r.step for r in got] == []
    dp.flush_steps()  # the program's end
    assert all(span.waited for span in late)
    assert [r.step for r in got] == [1, 2]
    assert got[0].backward_ms is not None and got[1].backward_ms is None


def test_a_forward_only_script_publishes_its_last_step_at_exit(tmp_path):
    script = tmp_path / "forward_only.py"
    script.write_text(textwrap.dedent("""
        import atexit, torch
        from torch import nn
        from dpengine import DataParallel
        atexit.register(lambda: print("published", steps))  # registered first: runs last
        steps = []
        dp = DataParallel(nn.Linear(4, 2), ["cpu:0", "cpu:1"])
        dp.subscribe(lambda r: steps.append(r.step))
        for _ in range(3):
            dp(torch.randn(6, 4))  # under grad, never a backward
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "published [1, 2, 3]"


def test_phase_starts_on_the_host_clock(make_dp):
    dp = make_dp(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2)), ["cpu:0", "cpu:1", "cpu:2"])
    dp(torch.randn(12, 8)).sum().backward()
    r = dp.last_step
    assert r.scatter_start_ms == 0.0
    assert r.replicate_start_ms == pytest.approx(r.scatter_ms)
    assert r.apply_start_ms == pytest.approx(r.scatter_ms + r.replicate_ms)
    assert r.gather_start_ms == pytest.approx(r.scatter_ms + r.replicate_ms + r.apply_ms)
    for replica in r.replicas:
        assert r.apply_start_ms <= replica.forward_start_ms
        assert replica.forward_start_ms + replica.forward_ms <= r.gather_start_ms + 1e-6
        assert replica.backward_start_ms >= r.total_ms - 1e-6  # after the forward returned
    first = min(x.backward_start_ms for x in r.replicas)
    last = max(x.backward_start_ms + x.backward_ms for x in r.replicas)
    assert r.backward_start_ms == first and r.backward_ms == pytest.approx(last - first)


def test_no_grad_steps_and_a_single_device_have_starts_and_no_backward(make_dp):
    for devices in (["cpu:0", "cpu:1"], ["cpu:0"]):
        dp = make_dp(nn.Linear(4, 2), devices)
        with torch.no_grad():
            dp(torch.randn(6, 4))
        r = dp.last_step
        assert r.backward_ms is None and r.backward_start_ms is None
        assert all(x.forward_start_ms is not None and x.backward_start_ms is None for x in r.replicas)


# ------------------------------------------------------------- 20.1: device 0 without rows


def test_replicas_are_broadcast_from_the_source_and_its_unasked_replica_dropped():
    calls = []

    def replicate(module, device_ids):
        calls.append(list(device_ids))
        return [f"replica on {d}" for d in device_ids]

    assert replicate_from_source(replicate, "m", 0, [1, 2]) == ["replica on 1", "replica on 2"]
    assert calls[-1] == [0, 1, 2]  # Broadcast starts where the parameters are
    assert replicate_from_source(replicate, "m", 0, [0, 2]) == ["replica on 0", "replica on 2"]
    assert calls[-1] == [0, 2]
    assert replicate_from_source(replicate, "m", 0, []) == []


@pytest.mark.parametrize("split", [dict(chunk_sizes=[0, 3, 3]), dict(balance="weights", weights=[0, 1, 1])])
def test_device_0_without_rows_trains_as_the_plain_module(make_dp, split):
    torch.manual_seed(0)
    plain = nn.Linear(4, 2)
    dp = make_dp(nn.Linear(4, 2), ["cpu:0", "cpu:1", "cpu:2"], **split)
    dp.module.load_state_dict(plain.state_dict())
    x = torch.randn(6, 4)
    torch.testing.assert_close(dp(x), plain(x))
    dp(x).sum().backward()
    plain(x).sum().backward()
    assert dp.last_step.devices == ("cpu:1", "cpu:2")
    torch.testing.assert_close(dp.module.weight.grad, plain.weight.grad)


# ------------------------------------------------------------- 20.4: the user's peak


class Allocator:
    """The allocator's counters as the keeper sees them: its allocated peak, and a reserved one 4x it."""

    def __init__(self) -> None:
        self.peak = 0

    def read(self, index: int) -> dict:
        return {"allocated_bytes": {"all": {"current": 0, "peak": self.peak}},
                "reserved_bytes": {"large_pool": {"peak": 4 * self.peak}}, "num_ooms": 0}

    def reset(self, index: int) -> None:
        self.peak = 0


def test_the_users_peak_survives_the_steps_resets_until_the_user_resets():
    allocator = Allocator()
    keeper = PeakKeeper(allocator.read, allocator.reset)
    keeper.carrying = True
    allocator.peak = 900  # the user's model loading
    keeper.step_reset(0)
    allocator.peak = 300  # a step
    assert keeper.users_peak(0) == 900
    keeper.step_reset(0)
    allocator.peak = 1200  # a bigger step
    keeper.step_reset(0)
    assert keeper.users_peak(0) == 1200
    # every peak counter is kept, not only allocated bytes'; the allocator's own read is left as it is
    allocator.peak = 10
    assert keeper.users_stats(0)["reserved_bytes"]["large_pool"]["peak"] == 4800
    assert allocator.read(0)["reserved_bytes"]["large_pool"]["peak"] == 40
    keeper.users_reset(0)
    assert allocator.peak == 0 and keeper.users_peak(0) == 0
    allocator.peak = 50
    keeper.step_reset(0)
    assert keeper.users_peak(0) == 50


def test_without_the_users_view_a_step_reset_only_resets():
    allocator = Allocator()
    keeper = PeakKeeper(allocator.read, lambda i: setattr(allocator, "peak", 0))
    allocator.peak = 900
    keeper.step_reset(0)
    assert allocator.peak == 0 and keeper.users_peak(0) == 0


def test_under_dptui_run_a_forward_only_scripts_last_step_is_published(tmp_path):
    script = tmp_path / "tutorial.py"  # PyTorch's DataParallel tutorial: forwards under grad, no backward
    script.write_text(textwrap.dedent("""
        import torch
        from torch import nn
        model = nn.DataParallel(nn.Linear(5, 2))
        for _ in range(3):
            model(torch.randn(6, 5))
    """))
    done = subprocess.run([sys.executable, "-m", "tui.cli", "run", "--headless", "--json", "--no-telemetry",
                           "--devices", "cpu:0,cpu:1", str(script)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    events = [json.loads(line) for line in done.stdout.splitlines()]
    steps = [e for e in events if e["type"] == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3]
    for step in steps:  # the phases' starts cross the wire to dptui (22.2)
        assert step["engine"]["scatter_start_ms"] == 0.0 and step["engine"]["gather_start_ms"] > 0
        assert all(r["forward_start_ms"] >= step["engine"]["apply_start_ms"] for r in step["replicas"])


def test_a_dataparallel_dropped_before_its_backward_publishes_its_step():
    # torch.nn.parallel.data_parallel and `nn.DataParallel(m)(x)` build one per call.
    model = nn.Linear(4, 2)
    got: list[StepRecord] = []

    def per_call(x):
        dp = DataParallel(model, ["cpu:0", "cpu:1"])
        dp.subscribe(got.append)
        return dp(x)

    out = per_call(torch.randn(6, 4))
    gc.collect()
    assert [r.step for r in got] == [1] and got[0].backward_ms is None
    out.sum().backward()  # still trains; its owner is gone, so nothing more is published
    assert model.weight.grad is not None and len(got) == 1
