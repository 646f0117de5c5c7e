"""DataParallel on virtual CPU devices: parity with the plain module, state, errors, threads."""

from __future__ import annotations

import copy
import gc
import sys
import threading
from collections import OrderedDict, namedtuple

import pytest
import torch
from torch import nn

import dpengine
from dpengine.replicate import replicate_shared

rep = sys.modules["dpengine.replicate"]  # `dpengine.replicate` is the function, as in torch

Out = namedtuple("Out", ["logits", "norm"])
DEVICE_COUNTS = [1, 2, 3, 4]


def cpus(count: int) -> list[str]:
    return [f"cpu:{i}" for i in range(count)]


# ----------------------------------------------------------------- models


def make_linear() -> nn.Module:
    return nn.Linear(5, 3)


def make_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 8), nn.GELU(), nn.Linear(8, 3))


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 3)
        with torch.no_grad():  # non-trivial running statistics for eval mode
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        return self.head(h.mean((2, 3)))


def make_convnet() -> nn.Module:
    return ConvNet().eval()


MODELS = {
    "linear": (make_linear, lambda n: (torch.randn(n, 5),)),
    "mlp": (make_mlp, lambda n: (torch.randn(n, 5),)),
    "convnet": (make_convnet, lambda n: (torch.randn(n, 3, 6, 6),)),
}


def assert_grads_equal(a: nn.Module, b: nn.Module) -> None:
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert pb.grad is not None, name
        torch.testing.assert_close(pb.grad, pa.grad, atol=1e-5, rtol=1e-5, msg=name)


def assert_params_equal(a: nn.Module, b: nn.Module) -> None:
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        torch.testing.assert_close(pb, pa, atol=1e-5, rtol=1e-5, msg=name)


# ----------------------------------------------------------------- parity


@pytest.mark.parametrize("count", DEVICE_COUNTS)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_outputs_and_gradients_match_the_plain_module(make_dp, model: str, count: int) -> None:
    torch.manual_seed(count)
    make, inputs = MODELS[model]
    plain = make()
    dp = make_dp(copy.deepcopy(plain), cpus(count))
    x = inputs(10)
    target = torch.randn(10, 3)
    out_plain, out_dp = plain(*x), dp(*x)
    torch.testing.assert_close(out_dp, out_plain, atol=1e-5, rtol=1e-5)
    nn.functional.mse_loss(out_plain, target).backward()
    nn.functional.mse_loss(out_dp, target).backward()
    assert_grads_equal(plain, dp.module)


@pytest.mark.parametrize("count", DEVICE_COUNTS)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_optimizer_steps_match(make_dp, model: str, optimizer: str, count: int) -> None:
    torch.manual_seed(100 + count)
    make, inputs = MODELS[model]
    plain = make()
    dp = make_dp(copy.deepcopy(plain), cpus(count))

    def opt(m: nn.Module) -> torch.optim.Optimizer:
        if optimizer == "sgd":
            return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        return torch.optim.Adam(m.parameters(), lr=0.01)

    opt_plain, opt_dp = opt(plain), opt(dp.module)
    for step in range(4):
        batch = 9 + step  # uneven splits too
        x, target = inputs(batch), torch.randn(batch, 3)
        for m, o in ((plain, opt_plain), (dp, opt_dp)):
            o.zero_grad()
            nn.functional.mse_loss(m(*x), target).backward()
            o.step()
        assert_params_equal(plain, dp.module)
    assert dp.last_step.step == 4


