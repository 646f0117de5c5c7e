"""Subclasses that override forward() and call the pieces themselves, as real code does.

Transformer-XL's BalancedDataParallel cuts its batch with `Scatter.apply` and runs the
replicas with the module-level `parallel_apply(replicas, inputs, kwargs, device_ids)`;
PyTorch-Encoding's DataParallelCriterion scatters its targets, runs the replicas in threads of
its own and sums the losses with `comm.reduce_add`. Their steps are recorded from the pieces,
and the pieces (dpengine.comm, dpengine.parallel_functions) work on virtual CPU devices.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

import dpengine
from dpengine import DataParallel, comm
from dpengine.parallel_functions import Broadcast, Gather, ReduceAddCoalesced, Scatter


def cpus(count: int) -> list[str]:
    return [f"cpu:{i}" for i in range(count)]


def assert_grads_equal(a: nn.Module, b: nn.Module) -> None:
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert pb.grad is not None, name
        torch.testing.assert_close(pb.grad, pa.grad, msg=name)


class ViewsItsTarget(nn.Module):
    """Sequence-first like Transformer-XL: [len, batch] in, `target.view(-1)` inside."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.out = nn.Linear(4, 10)

    def forward(self, data, target):
        logit = self.out(self.emb(data)).view(-1, 10)
        return F.cross_entropy(logit, target.view(-1), reduction="none").view(target.shape)


