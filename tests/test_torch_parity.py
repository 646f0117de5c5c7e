"""What torch's own DataParallel tests check, in our words, on virtual CPU devices.

Subclasses overriding the four steps, zero gradients for unused parameters, replica
parameters that are non-leaf, zero_grad() inside a replica, and the functional forms.
"""

from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch
from torch import nn

import dpengine
from dpengine import DataParallel


def cpus(count: int) -> list[str]:
    return [f"cpu:{i}" for i in range(count)]


def assert_grads_equal(a: nn.Module, b: nn.Module) -> None:
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert pb.grad is not None, name
        torch.testing.assert_close(pb.grad, pa.grad, msg=name)


def assert_trains_as(plain: nn.Module, dp: DataParallel, x: torch.Tensor) -> None:
    """dp's output and, after a backward, its module's gradients are the plain module's."""
    out = dp(x)
    torch.testing.assert_close(out, plain(x))
    out.pow(2).sum().backward()
    plain(x).pow(2).sum().backward()
    assert_grads_equal(plain, dp.module)


# ----------------------------------------------------------------- 1. overridable steps


class BalancedDataParallel(DataParallel):
    """Transformer-XL's idea: device 0 takes `first` rows, the others share the rest."""

    def __init__(self, first: int, *args, **kwargs) -> None:
        self.first = first
        super().__init__(*args, **kwargs)

    def scatter(self, inputs, kwargs, device_ids):
        if self.first == 0:
            return super().scatter(inputs, kwargs, device_ids[1:])
        rows = inputs[0].size(self.dim)
        rest = len(device_ids) - 1
        sizes = [self.first] + [(rows - self.first) // rest] * rest
        for i in range((rows - self.first) % rest):
            sizes[i + 1] += 1
        chunks = inputs[0].split(sizes, self.dim)
        return [(chunk,) for chunk in chunks], [dict(kwargs) for _ in chunks]


class DataParallelModel(DataParallel):
    """PyTorch-Encoding's idea: leave each replica's output where it is, ungathered."""

    def gather(self, outputs, output_device):
        return outputs


def test_a_scatter_override_decides_the_chunks_and_the_record_shows_them(make_dp) -> None:
    torch.manual_seed(1)
    model = nn.Linear(5, 3)
    plain = copy.deepcopy(model)
    dp = BalancedDataParallel(2, model, cpus(3))
    try:
        assert_trains_as(plain, dp, torch.randn(11, 5))
        record = dp.last_step
        assert record.chunk_sizes == (2, 5, 4)
        assert record.devices == ("cpu:0", "cpu:1", "cpu:2")
        assert [r.input_shapes for r in record.replicas] == [((2, 5),), ((5, 5),), ((4, 5),)]
        assert all(r.forward_timed and r.backward_ms is not None for r in record.replicas)
    finally:
        dp.close()


def test_a_scatter_override_leaving_device_0_out_runs_on_the_others() -> None:
    model = nn.Linear(5, 3)
    dp = BalancedDataParallel(0, model, cpus(3))
    seen: list[str] = []
    model.register_forward_hook(lambda *_: seen.append(threading.current_thread().name))
    try:
        x = torch.randn(10, 5)
        torch.testing.assert_close(dp(x), model(x))
        assert dp.last_step.chunk_sizes == (5, 5)
        assert dp.last_step.devices == ("cpu:1", "cpu:2")
        assert sorted(seen[:2]) == ["dpengine-cpu:1", "dpengine-cpu:2"]
    finally:
        dp.close()


def test_a_gather_override_keeps_the_replica_outputs(make_dp) -> None:
    torch.manual_seed(2)
    model = nn.Linear(4, 2)
    plain = copy.deepcopy(model)
    dp = DataParallelModel(model, cpus(3))
    try:
        x = torch.randn(7, 4)
        outputs = dp(x)
        assert isinstance(outputs, list) and [o.shape[0] for o in outputs] == [3, 3, 1]
        torch.testing.assert_close(torch.cat(outputs), plain(x))
        sum(o.sum() for o in outputs).backward()
        plain(x).sum().backward()
        assert_grads_equal(plain, model)
        assert dp.last_step.output_shapes == ((3, 2), (3, 2), (1, 2))
        assert dp.last_step.backward_ms is not None
    finally:
        dp.close()


def test_forward_calls_the_four_steps_in_torchs_order(make_dp) -> None:
    calls: list[str] = []

    class Traced(DataParallel):
        def scatter(self, inputs, kwargs, device_ids):
            calls.append(f"scatter {len(device_ids)}")
            return super().scatter(inputs, kwargs, device_ids)

        def replicate(self, module, device_ids):
            calls.append(f"replicate {len(device_ids)}")
            return super().replicate(module, device_ids)

        def parallel_apply(self, replicas, inputs, kwargs):
            calls.append(f"parallel_apply {len(replicas)}")
            return super().parallel_apply(replicas, inputs, kwargs)

        def gather(self, outputs, output_device):
            calls.append(f"gather {output_device}")
            return super().gather(outputs, output_device)

    dp = Traced(nn.Linear(3, 1), cpus(4))
    try:
        dp(torch.randn(6, 3))  # torch.chunk's rule: 2/2/2, the fourth device idles
        assert calls == ["scatter 4", "replicate 3", "parallel_apply 3", "gather cpu:0"]
        assert all(r.forward_timed for r in dp.last_step.replicas)
    finally:
        dp.close()


def test_a_parallel_apply_override_is_recorded_as_untimed(make_dp) -> None:
    class Sequential(DataParallel):
        def parallel_apply(self, replicas, inputs, kwargs):
            return [r(*a, **k) for r, a, k in zip(replicas, inputs, kwargs)]

    model = nn.Linear(3, 2)
    dp = Sequential(model, cpus(2))
    try:
        x = torch.randn(5, 3)
        out = dp(x)
        torch.testing.assert_close(out, model(x))
        out.sum().backward()
        record = dp.last_step
        assert record.chunk_sizes == (3, 2)
        assert [r.forward_timed for r in record.replicas] == [False, False]
        # each replica ran within the override's span: that span is all that is known
        assert all(r.forward_ms == pytest.approx(record.apply_ms) for r in record.replicas)
        assert all(r.backward_ms is not None for r in record.replicas)
    finally:
        dp.close()


def test_a_replicate_override_keeps_the_per_replica_record(make_dp) -> None:
    class SharesTheModule(DataParallel):
        def replicate(self, module, device_ids):
            return [module] * len(device_ids)  # every replica is the module itself

    model = nn.Linear(3, 2)
    plain = copy.deepcopy(model)
    dp = SharesTheModule(model, cpus(3))
    try:
        x = torch.randn(7, 3)
        out = dp(x)
        torch.testing.assert_close(out, plain(x))
        out.sum().backward()
        plain(x).sum().backward()
        assert_grads_equal(plain, model)
        record = dp.last_step
        assert record.chunk_sizes == (3, 3, 1)
        assert all(r.forward_timed and r.backward_ms is not None for r in record.replicas)
    finally:
        dp.close()


# ----------------------------------------------------------------- 2. replicas as torch makes them


def test_unused_parameters_get_zero_gradients_like_torch(make_dp) -> None:
    # The repro: the gradient w.r.t. the input does not involve the bias.
    torch.manual_seed(3)
    model = nn.Linear(4, 1)
    dp = make_dp(model, cpus(2))
    x = torch.randn(6, 4, requires_grad=True)
    (grad_x,) = torch.autograd.grad(dp(x).sum(), x, create_graph=True)
    grad_x.mean().backward()
    torch.testing.assert_close(model.bias.grad, torch.zeros(1))
    torch.testing.assert_close(model.weight.grad, torch.full((1, 4), 6 * 2 / (6 * 4 * 2)))


def test_a_layer_no_output_uses_gets_zeros_and_moves_under_weight_decay(make_dp) -> None:
    class Partly(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(3, 2)
            self.unused = nn.Linear(3, 2)

        def forward(self, x):
            return self.used(x)

    model = Partly()
    before = model.unused.weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.5)
    make_dp(model, cpus(3))(torch.randn(6, 3)).sum().backward()
    assert torch.equal(model.unused.weight.grad, torch.zeros(2, 3))
    assert torch.equal(model.unused.bias.grad, torch.zeros(2))
    optimizer.step()
    torch.testing.assert_close(model.unused.weight.detach(), before * (1 - 0.1 * 0.5))


@pytest.mark.parametrize("kind", ["list", "dict"])
def test_parameter_list_and_dict_inside_a_replica_are_non_leaf_views(make_dp, kind: str) -> None:
    p1, p2 = nn.Parameter(torch.rand(10)), nn.Parameter(torch.rand(10))
    keys = (0, 1) if kind == "list" else ("0", "1")
    container = nn.ParameterList([p1, p2]) if kind == "list" else nn.ParameterDict({"0": p1, "1": p2})
    checked: list[bool] = []
    lock = threading.Lock()

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.data = container

        def forward(self, x):
            first, second = self.data[keys[0]], self.data[keys[1]]
            ok = (
                torch.equal(first, p1) and torch.equal(second, p2)
                and first.requires_grad and second.requires_grad
                and first.grad_fn is not None and second.grad_fn is not None
                and not list(self.parameters())
            )
            with lock:
                checked.append(ok)
            return x * first.sum()

    make_dp(Holder(), cpus(2))(torch.randn(8, 8)).sum().backward()
    assert checked == [True, True]
    assert p1.grad is not None and torch.equal(p2.grad, torch.zeros(10))


def test_a_frozen_parameter_stays_frozen_in_the_replicas(make_dp) -> None:
    model = nn.Linear(3, 2)
    model.bias.requires_grad_(False)
    flags: list[tuple[bool, bool]] = []
    model.register_forward_pre_hook(lambda m, _: flags.append((m.weight.requires_grad, m.bias.requires_grad)))
    make_dp(model, cpus(2))(torch.randn(4, 3)).sum().backward()
    assert flags == [(True, False), (True, False)]
    assert model.bias.grad is None and model.weight.grad is not None


def test_replicas_follow_train_and_eval_and_replaced_parameters(make_dp) -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.9))
    dp = make_dp(model, cpus(2))
    x = torch.ones(4, 3)
    model.eval()
    torch.testing.assert_close(dp(x), model(x))
    model[0].weight = nn.Parameter(torch.zeros(3, 3))  # a new Parameter: the cached plan is stale
    torch.testing.assert_close(dp(x), model[0].bias.expand(4, 3))
    model.append(nn.Linear(3, 1))  # a new submodule
    assert dp(x).shape == (4, 1)
    del model[2]  # a deletion, which no registration hook reports
    assert dp(x).shape == (4, 3)
    model.double()  # moved in place: the device check still looks at every tensor
    assert dp(x.double()).dtype == torch.float64


