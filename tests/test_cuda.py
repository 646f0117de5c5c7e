"""The engine on real GPUs: torch's CUDA replicate, Scatter and Gather under dpengine.

Skipped without CUDA; the 2-GPU tests also need a second device.
"""

from __future__ import annotations

import copy
import gc
import json
import subprocess
import sys
import textwrap
import threading
import time

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


def wait_for(condition, what: str, timeout: float = 20.0) -> None:
    """tests/waiting.py's, without psutil: this file runs on GPU machines with bare pytest."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def finished(dp) -> StepRecord:
    """The newest step's record once the device has run it: reading last_step never waits."""
    torch.cuda.synchronize()
    return dp.last_step


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


def test_two_replicas_on_one_gpu_match_torchs_dataparallel_of_device_ids_0_0(make_dp) -> None:
    # One GPU takes DataParallel's single-device path; [0, 0] runs the real scatter, replicate and
    # gather (torch's own tests do), so this is what a one-GPU machine checks of them.
    torch.manual_seed(0)
    plain = make_mlp().cuda()
    reference = nn.DataParallel(copy.deepcopy(plain), device_ids=[0, 0])
    dp = make_dp(copy.deepcopy(plain), device_ids=[0, 0])
    assert dp.device_ids == [0, 0]
    x = torch.randn(11, 5, device="cuda")
    out_ref, out_dp = reference(x), dp(x)
    torch.testing.assert_close(out_dp, out_ref, atol=1e-5, rtol=1e-5)
    out_ref.pow(2).sum().backward()
    out_dp.pow(2).sum().backward()
    assert_grads_close(reference.module, dp.module, atol=1e-5, rtol=1e-5)
    record = finished(dp)
    assert record.chunk_sizes == (6, 5) and record.devices == ("cuda:0", "cuda:0")
    assert [r.index for r in record.replicas] == [0, 1]
    assert all(r.forward_ms is not None and r.forward_ms > 0 for r in record.replicas)
    run_steps(copy.deepcopy(plain), make_dp(copy.deepcopy(plain), device_ids=[0, 0]), torch.device("cuda", 0))


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
    before = finished(dp)  # the forward's half: its backward may still come
    _check_cuda_record(before, names, sizes)
    assert before.backward_ms is None and all(r.backward_ms is None for r in before.replicas)
    assert got == []

    out.sum().backward()
    after = finished(dp)
    _check_cuda_record(after, names, sizes)
    assert after.step == 1 and after.backward_ms is not None and after.backward_ms > 0
    assert all(r.backward_ms is not None and r.backward_ms >= 0 for r in after.replicas)
    assert len(got) == 1 and got[0] is after

    with torch.no_grad():
        dp(x)
    dp(x).sum().backward()
    dp(x)  # under grad: its backward may still come, until the next forward or the program's end
    torch.cuda.synchronize()
    wait_for(lambda: len(got) == 3, "steps 2 and 3 published once the device ran them, without a forward")
    assert [r.step for r in got] == [1, 2, 3]
    assert got[1].backward_ms is None and got[2].backward_ms is not None
    dp.flush_steps()
    assert [r.step for r in got] == [1, 2, 3, 4] and got[3].backward_ms is None


@pytest.mark.parametrize("count", [1, 2])
def test_no_reference_cycles(make_dp, count: int) -> None:
    # torch's test_data_parallel_model_no_refcycles, plus a backward and reading the record.
    if GPU_COUNT < count:
        pytest.skip(f"needs {count} CUDA GPUs")

    def run() -> None:
        model = make_dp(nn.Linear(1, 1).cuda(), device_ids=list(range(count)))
        model(torch.randn(4, 1, device="cuda")).sum().backward()
        assert finished(model).backward_ms is not None

    run()  # first use of CUDA, cuBLAS and the peak-memory counters may leave garbage once
    gc.collect()
    run()
    assert gc.collect() == 0


# ----------------------------------------------------------------- issue 20 on one GPU


def cycles_for(ms: float, device: int = 0) -> int:
    """torch.cuda._sleep's argument that keeps `device` busy for about `ms`."""
    with torch.cuda.device(device):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)  # loaded and warm
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        return int(10_000_000 * ms / start.elapsed_time(end))