@pytest.mark.parametrize("count", DEVICE_COUNTS)
def test_kwargs_inputs(make_dp, count: int) -> None:
    class WithKwargs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x, *, bias=None, scale=1.0, mask=None):
            out = self.lin(x) * scale
            if bias is not None:
                out = out + bias
            if mask is not None:
                out = out * mask
            return out

    torch.manual_seed(0)
    plain = WithKwargs()
    dp = make_dp(copy.deepcopy(plain), cpus(count))
    x, bias, mask = torch.randn(7, 4), torch.randn(7, 2), (torch.rand(7, 1) > 0.3).float()
    kwargs = dict(bias=bias, scale=0.5, mask=mask)
    out_plain, out_dp = plain(x, **kwargs), dp(x, **kwargs)
    torch.testing.assert_close(out_dp, out_plain)
    out_plain.pow(2).sum().backward()
    out_dp.pow(2).sum().backward()
    assert_grads_equal(plain, dp.module)
    # kwargs only, no positional input at all
    torch.testing.assert_close(dp(x=x, bias=bias), plain(x=x, bias=bias))


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        y = self.lin(x)
        return (
            y,
            {"double": y * 2, "pair": [y.sum(1), (y.tanh(),)]},
            OrderedDict(z=y - 1, a=y + 1),
            Out(y, y.norm(dim=1)),
        )


@pytest.mark.parametrize("count", DEVICE_COUNTS)
def test_nested_outputs_keep_their_types(make_dp, count: int) -> None:
    torch.manual_seed(1)
    plain = Nested()
    dp = make_dp(copy.deepcopy(plain), cpus(count))
    x = torch.randn(6, 4)
    out_plain, out_dp = plain(x), dp(x)
    assert type(out_dp) is tuple
    assert type(out_dp[1]) is dict and type(out_dp[1]["pair"]) is list
    assert type(out_dp[1]["pair"][1]) is tuple
    assert type(out_dp[2]) is OrderedDict and list(out_dp[2]) == ["z", "a"]
    assert type(out_dp[3]) is Out
    torch.testing.assert_close(out_dp, out_plain)

    def loss(out):
        return out[0].sum() + out[1]["pair"][1][0].sum() + out[2]["a"].pow(2).sum() + out[3].norm.sum()

    loss(out_plain).backward()
    loss(out_dp).backward()
    assert_grads_equal(plain, dp.module)


@pytest.mark.parametrize("count", DEVICE_COUNTS)
def test_dim_1(make_dp, count: int) -> None:
    torch.manual_seed(2)
    plain = make_mlp()
    dp = make_dp(copy.deepcopy(plain), cpus(count), dim=1)
    x = torch.randn(3, 10, 5)  # (time, batch, features)
    out_plain, out_dp = plain(x), dp(x)
    torch.testing.assert_close(out_dp, out_plain, atol=1e-5, rtol=1e-5)
    expected = [c.size(1) for c in x.chunk(count, 1)]
    assert list(dp.last_step.chunk_sizes) == expected
    out_plain.sum().backward()
    out_dp.sum().backward()
    assert_grads_equal(plain, dp.module)


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_batches_smaller_than_the_device_count(make_dp, batch: int) -> None:
    torch.manual_seed(3)
    plain = make_mlp()
    dp = make_dp(copy.deepcopy(plain), cpus(4))
    x = torch.randn(batch, 5)
    out_plain, out_dp = plain(x), dp(x)
    torch.testing.assert_close(out_dp, out_plain, atol=1e-5, rtol=1e-5)
    assert list(dp.last_step.chunk_sizes) == [c.size(0) for c in x.chunk(4)]
    out_plain.sum().backward()
    out_dp.sum().backward()
    assert_grads_equal(plain, dp.module)


@pytest.mark.parametrize("count", [2, 3])
def test_double_backward_gradient_penalty(make_dp, count: int) -> None:
    torch.manual_seed(4)
    plain = make_mlp()
    dp = make_dp(copy.deepcopy(plain), cpus(count))
    x = torch.randn(8, 5)

    def penalty(model):
        xi = x.clone().requires_grad_(True)
        out = model(xi)
        (grad_x,) = torch.autograd.grad(out.pow(2).sum(), xi, create_graph=True)
        loss = out.sum() + grad_x.pow(2).sum()
        loss.backward()
        return grad_x.detach()

    torch.testing.assert_close(penalty(dp), penalty(plain), atol=1e-5, rtol=1e-5)
    assert_grads_equal(plain, dp.module)