# ----------------------------------------------------------------- 3. zero_grad in a replica


def test_zero_grad_inside_a_replica_warns_and_clears_nothing(make_dp) -> None:
    class ClearsItsGrads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            self.zero_grad()
            return self.lin(x)

    model = ClearsItsGrads()
    dp = make_dp(model, cpus(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dp(torch.randn(4, 2)).sum().backward()
    kept = model.lin.weight.grad.clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dp(torch.randn(4, 2))
    assert any("zero_grad" in str(w.message) and "no effect" in str(w.message) for w in caught)
    assert torch.equal(model.lin.weight.grad, kept)


# ----------------------------------------------------------------- 4. functional forms


def test_functional_data_parallel_matches_the_module() -> None:
    torch.manual_seed(4)
    model = nn.Linear(5, 2)
    plain = copy.deepcopy(model)
    x = torch.randn(10, 5)
    out = dpengine.data_parallel(model, x, cpus(3), output_device="cpu:0", dim=0)
    torch.testing.assert_close(out, plain(x))
    out.sum().backward()
    plain(x).sum().backward()
    assert_grads_equal(plain, model)


def test_functional_data_parallel_passes_module_kwargs() -> None:
    class Scaled(nn.Module):
        def forward(self, x, scale):
            return x * scale

    x = torch.randn(6, 2)
    out = dpengine.data_parallel(Scaled(), (x,), cpus(2), module_kwargs={"scale": 3.0})
    torch.testing.assert_close(out, x * 3.0)
    out = dpengine.data_parallel(Scaled(), (), cpus(2), module_kwargs={"x": x, "scale": 2.0})
    torch.testing.assert_close(out, x * 2.0)


def test_functional_scatter_and_gather() -> None:
    x = torch.arange(20.0).view(10, 2)
    chunks = dpengine.scatter(x, cpus(3))
    assert isinstance(chunks, tuple) and [c.shape[0] for c in chunks] == [4, 4, 2]
    pieces = dpengine.scatter((x, "tag"), cpus(2))
    assert isinstance(pieces, list) and [p[1] for p in pieces] == ["tag", "tag"]
    assert [p[0].shape[0] for p in pieces] == [5, 5]
    for target in (-1, "cpu", torch.device("cpu"), "cpu:0"):
        torch.testing.assert_close(dpengine.gather(list(chunks), target), x)
    with pytest.warns(UserWarning, match="scalars"):
        assert dpengine.gather([torch.tensor(1.0), torch.tensor(2.0)], "cpu").shape == (2,)


def test_functional_replicate_and_parallel_apply() -> None:
    torch.manual_seed(5)
    model = nn.Linear(3, 3)
    replicas = dpengine.replicate(model, cpus(2))
    inputs = [torch.randn(2, 3), torch.randn(4, 3)]
    # as torch's test_parallel_apply: inputs as tuples, and a single object per replica
    for per_replica in ([(i,) for i in inputs], inputs):
        outputs = dpengine.parallel_apply(replicas, per_replica, None, cpus(2))
        for out, i in zip(outputs, inputs):
            torch.testing.assert_close(out, model(i))
    outputs = dpengine.parallel_apply(replicas, [(i,) for i in inputs])  # devices from the inputs
    torch.testing.assert_close(outputs[1], model(inputs[1]))


def test_functional_parallel_apply_reraises_with_the_replica_and_device() -> None:
    class Fails(nn.Module):
        def forward(self, x):
            raise KeyError("boom")

    with pytest.raises(KeyError, match="in replica 1 on device cpu:1") as info:
        dpengine.parallel_apply([nn.Identity(), Fails()], [torch.ones(1), torch.ones(1)], None, cpus(2))
    assert dpengine.replica_failure(info.value).index == 1


# ----------------------------------------------------------------- the same on GPUs

CUDA = torch.cuda.is_available()


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_overrides_functional_forms_and_zero_grads_on_gpus() -> None:
    gpus = list(range(torch.cuda.device_count()))
    torch.manual_seed(9)
    model = nn.Linear(4, 1).cuda()
    plain = copy.deepcopy(model)
    x = torch.randn(8, 4, device="cuda", requires_grad=True)
    out = dpengine.data_parallel(model, x, gpus)
    torch.testing.assert_close(out, plain(x), atol=1e-5, rtol=1e-5)
    (grad_x,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    grad_x.mean().backward()
    if len(gpus) > 1:  # through torch's Broadcast: zeros for the unused bias
        torch.testing.assert_close(model.bias.grad, torch.zeros(1, device="cuda"))
    dp = DataParallelModel(model, gpus)
    try:
        outputs = dp(torch.randn(8, 4, device="cuda"))
        assert isinstance(outputs, list) if len(gpus) > 1 else outputs.shape == (8, 1)
        torch.cuda.synchronize()  # reading last_step never waits for the device
        assert dp.last_step.devices == tuple(f"cuda:{i}" for i in gpus[: len(dp.last_step.devices)])
        chunks = dpengine.scatter(torch.arange(8.0, device="cuda"), gpus)
        torch.testing.assert_close(dpengine.gather(list(chunks), -1), torch.arange(8.0))
    finally:
        dp.close()


def test_a_forward_override_that_drops_a_replica_still_runs_the_rest() -> None:
    class SkipsFirst(DataParallel):
        # Transformer-XL's forward with gpu0_bsz=0: all replicas made, the first one dropped.
        def forward(self, x):
            inputs, kwargs = self.scatter((x,), {}, self.device_ids[1:])
            replicas = self.replicate(self.module, self.device_ids)[1:]
            return self.gather(self.parallel_apply(replicas, inputs, kwargs), self.output_device)

    model = nn.Linear(3, 2)
    plain = copy.deepcopy(model)
    x = torch.randn(6, 3)
    dp = SkipsFirst(model, cpus(3))
    try:
        out = dp(x)
        torch.testing.assert_close(out, plain(x))
        out.sum().backward()
        plain(x).sum().backward()
        assert_grads_equal(plain, model)
    finally:
        dp.close()


def test_a_lazy_module_gives_torchs_own_error_and_runs_alone_to_initialize(make_dp) -> None:
    """torch's test_data_parallel_lazy_linear: replicating uninitialized parameters is refused."""
    dp = make_dp(nn.LazyLinear(3), ["cpu:0", "cpu:1"])
    with pytest.raises(RuntimeError, match="Modules with uninitialized parameters can't be used with `DataParallel`"):
        dp(torch.randn(4, 5))
    # one device runs the module itself, as torch's does: the dummy forward that initializes it
    alone = make_dp(nn.LazyLinear(3), ["cpu:0"])
    assert alone(torch.randn(4, 5)).shape == (4, 3) and type(alone.module) is nn.Linear
    alone.set_devices(["cpu:0", "cpu:1"])
    out = alone(torch.randn(4, 5))
    out.sum().backward()
    assert alone.last_step.chunk_sizes == (2, 2) and alone.module.weight.grad is not None


def test_a_device_listed_twice_runs_a_replica_for_each_entry(make_dp) -> None:
    # torch's DataParallel takes device_ids=[0, 0] (its own tests run two replicas on one GPU).
    torch.manual_seed(3)
    model = nn.Linear(5, 2)
    plain = copy.deepcopy(model)
    dp = make_dp(model, ["cpu:0", "cpu:0", "cpu:1"])
    seen: list[str] = []
    model.register_forward_hook(lambda *_: seen.append(threading.current_thread().name))
    assert_trains_as(plain, dp, torch.randn(30, 5))
    record = dp.last_step
    assert record.chunk_sizes == (10, 10, 10) and record.devices == ("cpu:0", "cpu:0", "cpu:1")
    assert [r.index for r in record.replicas] == [0, 1, 2]
    assert all(r.forward_timed and r.backward_ms is not None for r in record.replicas)
    assert sorted(seen) == ["dpengine-cpu:0", "dpengine-cpu:0", "dpengine-cpu:1"]  # a thread per entry