class Busy(nn.Module):
    """A Linear whose forward keeps its device busy for `cycles` (torch.cuda._sleep)."""

    def __init__(self, cycles: int, seen: list | None = None) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.cycles = cycles
        self.seen = seen

    def forward(self, x):
        if self.seen is not None:
            self.seen.append(torch.cuda.current_device())
        with torch.cuda.device(x.device):  # _sleep runs on the current device's current stream
            torch.cuda._sleep(self.cycles)
        return self.lin(x)


class SleepInBackward(torch.autograd.Function):
    """Identity whose backward keeps the device busy for `cycles` and may allocate `scratch` bytes."""

    @staticmethod
    def forward(ctx, x, cycles, scratch):
        ctx.cycles, ctx.scratch = cycles, scratch
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        torch.cuda._sleep(ctx.cycles)  # autograd runs it on the device's thread and stream
        if ctx.scratch:
            grad = grad + torch.zeros(ctx.scratch // 4, device=grad.device)[: grad.numel()].view_as(grad)
        return grad, None, None


class SlowBackward(nn.Module):
    def __init__(self, cycles: int, scratch: int = 0) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.cycles, self.scratch = cycles, scratch

    def forward(self, x):
        return SleepInBackward.apply(self.lin(x), self.cycles, self.scratch)


@pytest.mark.parametrize("grad", [False, True])
def test_steps_never_wait_for_the_device(make_dp, grad: bool) -> None:
    # 20.3: the host runs ahead, as under torch's DataParallel: neither a no_grad forward nor the
    # next forward waits for the device (both used to, on the previous step's events).
    dp = make_dp(Busy(cycles_for(200)).cuda(), device_ids=[0])
    got: list[StepRecord] = []
    dp.subscribe(got.append)
    x = torch.randn(8, 4, device="cuda")
    dp(x).sum().backward()
    finished(dp)
    dp.flush_steps()
    started = time.perf_counter()
    with torch.set_grad_enabled(grad):
        for _ in range(3):
            out = dp(x)
            if grad:
                out.sum().backward()
    host_s = time.perf_counter() - started
    assert host_s < 0.3, f"3 steps of 200 ms on the device took {host_s:.3f} s on the host"
    torch.cuda.synchronize()
    wait_for(lambda: len(got) == 4, "the three steps published once the device ran them")
    assert [r.step for r in got] == [1, 2, 3, 4]
    assert all(r.replicas[0].forward_ms > 150 for r in got[1:])


def test_step_backward_ms_is_the_devices_time(make_dp) -> None:
    # 20.6: the host only launches a backward; the step's backward_ms is the replicas' events.
    dp = make_dp(SlowBackward(cycles_for(100)).cuda(), device_ids=[0])
    dp(torch.randn(8, 4, device="cuda")).sum().backward()
    record = finished(dp)
    (replica,) = record.replicas
    assert replica.backward_ms > 80 and record.backward_ms == pytest.approx(replica.backward_ms)
    assert record.backward_start_ms == replica.backward_start_ms


def test_the_step_peak_counts_the_backward_and_starts_at_the_step(make_dp) -> None:
    # 20.4: reset at the step's start (not around the forward), read once the backward ended.
    scratch = 256 << 20
    big = torch.empty(scratch * 2, dtype=torch.uint8, device="cuda")  # before the step: not its peak
    del big
    dp = make_dp(SlowBackward(0, scratch).cuda(), device_ids=[0])
    dp(torch.randn(8, 4, device="cuda")).sum().backward()
    (replica,) = finished(dp).replicas
    assert replica.memory_bytes < scratch
    assert scratch <= replica.peak_memory_bytes < scratch * 2
    # Without dptui run's view, the allocator's peak starts at each step (docs/engine.md#peak-memory-on-cuda).
    assert torch.cuda.max_memory_allocated() < scratch * 2


def dptui_run_events(tmp_path, source: str, *flags: str) -> list[dict]:
    """`dptui run --headless --json FLAGS SCRIPT` on `source` (dedented); its events, once it exited 0."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    done = subprocess.run([sys.executable, "-m", "tui.cli", "run", "--headless", "--json", "--no-telemetry", *flags,
                           str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def lines(events: list[dict]) -> list[str]:
    return [e["line"] for e in events if e.get("type") == "output"]


def test_under_dptui_run_the_scripts_own_peak_is_kept(tmp_path) -> None:
    # The script as a user writes it: torch's DataParallel (dptui run swaps in dpengine's), two
    # replicas on GPU 0, and the script reads its own peaks; dpengine resets the peak every step.
    events = dptui_run_events(tmp_path, """
        import torch
        from torch import nn
        big = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
        del big
        dp = nn.DataParallel(nn.Linear(4, 2).cuda(), [0, 0])
        for _ in range(3):
            dp(torch.randn(8, 4, device="cuda")).sum().backward()
        kept = torch.cuda.max_memory_allocated()
        # every peak the user can read, through either API, as without dptui
        others = (torch.cuda.max_memory_reserved(), torch.cuda.memory_stats()["allocated_bytes.all.peak"],
                  torch.cuda.memory_stats_as_nested_dict()["allocated_bytes"]["all"]["peak"],
                  torch.accelerator.max_memory_allocated(), torch.accelerator.max_memory_reserved())
        torch.cuda.reset_peak_memory_stats()
        dp(torch.randn(8, 4, device="cuda")).sum().backward()
        print("peaks:", kept >= 512 << 20,
              all(o >= 512 << 20 for o in others), torch.cuda.max_memory_allocated() < 512 << 20)
    """, "--devices", "cuda:0")
    assert "peaks: True True True" in lines(events), events[-20:]
    steps = [e for e in events if e.get("type") == "step"]
    assert [[r["device"] for r in s["replicas"]] for s in steps] == [["cuda:0", "cuda:0"]] * 4  # dpengine's


def test_a_ddp_ranks_own_peak_reads_as_without_dptui(tmp_path) -> None:
    # The rank's step clock resets the allocator's peak every step: the script's reading must not see it.
    events = dptui_run_events(tmp_path, """
        import torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel
        dist.init_process_group("nccl")
        torch.cuda.set_device(0)
        big = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
        del big
        model = DistributedDataParallel(torch.nn.Linear(4, 2).cuda())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(4):
            model(torch.randn(8, 4, device="cuda")).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        print("peak kept:", torch.cuda.max_memory_allocated() >= 512 << 20, torch.cuda.max_memory_reserved() >= 512 << 20)
        dist.destroy_process_group()
    """, "--nproc-per-node", "1")
    assert "peak kept: True True" in lines(events), events[-20:]


def test_a_ddp_ranks_own_nccl_collectives_are_timed_on_its_stream_as_comm_wait(tmp_path) -> None:
    # collectives.py on a GPU: the marks around a blocking NCCL all-reduce are CUDA events on the rank's
    # stream; a step's phases still add up to at most its total, and the loss's all-reduce is comm_wait.
    events = dptui_run_events(tmp_path, """
        import torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel
        dist.init_process_group("nccl")
        torch.cuda.set_device(0)
        model = DistributedDataParallel(torch.nn.Linear(1024, 1024).cuda())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(6):
            loss = model(torch.randn(256, 1024, device="cuda")).pow(2).mean()
            logged = loss.detach().clone()
            dist.all_reduce(logged)  # between forward and backward, as torchvision's references log
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        dist.destroy_process_group()
    """, "--nproc-per-node", "1")
    steps = [e for e in events if e["type"] == "rank_step"]
    assert len(steps) == 6, events[-20:]
    for step in steps:
        phases = sum(step[p] for p in ("data_ms", "forward_ms", "backward_ms", "comm_wait_ms", "optimizer_ms"))
        assert phases <= step["total_ms"] * 1.0001 + 1e-6 and step["comm_wait_ms"] > 0, step


@two_gpus
def test_a_rank_on_gpu_1_without_set_device_opens_no_context_on_gpu_0(tmp_path) -> None:
    # The DDP tutorial's demo_basic: model.to(rank), no set_device. The step clock recorded its
    # events on the current device's stream (GPU 0's), timing an idle stream and opening a context there.
    events = dptui_run_events(tmp_path, """
        import torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel
        dist.init_process_group("gloo")
        model = DistributedDataParallel(torch.nn.Linear(256, 256).to(1), device_ids=[1])
        for _ in range(6):
            model(torch.randn(64, 256, device=1)).sum().backward()
            torch.optim.SGD(model.parameters(), lr=0.1).step()
        print("gpu0 used:", torch.cuda.memory_reserved(0) > 0, torch.cuda.is_initialized())
        dist.destroy_process_group()
    """, "--nproc-per-node", "1")
    assert "gpu0 used: False True" in lines(events), events[-20:]
    steps = [e for e in events if e["type"] == "rank_step"]
    assert len(steps) >= 5 and all(s["forward_ms"] > 0 for s in steps), steps


def test_the_last_step_is_published_at_exit_without_waiting_before(tmp_path) -> None:
    # 20.5: a forward-only loop on CUDA: every step out, the last at the program's end.
    script = tmp_path / "forward_only.py"
    script.write_text(textwrap.dedent("""
        import atexit, torch
        from torch import nn
        from dpengine import DataParallel
        atexit.register(lambda: print("published", steps))
        steps = []
        dp = DataParallel(nn.Linear(4, 2).cuda(), [0])
        dp.subscribe(lambda r: steps.append((r.step, r.replicas[0].forward_ms > 0)))
        for _ in range(3):
            dp(torch.randn(6, 4, device="cuda"))
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "published [(1, True), (2, True), (3, True)]"


def test_phase_starts_from_events(make_dp) -> None:
    # 22.2 on CUDA: offsets from the step's reference event, in the order the stream ran them.
    dp = make_dp(SlowBackward(cycles_for(20)).cuda(), device_ids=[0])
    dp(torch.randn(8, 4, device="cuda")).sum().backward()
    record = finished(dp)
    (replica,) = record.replicas
    assert record.scatter_start_ms == 0.0
    assert 0.0 <= record.replicate_start_ms <= record.apply_start_ms <= replica.forward_start_ms
    assert replica.forward_start_ms + replica.forward_ms <= record.gather_start_ms + 1e-3
    assert replica.backward_start_ms >= record.gather_start_ms


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
    assert finished(dp).devices == ("cuda:0", "cuda:1") and finished(dp).chunk_sizes == (5, 5)
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
    assert finished(dp).chunk_sizes == (4, 3)
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


@two_gpus
@pytest.mark.parametrize("split", [dict(chunk_sizes=[0, 10]), dict(balance="weights", weights=[0, 1])])
def test_two_gpu_device_0_without_rows(make_dp, split) -> None:
    # 20.1: replicate([1]) would fail in torch's Broadcast ("All tensors must be on devices[0]").
    torch.manual_seed(8)
    plain = make_mlp().cuda()
    dp = make_dp(copy.deepcopy(plain), device_ids=[0, 1], **split)
    x = torch.randn(10, 5, device="cuda")
    for _ in range(2):
        out = dp(x)
        torch.testing.assert_close(out, plain(x), **TOL)
        out.pow(2).sum().backward()
    plain(x).pow(2).sum().backward()
    plain(x).pow(2).sum().backward()
    assert_grads_close(plain, dp.module)
    assert finished(dp).devices == ("cuda:1",)


@two_gpus
def test_two_gpu_a_single_device_on_cuda_1_is_timed_there(make_dp) -> None:
    # 20.2: the module runs on the caller's thread; its events go on cuda:1's stream, and the
    # current device stays the caller's (torch's single-device path does not switch it either).
    seen: list[int] = []
    busy = cycles_for(50, device=1)
    module = nn.Sequential(Busy(busy, seen), SlowBackward(busy)).cuda(1)
    dp = make_dp(module, device_ids=[1])
    assert torch.cuda.current_device() == 0
    dp(torch.randn(8, 4, device="cuda:1")).sum().backward()
    (replica,) = finished(dp).replicas
    assert seen == [0]
    assert replica.device == "cuda:1" and replica.forward_ms > 40 and replica.backward_ms > 40
