"""The engine on real GPUs: torch's CUDA replicate, Scatter and Gather under dpengine.

Skipped without CUDA; the 2-GPU tests also need a second device.
"""

from __future__ import annotations

import copy
import gc
import threading

import pytest
import torch
from torch import nn

import dpengine
from dpengine import StepRecord

CUDA = torch.cuda.is_available()
GPU_COUNT = torch.cuda.device_count() if CUDA else 0

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU"),
]
two_gpus = pytest.mark.skipif(GPU_COUNT < 2, reason="needs at least 2 CUDA GPUs")

# fp32 matmuls (TF32 is off for matmul by default; no convolutions here), so CPU and GPU
# results agree closely; the reduce-add and chunked matmuls sum in a different order.
TOL = dict(atol=1e-4, rtol=1e-4)


def make_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))


def assert_grads_close(a: nn.Module, b: nn.Module, **tol) -> None:
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert pb.grad is not None, name
        torch.testing.assert_close(pb.grad.cpu(), pa.grad.cpu(), msg=name, **(tol or TOL))


def assert_params_close(a: nn.Module, b: nn.Module) -> None:
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        torch.testing.assert_close(pb.cpu(), pa.cpu(), msg=name, **TOL)


def run_steps(plain: nn.Module, dp: nn.Module, x_device: torch.device, steps: int = 3) -> None:
    """SGD with momentum, then Adam: parameters must agree after every step."""
    for make_opt in (
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
        lambda ps: torch.optim.Adam(ps, lr=0.01),
    ):
        opt_plain, opt_dp = make_opt(plain.parameters()), make_opt(dp.module.parameters())
        for step in range(steps):
            batch = 9 + step
            x = torch.randn(batch, 5)
            target = torch.randn(batch, 3)
            for model, opt, device in ((plain, opt_plain, next(plain.parameters()).device), (dp, opt_dp, x_device)):
                opt.zero_grad()
                out = model(x.to(device))
                nn.functional.mse_loss(out, target.to(out.device)).backward()
                opt.step()
            assert_params_close(plain, dp.module)


# ----------------------------------------------------------------- one GPU


def test_single_gpu_parity(make_dp) -> None:
    torch.manual_seed(0)
    plain = make_mlp().cuda()
    dp = make_dp(copy.deepcopy(plain), device_ids=[0])
    assert dp.devices == [torch.device("cuda", 0)] and dp.device_ids == [0]
    x = torch.randn(10, 5, device="cuda")
    out_plain, out_dp = plain(x), dp(x)
    assert out_dp.device == torch.device("cuda", 0)
    torch.testing.assert_close(out_dp, out_plain, atol=1e-5, rtol=1e-5)
    out_plain.pow(2).sum().backward()
    out_dp.pow(2).sum().backward()
    assert_grads_close(plain, dp.module, atol=1e-5, rtol=1e-5)
    run_steps(plain, dp, torch.device("cuda", 0))


def test_single_gpu_moves_the_module_and_cpu_inputs() -> None:
    torch.manual_seed(1)
    plain = make_mlp()  # stays on the CPU
    module = copy.deepcopy(plain)
    dp = dpengine.DataParallel(module, device_ids=[0])
    try:
        assert all(p.device == torch.device("cuda", 0) for p in module.parameters())  # like torch
        x_cpu = torch.randn(7, 5, requires_grad=True)
        x_ref = x_cpu.detach().clone().requires_grad_(True)
        out = dp(x_cpu)  # scattered to cuda:0
        assert out.device == torch.device("cuda", 0)
        expected = plain(x_ref)
        torch.testing.assert_close(out.cpu(), expected, **TOL)
        out.sum().backward()
        expected.sum().backward()
        assert x_cpu.grad is not None and x_cpu.grad.device.type == "cpu"
        torch.testing.assert_close(x_cpu.grad, x_ref.grad, **TOL)
        assert_grads_close(plain, module)
    finally:
        dp.close()


def test_cpu_and_cuda_devices_agree(make_dp) -> None:
    torch.manual_seed(2)
    plain = make_mlp()
    on_gpu = make_dp(copy.deepcopy(plain).cuda(), device_ids=["cuda:0"])
    on_cpus = make_dp(copy.deepcopy(plain), ["cpu:0", "cpu:1", "cpu:2"])
    x = torch.randn(10, 5)
    expected = plain(x)
    out_gpu, out_cpu = on_gpu(x.cuda()), on_cpus(x)
    assert out_gpu.is_cuda and out_cpu.device.type == "cpu"
    torch.testing.assert_close(out_gpu.cpu(), expected, **TOL)
    torch.testing.assert_close(out_cpu, expected, atol=1e-5, rtol=1e-5)
    expected.sum().backward()
    out_gpu.sum().backward()
    out_cpu.sum().backward()
    assert_grads_close(plain, on_gpu.module)
    assert_grads_close(plain, on_cpus.module, atol=1e-5, rtol=1e-5)