@pytest.mark.parametrize("count", [1, 3])
def test_input_that_requires_grad_gets_the_right_grad(make_dp, count: int) -> None:
    torch.manual_seed(5)
    plain = make_mlp()
    dp = make_dp(copy.deepcopy(plain), cpus(count))
    x_plain = torch.randn(10, 5, requires_grad=True)
    x_dp = x_plain.detach().clone().requires_grad_(True)
    weights = torch.randn(10, 3)
    (plain(x_plain) * weights).sum().backward()
    (dp(x_dp) * weights).sum().backward()
    torch.testing.assert_close(x_dp.grad, x_plain.grad, atol=1e-5, rtol=1e-5)
    assert_grads_equal(plain, dp.module)


def test_train_mode_batchnorm_keeps_statistics_of_chunk_0(make_dp) -> None:
    torch.manual_seed(6)
    bn = nn.BatchNorm1d(4)
    reference = copy.deepcopy(bn)  # fed chunk 0 only: what torch's DataParallel leaves behind
    whole = copy.deepcopy(bn)  # fed the whole batch
    dp = make_dp(bn, cpus(3))
    x = torch.randn(12, 4) * torch.tensor([1.0, 2.0, 3.0, 4.0]) + torch.arange(12.0).unsqueeze(1)
    out = dp(x)
    expected_out = torch.cat([copy.deepcopy(whole)(c) for c in x.chunk(3)])  # per-chunk batch stats
    torch.testing.assert_close(out, expected_out, atol=1e-5, rtol=1e-5)
    reference(x.chunk(3)[0])
    whole(x)
    torch.testing.assert_close(bn.running_mean, reference.running_mean)
    torch.testing.assert_close(bn.running_var, reference.running_var)
    assert bn.num_batches_tracked.item() == reference.num_batches_tracked.item() == 1
    assert not torch.allclose(bn.running_mean, whole.running_mean)  # really chunk 0, not the batch


def test_buffers_are_shared_with_the_original_on_replica_0_only(make_dp) -> None:
    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("count", torch.zeros(()))

        def forward(self, x):
            self.count += x.size(0)
            return x

    counter = Counter()
    dp = make_dp(counter, cpus(3))
    dp(torch.randn(10, 2))
    assert counter.count.item() == torch.randn(10, 2).chunk(3)[0].size(0)


# ----------------------------------------------------------------- thread-local state