class Balanced(DataParallel):
    """BalancedDataParallel's forward, scatter and parallel_apply, over dpengine's pieces."""

    def __init__(self, gpu0_bsz: int, *args, **kwargs) -> None:
        self.gpu0_bsz = gpu0_bsz
        super().__init__(*args, **kwargs)

    def forward(self, *inputs, **kwargs):
        device_ids = self.device_ids if self.gpu0_bsz else self.device_ids[1:]
        inputs, kwargs = self.scatter(inputs, kwargs, device_ids)
        replicas = self.replicate(self.module, self.device_ids)
        if not self.gpu0_bsz:
            replicas = replicas[1:]
        outputs = self.parallel_apply(replicas, device_ids, inputs, kwargs)
        return self.gather(outputs, self.output_device)

    def parallel_apply(self, replicas, device_ids, inputs, kwargs):
        return dpengine.parallel_apply(replicas, inputs, kwargs, device_ids)

    def scatter(self, inputs, kwargs, device_ids):
        rows = inputs[0].size(self.dim)
        rest = len(self.device_ids) - 1
        sizes = [self.gpu0_bsz] + [(rows - self.gpu0_bsz) // rest] * rest
        for i in range(rows - sum(sizes)):
            sizes[i + 1] += 1
        sizes = sizes if self.gpu0_bsz else sizes[1:]
        per_tensor = [Scatter.apply(device_ids, sizes, self.dim, t) for t in inputs]
        return list(zip(*per_tensor)), [{} for _ in sizes]


@pytest.mark.parametrize(("gpu0_bsz", "chunks", "devices"),
                         [(2, (2, 6, 6), ("cpu:0", "cpu:1", "cpu:2")), (0, (7, 7), ("cpu:1", "cpu:2"))])
def test_a_forward_override_over_the_pieces_is_recorded_as_it_split(gpu0_bsz, chunks, devices) -> None:
    torch.manual_seed(1)
    model = ViewsItsTarget()
    plain = copy.deepcopy(model)
    dp = Balanced(gpu0_bsz, model, cpus(3), dim=1)
    try:
        data, target = torch.randint(0, 10, (5, 14)), torch.randint(0, 10, (5, 14))
        loss = dp(data, target)  # .view(-1) of a dim-1 chunk: Scatter gives contiguous chunks
        torch.testing.assert_close(loss, plain(data, target))
        loss.mean().backward()
        plain(data, target).mean().backward()
        assert_grads_equal(plain, model)
        record = dp.last_step
        assert (record.chunk_sizes, record.devices, record.batch_size) == (chunks, devices, 14)
        assert all(r.forward_timed and r.forward_ms > 0 and r.backward_ms is not None for r in record.replicas)
        assert record.backward_ms is not None and record.apply_ms > 0
        dp(data, target).mean().backward()
        assert dp.last_step.step == 2  # one step per forward
    finally:
        dp.close()


def test_an_override_that_calls_the_base_forward_is_recorded_once() -> None:
    calls: list[str] = []

    class Logs(DataParallel):
        def forward(self, *inputs, **kwargs):
            calls.append("logs")
            return super().forward(*inputs, **kwargs)

    class LogsMore(Logs):
        def forward(self, *inputs, **kwargs):
            calls.append("logs more")
            return super().forward(*inputs, **kwargs)

    model = nn.Linear(3, 2)
    dp = LogsMore(model, cpus(2))
    try:
        x = torch.randn(6, 3)
        dp(x).sum().backward()
        dp(x).sum().backward()
        assert calls == ["logs more", "logs"] * 2
        assert dp.last_step.step == 2 and dp.last_step.chunk_sizes == (3, 3)
        assert all(r.forward_timed and r.backward_ms is not None for r in dp.last_step.replicas)
    finally:
        dp.close()


class Reduce(Function):
    """PyTorch-Encoding's: comm.reduce_add forward, Broadcast of the gradient backward."""

    @staticmethod
    def forward(ctx, *inputs):
        ctx.target_gpus = [inputs[i].get_device() for i in range(len(inputs))]
        return comm.reduce_add(sorted(inputs, key=lambda i: i.get_device()))

    @staticmethod
    def backward(ctx, grad_output):
        return Broadcast.apply(ctx.target_gpus, grad_output)


class Criterion(DataParallel):
    """DataParallelCriterion: the targets scattered, the replicas run in threads of its own."""

    def forward(self, inputs, *targets, **kwargs):
        targets, kwargs = self.scatter(targets, kwargs, self.device_ids)
        replicas = self.replicate(self.module, self.device_ids[:len(inputs)])
        results: dict[int, torch.Tensor] = {}

        def run(i):
            results[i] = replicas[i](inputs[i], *targets[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(replicas))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return Reduce.apply(*[results[i] for i in range(len(replicas))]) / len(replicas)


def test_an_override_running_its_own_threads_is_recorded_untimed_as_it_scattered() -> None:
    torch.manual_seed(2)
    net = nn.Linear(4, 3)
    plain = copy.deepcopy(net)
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    model = dpengine.DataParallel(net, cpus(3))
    criterion = Criterion(nn.CrossEntropyLoss(), cpus(3))
    try:
        outputs = model.scatter((x,), {}, model.device_ids)[0]
        per_device = [net(*a) for a in outputs]
        loss = criterion(per_device, y)
        expected = sum(F.cross_entropy(plain(x[i:i + 2]), y[i:i + 2]) for i in (0, 2, 4)) / 3
        torch.testing.assert_close(loss, expected)
        loss.backward()
        expected.backward()
        assert_grads_equal(plain, net)
        record = criterion.last_step
        assert (record.chunk_sizes, record.batch_size) == ((2, 2, 2), 6)
        assert [r.forward_timed for r in record.replicas] == [False] * 3
        assert all(r.forward_ms == pytest.approx(record.apply_ms) for r in record.replicas)
    finally:
        model.close()
        criterion.close()


def test_an_override_that_splits_nothing_records_no_step() -> None:
    class Unsplit(DataParallel):
        def forward(self, *inputs, **kwargs):
            return self.module(*inputs, **kwargs)

    model = nn.Linear(3, 2)
    dp = Unsplit(model, cpus(2))
    seen = []
    dp.subscribe(seen.append)
    x = torch.randn(4, 3)
    torch.testing.assert_close(dp(x), model(x))
    assert dp.last_step is None and seen == []


def test_module_level_parallel_apply_outside_a_forward_records_nothing(make_dp) -> None:
    dp = make_dp(nn.Linear(3, 2), cpus(2))
    replicas = dp.replicate(dp.module, dp.device_ids)
    outputs = dpengine.parallel_apply(replicas, [torch.randn(2, 3), torch.randn(3, 3)], None, dp.device_ids)
    assert [o.shape[0] for o in outputs] == [2, 3]
    assert dp.last_step is None


# ----------------------------------------------------------------- torch's pieces on virtual devices


def test_scatter_and_gather_on_virtual_devices_are_torchs_functions() -> None:
    x = torch.randn(4, 9, requires_grad=True)
    chunks = Scatter.apply(cpus(3), [2, 3, 4], 1, x)
    assert [c.shape[1] for c in chunks] == [2, 3, 4] and all(c.is_contiguous() for c in chunks)
    assert [c.shape[1] for c in Scatter.apply(cpus(3), None, 1, x)] == [3, 3, 3]  # torch.chunk's rule
    whole = Gather.apply(-1, 1, *[c * (i + 1) for i, c in enumerate(chunks)])
    torch.testing.assert_close(whole, torch.cat([x[:, :2], 2 * x[:, 2:5], 3 * x[:, 5:]], 1))
    whole.sum().backward()
    torch.testing.assert_close(x.grad, torch.cat([torch.full((4, 2), 1.0), torch.full((4, 3), 2.0),
                                                  torch.full((4, 4), 3.0)], 1))
    with pytest.warns(UserWarning, match="all input tensors were scalars"):
        assert Gather.apply("cpu", 0, torch.tensor(1.0), torch.tensor(2.0)).tolist() == [1.0, 2.0]


def test_broadcast_and_reduce_add_on_virtual_devices_sum_the_gradients_back() -> None:
    w = torch.randn(3, requires_grad=True)
    copies = Broadcast.apply([-1, -1, -1], w)
    assert len(copies) == 3 and all(torch.equal(c, w) for c in copies)
    sum((i + 1) * c.sum() for i, c in enumerate(copies)).backward()
    torch.testing.assert_close(w.grad, torch.full((3,), 6.0))
    a, b = torch.ones(2), torch.full((2,), 2.0)
    torch.testing.assert_close(comm.reduce_add([a, b, a]), torch.full((2,), 4.0))
    sums = ReduceAddCoalesced.apply(-1, 2, a, b, b, a)
    torch.testing.assert_close(torch.stack(sums), torch.full((2, 2), 3.0))
    first, second = comm.broadcast_coalesced([a, b], ["cpu:0", "cpu:1"])
    assert first[0] is a and torch.equal(second[1], b) and second[1].data_ptr() != b.data_ptr()
    with pytest.raises(ValueError, match="input 1 has invalid size: got 3, but expected 2"):
        comm.reduce_add([a, torch.ones(3)])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_pieces_are_torchs_own() -> None:
    from torch.nn.parallel import _functions as torch_functions
    from torch.nn.parallel import comm as torch_comm

    x = torch.randn(6, 4, device="cuda:0", requires_grad=True)
    ours, theirs = Scatter.apply([0], [6], 0, x), torch_functions.Scatter.apply([0], [6], 0, x)
    assert [t.device for t in ours] == [t.device for t in theirs] and torch.equal(ours[0], theirs[0])
    assert type(ours[0].grad_fn).__name__ == type(theirs[0].grad_fn).__name__
    torch.testing.assert_close(comm.reduce_add([x, x]), torch_comm.reduce_add([x, x]))
    torch.testing.assert_close(Gather.apply(0, 0, x, x), torch_functions.Gather.apply(0, 0, x, x))
    assert Broadcast.apply([0], x)[0].device == x.device


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_a_forward_override_over_torchs_pieces_is_recorded_with_its_events() -> None:
    class Pieces(DataParallel):  # torch's Scatter and the module-level parallel_apply, on GPU 0
        def forward(self, x):
            chunks = Scatter.apply(self.device_ids, None, self.dim, x)
            replicas = self.replicate(self.module, self.device_ids[:len(chunks)])
            outputs = dpengine.parallel_apply(replicas, [(c,) for c in chunks], None, self.device_ids[:len(chunks)])
            return self.gather(outputs, self.output_device)

    torch.manual_seed(4)
    model = nn.Linear(8, 4).cuda()
    plain = copy.deepcopy(model)
    dp = Pieces(model, [0])
    try:
        x = torch.randn(6, 8, device="cuda")
        out = dp(x)
        torch.testing.assert_close(out, plain(x))
        out.sum().backward()
        plain(x).sum().backward()
        assert_grads_equal(plain, model)
        torch.cuda.synchronize()  # reading last_step never waits for the device
        record = dp.last_step
        assert (record.chunk_sizes, record.devices) == ((6,), ("cuda:0",))
        assert record.replicas[0].forward_timed and record.replicas[0].forward_ms > 0
        assert record.replicas[0].peak_memory_bytes
    finally:
        dp.close()
