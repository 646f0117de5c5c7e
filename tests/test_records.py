"""Step records: what each replica did, when records are published, and explicit splits."""

from __future__ import annotations

import dataclasses
import math
import threading
import time

import pytest
import torch
from torch import nn

from dpengine import DataParallel, ReplicaRecord, StepRecord
from reference_loop import chunk_sizes


def cpus(count: int) -> list[str]:
    return [f"cpu:{i}" for i in range(count)]


def largest_remainder(rows: int, weights: list[float]) -> list[int]:
    """Rows in proportion to weights; leftover rows to the largest fractional parts, lower slot first."""
    exact = [rows * w / sum(weights) for w in weights]
    sizes = [math.floor(e) for e in exact]
    order = sorted(range(len(weights)), key=lambda i: (sizes[i] - exact[i], i))
    for i in order[: rows - sum(sizes)]:
        sizes[i] += 1
    return sizes


def saved_bytes(fn, *args) -> int:
    """Bytes autograd saves for backward while running fn(*args), each tensor once."""
    seen: set[tuple[int, int]] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        key = (t.data_ptr(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return total


# ----------------------------------------------------------------- the record


@pytest.mark.parametrize("count", [1, 3])
def test_replica_records_describe_each_replica(make_dp, count: int) -> None:
    module = nn.Linear(5, 2)
    dp = make_dp(module, cpus(count))
    x = torch.randn(10, 5)
    out = dp(x)
    step = dp.last_step
    assert isinstance(step, StepRecord) and step.step == 1 and step.dim == 0
    assert step.batch_size == 10
    assert step.input_shapes == ((10, 5),) and step.output_shapes == ((10, 2),)
    sizes = chunk_sizes(10, count)
    assert list(step.chunk_sizes) == sizes
    assert list(step.devices) == cpus(count)[: len(sizes)]
    for i, (r, rows) in enumerate(zip(step.replicas, sizes)):
        assert isinstance(r, ReplicaRecord)
        assert r.index == i and r.device == f"cpu:{i}" and r.chunk_size == rows
        assert r.input_shapes == ((rows, 5),) and r.output_shapes == ((rows, 2),)
        assert r.forward_ms > 0
        # Linear with an input that needs no grad saves just its input chunk for backward.
        assert r.memory_bytes == rows * module.in_features * x.element_size()
        assert r.peak_memory_bytes is None  # CUDA only
        assert r.backward_ms is None  # no backward yet
    assert step.backward_ms is None
    for name in ("scatter_ms", "replicate_ms", "apply_ms", "gather_ms", "total_ms"):
        assert getattr(step, name) >= 0
    assert step.total_ms > 0 and step.apply_ms > 0
    parts = step.scatter_ms + step.replicate_ms + step.apply_ms + step.gather_ms
    assert parts == pytest.approx(step.total_ms, rel=1e-6, abs=1e-6)
    assert step.total_ms >= max(r.forward_ms for r in step.replicas)  # forwards run inside it

    out.sum().backward()
    done = dp.last_step
    assert done.step == 1 and done.chunk_sizes == step.chunk_sizes
    assert done.backward_ms is not None and done.backward_ms > 0
    assert all(r.backward_ms is not None and r.backward_ms >= 0 for r in done.replicas)
    assert done.backward_ms >= max(r.backward_ms for r in done.replicas) * 0.999


class _Sleepy(nn.Linear):
    """Linear(5, 2) whose forward sleeps: a replica's forward takes at least that long."""

    SECONDS = 0.005

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.SECONDS)
        return super().forward(x)


def test_forward_ms_is_measured_on_every_step_not_only_the_first(make_dp) -> None:
    """Step 1 measures what replicas save for backward; later steps reuse it (SavedBytesCache):
    the forward time is taken on both paths."""
    dp = make_dp(_Sleepy(5, 2), cpus(2))
    x = torch.randn(6, 5)
    for step in (1, 2, 3):
        dp(x).sum().backward()
        record = dp.last_step
        assert record.step == step
        assert all(r.forward_ms >= _Sleepy.SECONDS * 1000 and r.forward_timed for r in record.replicas), record
    assert record.grad
    with torch.no_grad():
        dp(x)
    assert all(r.forward_ms >= _Sleepy.SECONDS * 1000 for r in dp.last_step.replicas)
    assert not dp.last_step.grad  # an evaluation's forward, told apart from a step's
    with torch.inference_mode():
        dp(x)
    assert not dp.last_step.grad and dp.last_step.step == 5


class _SlowBackwardForRows(torch.autograd.Function):
    """Identity whose backward sleeps when its gradient has `rows` rows."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rows: int, seconds: float) -> torch.Tensor:
        ctx.rows, ctx.seconds = rows, seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if grad.size(0) == ctx.rows:
            time.sleep(ctx.seconds)
        return grad, None, None


class _SlowInTheMiddle(nn.Module):
    """Linear -> Tanh -> slow identity -> Linear: the slow node is neither an output nor a frontier node."""

    def __init__(self, rows: int, seconds: float) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(5, 8), nn.Linear(8, 2)
        self.rows, self.seconds = rows, seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.first(x))
        return self.second(_SlowBackwardForRows.apply(hidden, self.rows, self.seconds))


def test_backward_time_goes_to_the_replica_that_spent_it(make_dp) -> None:
    seconds = 0.08
    dp = make_dp(_SlowInTheMiddle(rows=6, seconds=seconds), cpus(3), chunk_sizes=[2, 6, 2])
    dp(torch.randn(10, 5)).sum().backward()
    step = dp.last_step
    slow, *others = (step.replicas[1], step.replicas[0], step.replicas[2])
    assert slow.chunk_size == 6 and slow.backward_ms >= seconds * 1000
    assert all(r.backward_ms < seconds * 1000 for r in others)
    assert step.backward_ms >= slow.backward_ms


def test_records_are_frozen() -> None:
    record = ReplicaRecord(0, "cpu:0", 1, ((1,),), ((1,),), 1.0, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.chunk_size = 2  # type: ignore[misc]


def test_memory_bytes_follow_what_autograd_saves(make_dp) -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))
    dp = make_dp(module, cpus(3))
    x = torch.randn(10, 5, requires_grad=True)
    dp(x)
    for r, chunk in zip(dp.last_step.replicas, x.detach().chunk(3)):
        expected = saved_bytes(module, chunk.clone().requires_grad_(True))
        assert expected > chunk.numel() * chunk.element_size()  # more than the input alone
        assert r.memory_bytes == expected
    with torch.no_grad():
        dp(x)
    assert [r.memory_bytes for r in dp.last_step.replicas] == [0, 0, 0]


def test_memory_bytes_are_measured_once_per_kind_of_step_then_reused(make_dp, monkeypatch) -> None:
    # The saved-tensor hooks that measure them cost page faults on every step (see SavedBytesCache).
    hooked: list[int] = []
    real = torch.autograd.graph.saved_tensors_hooks

    def counting(pack, unpack):
        hooked.append(threading.get_ident())
        return real(pack, unpack)

    monkeypatch.setattr(torch.autograd.graph, "saved_tensors_hooks", counting)
    module = nn.Linear(5, 2)
    dp = make_dp(module, cpus(2))
    x = torch.randn(10, 5)
    weight_bytes = module.weight.numel() * module.weight.element_size()
    for _ in range(3):
        dp(x)
        assert [r.memory_bytes for r in dp.last_step.replicas] == [5 * 5 * 4, 5 * 5 * 4]
    assert len(hooked) == 2  # the first step, once per replica
    xg = x.clone().requires_grad_(True)  # a new key: the weight is saved too
    for _ in range(2):
        dp(xg)
        assert [r.memory_bytes for r in dp.last_step.replicas] == [5 * 5 * 4 + weight_bytes] * 2
    assert len(hooked) == 4
    with torch.no_grad():
        dp(x)
    assert [r.memory_bytes for r in dp.last_step.replicas] == [0, 0] and len(hooked) == 6
    steps = dp._saved_bytes.REFRESH  # and measured again now and then, for what no key shows
    for _ in range(steps):
        dp(x)
    assert len(hooked) == 8


def test_memory_bytes_of_a_linear_when_the_input_needs_grad(make_dp) -> None:
    module = nn.Linear(5, 2)
    dp = make_dp(module, cpus(3))
    x = torch.randn(10, 5, requires_grad=True)
    dp(x)
    weight_bytes = module.weight.numel() * module.weight.element_size()
    for r, rows in zip(dp.last_step.replicas, chunk_sizes(10, 3)):
        assert r.memory_bytes == rows * 5 * x.element_size() + weight_bytes


def test_step_counts_forwards(make_dp) -> None:
    dp = make_dp(nn.Linear(3, 1), cpus(2))
    x = torch.randn(4, 3)
    dp(x).sum().backward()
    with torch.no_grad():
        dp(x)
    dp(x)  # never backpropagated
    assert dp.last_step.step == 3
    dp(x).sum().backward()
    assert dp.last_step.step == 4 and dp.last_step.backward_ms is not None


def test_step_without_backward_is_published_at_the_end_of_the_next_backward(make_dp) -> None:
    dp = make_dp(nn.Linear(3, 1), cpus(2))
    got: list[StepRecord] = []
    dp.subscribe(got.append)
    x = torch.randn(4, 3)
    dp(x)  # the caller never runs its backward
    assert got == []
    dp(x).sum().backward()
    assert [r.step for r in got] == [1, 2]
    assert got[0].backward_ms is None and got[1].backward_ms is not None


# ----------------------------------------------------------------- subscribe


@pytest.mark.parametrize("count", [1, 3])
def test_subscribers_get_each_finished_record_once(make_dp, count: int) -> None:
    dp = make_dp(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1)), cpus(count))
    got: list[StepRecord] = []
    threads: list[str] = []

    def callback(record: StepRecord) -> None:
        got.append(record)
        threads.append(threading.current_thread().name)

    unsubscribe = dp.subscribe(callback)
    x = torch.randn(6, 3)

    out = dp(x)
    assert got == []  # waits for the backward
    out.sum().backward()
    assert len(got) == 1 and got[0].step == 1 and got[0].backward_ms is not None
    assert all(r.backward_ms is not None for r in got[0].replicas)
    assert dp.last_step is got[0]
    _ = dp.last_step  # reading it publishes nothing new
    assert len(got) == 1

    with torch.no_grad():
        dp(x)
    assert len(got) == 2 and got[1].step == 2 and got[1].backward_ms is None  # at once

    dp(x).sum().backward()
    assert [r.step for r in got] == [1, 2, 3]

    unsubscribe()
    dp(x).sum().backward()
    with torch.no_grad():
        dp(x)
    assert [r.step for r in got] == [1, 2, 3]
    assert dp.last_step.step == 5
    unsubscribe()  # twice is harmless


def test_several_subscribers(make_dp) -> None:
    dp = make_dp(nn.Linear(3, 1), cpus(2))
    a: list[int] = []
    b: list[int] = []
    dp.subscribe(lambda r: a.append(r.step))
    stop_b = dp.subscribe(lambda r: b.append(r.step))
    x = torch.randn(4, 3)
    dp(x).sum().backward()
    stop_b()
    dp(x).sum().backward()
    assert a == [1, 2] and b == [1]


def test_recording_off_gives_no_record_and_correct_results(make_dp) -> None:
    torch.manual_seed(1)
    module = nn.Linear(4, 2)
    reference = nn.Linear(4, 2)
    reference.load_state_dict(module.state_dict())
    dp = make_dp(module, cpus(3), record=False)
    got: list[StepRecord] = []
    dp.subscribe(got.append)
    x = torch.randn(7, 4)
    out = dp(x)
    torch.testing.assert_close(out, reference(x))
    out.sum().backward()
    reference(x).sum().backward()
    torch.testing.assert_close(module.weight.grad, reference.weight.grad)
    assert dp.last_step is None and got == []
    dp.recording = True  # it can be switched on later
    dp(x).sum().backward()
    assert len(got) == 1 and dp.last_step is got[0]


# ----------------------------------------------------------------- explicit splits


def test_explicit_chunk_sizes(make_dp) -> None:
    module = nn.Linear(3, 2)
    dp = make_dp(module, cpus(3), chunk_sizes=[20, 5, 5])
    x = torch.randn(30, 3)
    out = dp(x)
    assert dp.last_step.chunk_sizes == (20, 5, 5)
    assert dp.last_step.devices == ("cpu:0", "cpu:1", "cpu:2")
    torch.testing.assert_close(out, module(x))


def test_explicit_chunk_size_of_zero_idles_that_device(make_dp) -> None:
    module = nn.Linear(3, 2)
    dp = make_dp(module, cpus(3), chunk_sizes=[0, 10, 2])
    x = torch.randn(12, 3)
    torch.testing.assert_close(dp(x), module(x))
    assert dp.last_step.devices == ("cpu:1", "cpu:2") and dp.last_step.chunk_sizes == (10, 2)


@pytest.mark.parametrize(("rows", "weights"), [(30, [2, 1, 1]), (31, [1, 1, 1]), (11, [3, 2, 2, 1])])
def test_weighted_balance(make_dp, rows: int, weights: list[float]) -> None:
    module = nn.Linear(3, 2)
    dp = make_dp(module, cpus(len(weights)), balance="weights", weights=weights)
    x = torch.randn(rows, 3)
    out = dp(x)
    sizes = list(dp.last_step.chunk_sizes)
    assert sizes == largest_remainder(rows, weights)
    assert sum(sizes) == rows
    for size, w in zip(sizes, weights):
        assert abs(size - rows * w / sum(weights)) < 1
    torch.testing.assert_close(out, module(x))


def test_weighted_30_over_2_1_1(make_dp) -> None:
    dp = make_dp(nn.Linear(3, 2), cpus(3), balance="weights", weights=[2, 1, 1])
    dp(torch.randn(30, 3))
    sizes = dp.last_step.chunk_sizes
    assert sizes[0] == 15 and sorted(sizes[1:]) == [7, 8]


def test_zero_weight_device_idles(make_dp) -> None:
    class Where(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 2)
            self.threads: set[str] = set()

        def forward(self, x):
            self.threads.add(threading.current_thread().name)
            return self.lin(x)

    module = Where()
    dp = make_dp(module, cpus(3), balance="weights", weights=[1, 0, 1])
    x = torch.randn(10, 3)
    out = dp(x)
    torch.testing.assert_close(out, module.lin(x))
    assert dp.last_step.devices == ("cpu:0", "cpu:2")
    assert dp.last_step.chunk_sizes == (5, 5)
    assert [r.index for r in dp.last_step.replicas] == [0, 1]
    assert module.threads == {"dpengine-cpu:0", "dpengine-cpu:2"}
    out.sum().backward()
    assert dp.last_step.backward_ms is not None


@pytest.mark.parametrize(
    ("kwargs", "devices"),
    [
        (dict(balance="weights", weights=[1, 0, 1]), ("cpu:0", "cpu:2")),
        (dict(chunk_sizes=[0, 0, 0]), ("cpu:0", "cpu:1", "cpu:2")),
        ({}, ("cpu:0", "cpu:1", "cpu:2")),
    ],
)
def test_an_empty_batch_runs_with_every_split(make_dp, kwargs: dict, devices: tuple) -> None:
    module = nn.Linear(3, 2)
    dp = make_dp(module, cpus(3), **kwargs)
    x = torch.randn(0, 3)
    out = dp(x)
    assert out.shape == (0, 2)
    assert dp.last_step.devices == devices
    assert dp.last_step.chunk_sizes == (0,) * len(devices)
    out.sum().backward()
    assert module.weight.grad is not None and not module.weight.grad.any()


def test_set_split_changes_the_next_forward(make_dp) -> None:
    dp = make_dp(nn.Linear(3, 2), cpus(2))
    x = torch.randn(10, 3)
    dp(x)
    assert dp.last_step.chunk_sizes == (5, 5)
    dp.set_split(chunk_sizes=[7, 3])
    dp(x)
    assert dp.last_step.chunk_sizes == (7, 3)
    dp.set_split(balance="weights", weights=[1, 4])
    dp(x)
    assert dp.last_step.chunk_sizes == (2, 8)
    dp.set_split()
    dp(x)
    assert dp.last_step.chunk_sizes == (5, 5)


def test_balance_weighted_is_still_read_as_weights(make_dp) -> None:
    dp = make_dp(nn.Linear(3, 2), cpus(2), balance="weighted", weights=[1, 4])
    dp(torch.randn(10, 3))
    assert (dp.last_step.split, dp.last_step.chunk_sizes) == ("weights", (2, 8))


def test_set_devices_moves_the_next_forward_and_keeps_what_fits(make_dp) -> None:
    module = nn.Linear(3, 2)
    dp = make_dp(module, cpus(3), balance="weights", weights=[1, 1, 2])
    x = torch.randn(12, 3)
    dp(x)
    assert dp.last_step.chunk_sizes == (3, 3, 6)
    dp.set_devices(["cpu:1", "cpu:2", "cpu:3"])  # three again: the weights still fit
    torch.testing.assert_close(dp(x), module(x))
    assert (dp.last_step.devices, dp.last_step.chunk_sizes) == (("cpu:1", "cpu:2", "cpu:3"), (3, 3, 6))
    assert dp.output_device == torch.device("cpu", 1) and set(dp.worker_thread_ids()) == {"cpu:1", "cpu:2", "cpu:3"}
    dp.set_devices(["cpu:0", "cpu:1"])  # two: three weights do not fit, so torch's even split
    out = dp(x)
    out.sum().backward()
    assert (dp.last_step.devices, dp.last_step.chunk_sizes, dp.last_step.split) == (("cpu:0", "cpu:1"), (6, 6), "even")
    assert out.shape == (12, 2) and module.weight.grad is not None


def test_chunk_sizes_with_the_wrong_sum_raise(make_dp) -> None:
    module = nn.Linear(3, 2)
    dp = make_dp(module, cpus(3), chunk_sizes=[20, 5, 5])
    with pytest.raises(ValueError, match="sum to 30.*29 rows"):
        dp(torch.randn(29, 3))
    x = torch.randn(30, 3)
    torch.testing.assert_close(dp(x), module(x))  # still usable


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(chunk_sizes=[10, 10]), "one non-negative size per device"),
        (dict(chunk_sizes=[10, 10, 5, 5]), "one non-negative size per device"),
        (dict(chunk_sizes=[20, -5, 15]), "one non-negative size per device"),
        (dict(balance="weights", weights=[1, 1]), "one non-negative weight per device"),
        (dict(balance="weights", weights=[1, -1, 1]), "one non-negative weight per device"),
        (dict(balance="weights", weights=[0, 0, 0]), "not all zero"),
        (dict(balance="weights"), "needs weights"),
        (dict(weights=[1, 1, 1]), "only with balance='weights'"),
        (dict(balance="fastest"), "balance must be"),
        (dict(balance="weights", weights=[1, 1, 1], chunk_sizes=[1, 1, 1]), "not both"),
    ],
)
def test_bad_splits_raise(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DataParallel(nn.Linear(3, 2), cpus(3), **kwargs)
    dp = DataParallel(nn.Linear(3, 2), cpus(3))
    with pytest.raises(ValueError, match=match):
        dp.set_split(**kwargs)


# ----------------------------------------------------------------- concurrent and late backwards


def test_every_step_of_32_threads_calling_one_instance_at_once_is_recorded(make_dp) -> None:
    # One forward's step overwrote another's still open: 339 of 640 steps were published.
    dp = make_dp(nn.Linear(5, 2), cpus(3))
    got: list[StepRecord] = []
    lock = threading.Lock()

    def keep(record: StepRecord) -> None:
        with lock:
            got.append(record)

    dp.subscribe(keep)
    x = torch.randn(30, 5)
    expected = dp.module(x)
    wrong: list[str] = []
    start = threading.Barrier(32)

    def calls(thread: int) -> None:
        start.wait()
        for i in range(20):
            out = dp(x)
            if not torch.allclose(out, expected, atol=1e-6):
                wrong.append(f"thread {thread} call {i}")
            if i % 2:
                out.sum().backward()

    threads = [threading.Thread(target=calls, args=(t,)) for t in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    dp.flush_steps()
    assert wrong == []
    assert sorted(r.step for r in got) == list(range(1, 641))
    assert all(r.batch_size == 30 and [rep.chunk_size for rep in r.replicas] == [10, 10, 10] for r in got)
    # Each thread's backward times its own step: one thread's backward pass ending does not seal
    # another thread's step whose backward is still to come (31 of 320 came without one).
    assert sum(r.backward_ms is not None for r in got) == 320


def test_a_failed_call_takes_no_step_number(make_dp) -> None:
    dp = make_dp(nn.Linear(5, 2), cpus(2))
    got: list[StepRecord] = []
    dp.subscribe(got.append)
    dp(torch.randn(4, 5)).sum().backward()
    with pytest.raises(RuntimeError, match="replica 0 on device cpu:0"):
        dp(torch.randn(4, 3))  # the wrong width: every replica fails
    dp(torch.randn(4, 5)).sum().backward()
    dp.flush_steps()
    assert [r.step for r in got] == [1, 2]


def test_a_backward_over_two_forwards_gives_both_steps_their_backward(make_dp) -> None:
    dp = make_dp(nn.Linear(3, 1), cpus(2))
    got: list[StepRecord] = []
    dp.subscribe(got.append)
    first, second = dp(torch.randn(4, 3)), dp(torch.randn(4, 3))
    assert got == []  # the first step's backward may still come: it is not sealed at the second forward
    (first.sum() + second.sum()).backward()
    assert [r.step for r in got] == [1, 2]
    assert all(r.backward_ms is not None and all(rep.backward_ms is not None for rep in r.replicas) for r in got)


def test_forwards_whose_backward_never_comes_are_published_in_order_a_few_steps_late(make_dp) -> None:
    from dpengine.step_records import MAX_OPEN_STEPS

    dp = make_dp(nn.Linear(3, 1), cpus(2))
    got: list[StepRecord] = []
    dp.subscribe(got.append)
    for _ in range(MAX_OPEN_STEPS + 3):
        dp(torch.randn(4, 3))  # under grad, never backward: an evaluation without no_grad
    assert [r.step for r in got] == [1, 2, 3] and all(r.backward_ms is None for r in got)
    dp(torch.randn(4, 3)).sum().backward()  # the next backward pass settles every step before it
    assert [r.step for r in got] == list(range(1, MAX_OPEN_STEPS + 5))
    assert got[-1].backward_ms is not None and all(r.backward_ms is None for r in got[:-1])