class StateProbe(nn.Module):
    """Linear that records, per replica thread, the torch state it ran under."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.seen: dict[str, dict] = {}
        self._lock = threading.Lock()

    def forward(self, x):
        out = self.lin(x)
        state = {
            "grad": torch.is_grad_enabled(),
            "inference": torch.is_inference_mode_enabled(),
            "autocast": torch.is_autocast_enabled("cpu"),
            "autocast_dtype": torch.get_autocast_dtype("cpu"),
            "out_dtype": out.dtype,
            "num_threads": torch.get_num_threads(),
        }
        with self._lock:
            self.seen[threading.current_thread().name] = state
        return out


def test_no_grad_reaches_the_workers(make_dp) -> None:
    probe = StateProbe()
    dp = make_dp(probe, cpus(3))
    x = torch.randn(6, 4)
    dp(x).sum().backward()
    assert len(probe.seen) == 3 and all(s["grad"] for s in probe.seen.values())
    probe.seen.clear()
    with torch.no_grad():
        out = dp(x)
    assert len(probe.seen) == 3 and not any(s["grad"] for s in probe.seen.values())
    assert not out.requires_grad
    torch.testing.assert_close(out, probe.lin(x).detach())


def test_inference_mode_reaches_the_workers(make_dp) -> None:
    probe = StateProbe()
    dp = make_dp(probe, cpus(2))
    x = torch.randn(6, 4)
    dp(x)
    assert not any(s["inference"] for s in probe.seen.values())
    probe.seen.clear()
    with torch.inference_mode():
        out = dp(x)
    assert len(probe.seen) == 2 and all(s["inference"] for s in probe.seen.values())
    assert out.is_inference()
    with torch.no_grad():
        torch.testing.assert_close(out, probe.lin(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_autocast_and_its_dtype_reach_the_workers(make_dp, dtype: torch.dtype) -> None:
    probe = StateProbe()
    dp = make_dp(probe, cpus(3))
    x = torch.randn(6, 4)
    with torch.autocast("cpu", dtype=dtype):
        out = dp(x)
        expected = probe.lin(x)
    assert len(probe.seen) == 3
    for state in probe.seen.values():
        assert state["autocast"] and state["autocast_dtype"] == dtype
        assert state["out_dtype"] == dtype
    assert out.dtype == dtype == expected.dtype
    torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)
    # and it does not leak into the next call
    probe.seen.clear()
    assert dp(x).dtype == torch.float32
    assert not any(s["autocast"] for s in probe.seen.values())


# ----------------------------------------------------------------- errors


class FailsOnSentinel(nn.Module):
    SENTINEL = 12345.0

    def __init__(self, error: type[Exception]) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.error = error

    def forward(self, x):
        if x[0, 0].item() == self.SENTINEL:
            raise self.error("sentinel seen")
        return self.lin(x)


@pytest.mark.parametrize("error", [ValueError, KeyError])
def test_replica_error_is_reraised_with_replica_and_device(make_dp, error) -> None:
    module = FailsOnSentinel(error)
    dp = make_dp(module, cpus(3))
    x = torch.randn(9, 3)
    x[6, 0] = FailsOnSentinel.SENTINEL  # first row of chunk 2 (rows 6..8)
    with pytest.raises(error) as info:
        dp(x)
    assert "in replica 2 on device cpu:2" in str(info.value)
    assert "sentinel seen" in str(info.value)
    failure = dpengine.replica_failure(info.value)
    assert failure is not None and failure.index == 2 and failure.device == "cpu:2"
    # The same object keeps working afterwards.
    good = torch.randn(9, 3)
    torch.testing.assert_close(dp(good), module.lin(good))
    dp(good).sum().backward()
    assert module.lin.weight.grad is not None


def test_replica_failure_names_the_device_that_ran_it(make_dp) -> None:
    # With a zero weight, replica 1 runs on cpu:2: index and device are reported separately.
    module = FailsOnSentinel(ValueError)
    dp = make_dp(module, cpus(3), balance="weights", weights=[1, 0, 1])
    x = torch.randn(8, 3)
    x[4, 0] = FailsOnSentinel.SENTINEL
    with pytest.raises(ValueError, match="in replica 1 on device cpu:2") as info:
        dp(x)
    failure = dpengine.replica_failure(info.value)
    assert (failure.index, failure.device) == (1, "cpu:2")


class MemsFromParameters(nn.Module):
    """kimiyoung/transformer-xl pytorch/mem_transformer.py init_mems: its dtype and device from a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        param = next(self.parameters())
        return self.lin(x.to(param.dtype))


def test_a_replica_taking_next_of_its_empty_parameters_is_told_why(make_dp) -> None:
    # Unsplit (plain torch without GPUs) it runs; every replica, as on GPUs, has no parameters().
    module = MemsFromParameters()
    module(torch.randn(2, 3))
    with pytest.raises(StopIteration) as info:
        make_dp(module, cpus(2))(torch.randn(4, 3))
    assert "in replica 0 on device cpu:0 (a replica's parameters() is empty" in str(info.value)


def test_errors_not_from_a_replica_have_no_failure_info() -> None:
    assert dpengine.replica_failure(ValueError("plain")) is None


def test_no_reference_cycles(make_dp) -> None:
    # Mirrors torch's test_data_parallel_model_no_refcycles, with a backward as well.
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(1, 1)

        def forward(self, x):
            return self.linear(x)

    gc.collect()
    model = make_dp(Model(), cpus(2))
    data = torch.randn(4, 1)
    model(data).sum().backward()
    assert gc.collect() == 0
    model(data).sum().backward()
    assert model.last_step.backward_ms is not None
    assert gc.collect() == 0
    with torch.no_grad():
        model(data)
    assert gc.collect() == 0