def _check_cuda_record(step: StepRecord, devices: list[str], sizes: list[int]) -> None:
    assert list(step.devices) == devices and list(step.chunk_sizes) == sizes
    for r in step.replicas:
        assert r.forward_ms > 0
        assert isinstance(r.memory_bytes, int) and r.memory_bytes > 0
        assert isinstance(r.peak_memory_bytes, int) and r.peak_memory_bytes >= r.memory_bytes


@pytest.mark.parametrize("count", [1, 2])
def test_cuda_records(make_dp, count: int) -> None:
    if GPU_COUNT < count:
        pytest.skip(f"needs {count} CUDA GPUs")
    module = make_mlp().cuda()
    dp = make_dp(module, device_ids=list(range(count)))
    got: list[StepRecord] = []
    dp.subscribe(got.append)
    x = torch.randn(10, 5, device="cuda")
    out = dp(x)
    sizes = [c.size(0) for c in x.chunk(count)]
    names = [f"cuda:{i}" for i in range(count)]
    before = dp.last_step
    _check_cuda_record(before, names, sizes)
    assert before.backward_ms is None and all(r.backward_ms is None for r in before.replicas)

    out.sum().backward()
    torch.cuda.synchronize()
    after = dp.last_step  # CUDA steps are finished lazily: reading it finishes this one
    _check_cuda_record(after, names, sizes)
    assert after.step == 1 and after.backward_ms is not None and after.backward_ms > 0
    assert all(r.backward_ms is not None and r.backward_ms >= 0 for r in after.replicas)
    assert len(got) == 1 and got[0] is after

    with torch.no_grad():
        dp(x)
    dp(x).sum().backward()
    dp(x)  # publishes the previous step
    assert [r.step for r in got] == [1, 2, 3]
    assert got[1].backward_ms is None and got[2].backward_ms is not None


@pytest.mark.parametrize("count", [1, 2])
def test_no_reference_cycles(make_dp, count: int) -> None:
    # torch's test_data_parallel_model_no_refcycles, plus a backward and reading the record.
    if GPU_COUNT < count:
        pytest.skip(f"needs {count} CUDA GPUs")

    def run() -> None:
        model = make_dp(nn.Linear(1, 1).cuda(), device_ids=list(range(count)))
        model(torch.randn(4, 1, device="cuda")).sum().backward()
        assert model.last_step.backward_ms is not None

    run()  # first use of CUDA, cuBLAS and the peak-memory counters may leave garbage once
    gc.collect()
    run()
    assert gc.collect() == 0


# ----------------------------------------------------------------- two GPUs


@two_gpus
def test_two_gpu_parity(make_dp) -> None:
    torch.manual_seed(3)
    plain = make_mlp().cuda()
    dp = make_dp(copy.deepcopy(plain), device_ids=[0, 1])
    x = torch.randn(10, 5, device="cuda")
    out_plain, out_dp = plain(x), dp(x)
    assert out_dp.device == torch.device("cuda", 0)
    torch.testing.assert_close(out_dp, out_plain, **TOL)
    assert dp.last_step.devices == ("cuda:0", "cuda:1") and dp.last_step.chunk_sizes == (5, 5)
    out_plain.pow(2).sum().backward()
    out_dp.pow(2).sum().backward()
    assert all(p.grad.device == torch.device("cuda", 0) for p in dp.module.parameters())
    assert_grads_close(plain, dp.module)
    run_steps(plain, dp, torch.device("cuda", 0))


@two_gpus
def test_two_gpu_cpu_inputs_kwargs_and_input_grad(make_dp) -> None:
    class WithKwargs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x, *, bias, scale=1.0):
            return self.lin(x) * scale + bias

    torch.manual_seed(4)
    plain = WithKwargs()
    dp = make_dp(copy.deepcopy(plain).cuda(), device_ids=[0, 1])
    x = torch.randn(7, 4, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    bias = torch.randn(7, 2)
    out = dp(x, bias=bias, scale=0.5)
    expected = plain(x_ref, bias=bias, scale=0.5)
    torch.testing.assert_close(out.cpu(), expected, **TOL)
    assert dp.last_step.chunk_sizes == (4, 3)
    out.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL)
    assert_grads_close(plain, dp.module)