# ----------------------------------------------------------------- threads


def test_workers_are_persistent(make_dp) -> None:
    module = nn.Linear(4, 2)
    dp = make_dp(module, cpus(2))
    x = torch.randn(4, 4)
    dp(x).sum().backward()
    baseline = threading.active_count()
    ids = dp.worker_thread_ids()
    assert sorted(ids) == ["cpu:0", "cpu:1"] and len(set(ids.values())) == 2
    names = {t.name for t in threading.enumerate() if t.native_id in ids.values()}
    assert names == {"dpengine-cpu:0", "dpengine-cpu:1"}
    for _ in range(1000):
        dp(x).sum().backward()
        assert threading.active_count() <= baseline
    assert threading.active_count() == baseline
    assert dp.worker_thread_ids() == ids
    assert dp.last_step.step == 1001


def test_worker_names_and_no_threads_before_first_use(make_dp) -> None:
    before = {t.ident for t in threading.enumerate()}
    dp = make_dp(nn.Linear(2, 2), cpus(3))
    assert dp.worker_thread_ids() == {}
    dp(torch.randn(3, 2))
    new = [t for t in threading.enumerate() if t.ident not in before]
    assert sorted(t.name for t in new) == ["dpengine-cpu:0", "dpengine-cpu:1", "dpengine-cpu:2"]
    assert all(t.daemon for t in new)
    dp.close()
    for t in new:
        t.join(timeout=5)
        assert not t.is_alive()


def test_intra_op_threads_split_across_replicas_and_default_restored(make_dp, keep_num_threads) -> None:
    main = torch.get_num_threads()
    probe = StateProbe()
    dp = make_dp(probe, cpus(2))
    dp(torch.randn(4, 4)).sum().backward()
    dp(torch.randn(4, 4))
    # Replica threads and intra-op threads must not oversubscribe the cores.
    expected = max(1, main // 2)
    assert {s["num_threads"] for s in probe.seen.values()} == {expected}
    if main == 2:  # this project's 2-core machine
        assert expected == 1
    # The caller and threads made afterwards keep the process default.
    assert torch.get_num_threads() == main
    seen: list[int] = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert seen == [main]


# ----------------------------------------------------------------- misc


def test_single_device_runs_on_the_caller_thread(make_dp) -> None:
    probe = StateProbe()
    dp = make_dp(probe, ["cpu:0"])
    x = torch.randn(5, 4)
    torch.testing.assert_close(dp(x), probe.lin(x))
    assert list(probe.seen) == [threading.current_thread().name]
    assert dp.worker_thread_ids() == {}
    assert list(dp.last_step.devices) == ["cpu:0"] and list(dp.last_step.chunk_sizes) == [5]


def test_no_device_ids_without_cuda_calls_the_module_directly(make_dp) -> None:
    if torch.cuda.is_available():
        pytest.skip("device_ids=None means every GPU when CUDA is available")
    probe = StateProbe()
    before = threading.active_count()
    dp = make_dp(probe)
    x = torch.randn(5, 4)
    out = dp(x)
    torch.testing.assert_close(out, probe.lin(x))
    assert list(probe.seen) == [threading.current_thread().name]
    assert dp.last_step is None and dp.worker_thread_ids() == {}
    assert threading.active_count() == before
    assert dp.devices == [] and dp.device_ids == []


def test_module_on_the_wrong_device_is_refused(make_dp) -> None:
    dp = make_dp(nn.Linear(2, 2).to(torch.float64), cpus(2))
    # a parameter on the meta device is not on cpu:0
    dp.module.weight = nn.Parameter(torch.empty(2, 2, device="meta"))
    with pytest.raises(RuntimeError, match="device_ids\\[0\\]"):
        dp(torch.randn(2, 2, dtype=torch.float64))


def test_replicas_do_not_keep_python_attribute_changes(make_dp) -> None:
    class Tally(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            self.calls += 1
            return self.lin(x)

    module = Tally()
    dp = make_dp(module, cpus(2))
    dp(torch.randn(4, 2))
    assert module.calls == 0  # torch's rule: replicas are shallow copies
    assert module.lin.weight.grad is None


# ----------------------------------------------------------------- summing gradients in place


def _replica_forward(module: nn.Module, x: torch.Tensor, count: int):
    chunks = x.chunk(count)
    replicas = replicate_shared(module, len(chunks))
    return [replica(chunk) for replica, chunk in zip(replicas, chunks)]


@pytest.mark.parametrize("summed", [False, True])
def test_replica_gradients_of_a_shared_weight_are_summed_in_place(monkeypatch, summed: bool) -> None:
    if summed:  # a weight this small is left to autograd unless the threshold says otherwise
        monkeypatch.setattr(rep, "MIN_SUMMED_ELEMENTS", 0)
    torch.manual_seed(6)
    lin = nn.Linear(6, 5)
    plain = copy.deepcopy(lin)
    x = torch.randn(8, 6)
    outputs = _replica_forward(lin, x, 4)
    # Where each replica's weight gradient lies, as autograd hands it to the parameter.
    arrived: list[int] = []
    for out in outputs:
        (share,) = [n for n, _ in out.grad_fn.next_functions if type(n).__name__ == "TBackward0"]
        while type(share).__name__ != "SharedParametersBackward":
            share = share.next_functions[0][0]
        share.register_hook(lambda grad_inputs, _: arrived.append(grad_inputs[0].data_ptr()))
    torch.cat(outputs).pow(2).sum().backward()
    plain(x).pow(2).sum().backward()
    assert_grads_equal(plain, lin)
    assert len(arrived) == 4
    # Summed in place: the first gradient to arrive became the sum, instead of autograd making
    # a new tensor for the first sum (three weight-sized tensors alive at once).
    assert (lin.weight.grad.data_ptr() in arrived) is summed


def test_replica_gradients_keep_double_backward_through_the_callers_use_of_the_weight() -> None:
    torch.manual_seed(7)
    lin = nn.Linear(4, 4, bias=False)
    plain = copy.deepcopy(lin)
    x = torch.randn(6, 4)

    def loss_of(module: nn.Module, replicas: int | None) -> torch.Tensor:
        xi = x.clone().requires_grad_(True)
        h = module(xi)  # the caller's graph above the replicas uses the same weight
        out = module(h) if replicas is None else torch.cat(_replica_forward(module, h, replicas))
        (grad_x,) = torch.autograd.grad(out.pow(2).sum(), xi, create_graph=True)
        return out.sum() + grad_x.pow(2).sum()

    loss_of(lin, 3).backward()
    loss_of(plain, None).backward()
    assert_grads_equal(plain, lin)


def test_each_replica_hands_its_gradients_to_the_parameters_before_the_next_replica_starts(make_dp) -> None:
    # The replicas' SharedParameters nodes are made in their workers, so each runs as soon as
    # its replica's gradients are in: never are two replicas' weight gradients alive at once.
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    dp = make_dp(model, cpus(3))
    for _ in range(3):  # the callers' own autograd numbers grow meanwhile, as in training
        model(torch.randn(5, 4)).sum().backward()
        out = dp(torch.randn(9, 4))
        order: list[tuple[str, int]] = []
        for replica, (output_node, _) in enumerate(out.grad_fn.next_functions):
            output_node.register_prehook(lambda _, r=replica: order.append(("start", r)))
            stack, seen = [output_node], set()
            while stack:
                node = stack.pop()
                if type(node).__name__ == "SharedParametersBackward":
                    node.register_prehook(lambda _, r=replica: order.append(("share", r)))
                    continue
                for child, _ in node.next_functions:
                    if child is not None and child not in seen:
                        seen.add(child)
                        stack.append(child)
        out.sum().backward()
        assert len(order) == 6
        assert [kind for kind, _ in order] == ["start", "share"] * 3
        assert all(order[i][1] == order[i + 1][1] for i in range(0, 6, 2))