@two_gpus
@pytest.mark.parametrize("output_device", ["cpu", -1, 1])
def test_two_gpu_output_device(make_dp, output_device) -> None:
    torch.manual_seed(5)
    plain = make_mlp().cuda()
    dp = make_dp(copy.deepcopy(plain), device_ids=[0, 1], output_device=output_device)
    x = torch.randn(6, 5, device="cuda")
    out = dp(x)
    want = torch.device("cpu") if output_device in ("cpu", -1) else torch.device("cuda", 1)
    assert out.device == want
    torch.testing.assert_close(out.cpu(), plain(x).cpu(), **TOL)
    out.sum().backward()
    plain(x).sum().backward()
    assert_grads_close(plain, dp.module)


@two_gpus
def test_two_gpu_double_backward(make_dp) -> None:
    torch.manual_seed(6)
    plain = make_mlp().cuda()
    dp = make_dp(copy.deepcopy(plain), device_ids=[0, 1])
    x = torch.randn(8, 5, device="cuda")

    def penalty(model):
        xi = x.clone().requires_grad_(True)
        out = model(xi)
        (grad_x,) = torch.autograd.grad(out.pow(2).sum(), xi, create_graph=True)
        (out.sum() + grad_x.pow(2).sum()).backward()
        return grad_x.detach()

    torch.testing.assert_close(penalty(dp), penalty(plain), **TOL)
    assert_grads_close(plain, dp.module)


@two_gpus
def test_two_gpu_batchnorm_statistics_come_from_chunk_0(make_dp) -> None:
    torch.manual_seed(7)
    bn = nn.BatchNorm1d(4).cuda()
    reference = copy.deepcopy(bn)
    dp = make_dp(bn, device_ids=[0, 1])
    x = torch.randn(8, 4, device="cuda") + torch.arange(8.0, device="cuda").unsqueeze(1)
    dp(x)
    reference(x.chunk(2)[0])
    torch.testing.assert_close(bn.running_mean, reference.running_mean)
    torch.testing.assert_close(bn.running_var, reference.running_var)


@two_gpus
def test_two_gpu_thread_state_and_autocast_dtype(make_dp) -> None:
    seen: dict[str, tuple] = {}
    lock = threading.Lock()

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x):
            out = self.lin(x)
            with lock:
                seen[str(x.device)] = (
                    torch.is_grad_enabled(), torch.cuda.current_device(), out.dtype,
                )
            return out

    dp = make_dp(Probe().cuda(), device_ids=[0, 1])
    x = torch.randn(6, 4, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = dp(x)
    assert out.dtype == torch.bfloat16
    assert seen == {"cuda:0": (True, 0, torch.bfloat16), "cuda:1": (True, 1, torch.bfloat16)}
    seen.clear()
    with torch.no_grad():
        out = dp(x)
    assert not out.requires_grad and out.dtype == torch.float32
    assert seen == {"cuda:0": (False, 0, torch.float32), "cuda:1": (False, 1, torch.float32)}


@two_gpus
def test_two_gpu_replica_errors_and_recovery(make_dp) -> None:
    class Fails(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x):
            if x.device.index == 1 and bool((x[0, 0] == 12345.0).item()):
                raise KeyError("sentinel seen")
            return self.lin(x)

    module = Fails().cuda()
    dp = make_dp(module, device_ids=[0, 1])
    x = torch.randn(6, 3, device="cuda")
    x[3, 0] = 12345.0
    with pytest.raises(KeyError) as info:
        dp(x)
    assert "in replica 1 on device cuda:1" in str(info.value)
    failure = dpengine.replica_failure(info.value)
    assert (failure.index, failure.device) == (1, "cuda:1")
    good = torch.randn(6, 3, device="cuda")
    torch.testing.assert_close(dp(good), module.lin(good), **TOL)


@two_gpus
def test_two_gpu_module_must_be_on_device_0(make_dp) -> None:
    dp = make_dp(make_mlp(), device_ids=[0, 1])  # left on the CPU, as torch does
    with pytest.raises(RuntimeError, match="device_ids\\[0\\]"):
        dp(torch.randn(4, 5, device="cuda"))


@two_gpus
def test_two_gpu_workers_are_persistent(make_dp) -> None:
    dp = make_dp(nn.Linear(4, 2).cuda(), device_ids=[0, 1])
    x = torch.randn(4, 4, device="cuda")
    dp(x).sum().backward()
    ids, count = dp.worker_thread_ids(), threading.active_count()
    assert sorted(ids) == ["cuda:0", "cuda:1"]
    for _ in range(50):
        dp(x).sum().backward()
    assert dp.worker_thread_ids() == ids and threading.active_count() == count
