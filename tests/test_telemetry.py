"""Telemetry: psutil CPU figures, the poller thread, and NVML through a hand-written fake."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import types
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace

import psutil
import pynvml
import pytest
import torch
from waiting import wait_for

from dpengine.telemetry import (
    CombinedSource,
    CpuSource,
    DeviceSample,
    NvmlSource,
    TelemetryPoller,
    open_telemetry,
)
from dpengine.telemetry.nvml import _identity_keys

# ---------------------------------------------------------------- CPU


def _spin(until: threading.Event) -> None:
    while not until.is_set():
        sum(range(1000))


def _busy_for(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(1000))


def _thread_cpu(native_id: int) -> float:
    """CPU seconds the thread has used so far, as the OS counts them."""
    return next(t.user_time + t.system_time for t in psutil.Process().threads() if t.id == native_id)


def _until_used(cpu_seconds, amount: float, timeout: float = 60.0) -> tuple[float, float]:
    """Wait until `cpu_seconds()` has grown by `amount` (however busy the machine): (CPU used, wall)."""
    start_cpu, start = cpu_seconds(), time.monotonic()
    while (used := cpu_seconds() - start_cpu) < amount:
        assert time.monotonic() - start < timeout, "the busy thread got no CPU"
        time.sleep(0.01)
    return used, time.monotonic() - start


def test_cpu_source_values_are_sane() -> None:
    source = CpuSource(["cpu:0", "cpu:1"])
    samples = source.sample()
    assert [s.device for s in samples] == ["cpu:0", "cpu:1"]
    for s in samples:
        assert s.name == "virtual"
        assert s.memory_used_bytes > 0
        assert s.memory_total_bytes >= s.memory_used_bytes
        assert s.memory_total_bytes == psutil.virtual_memory().total
        assert 0.0 <= s.utilization_pct <= 100.0
        assert s.temperature_c is None and s.power_w is None
        assert s.missing["temperature_c"] == "not available for virtual CPU devices"
        assert s.missing["power_w"] == "not available for virtual CPU devices"
        assert not s.lost


def test_cpu_first_sample_is_not_a_bogus_zero() -> None:
    process = psutil.Process()
    source = CpuSource(["cpu:0"])
    start_cpu, start = sum(process.cpu_times()[:2]), time.monotonic()
    while sum(process.cpu_times()[:2]) - start_cpu < 0.2:  # CPU used, not wall time: a busy machine
        _busy_for(0.02)
    used, wall = sum(process.cpu_times()[:2]) - start_cpu, time.monotonic() - start
    (s,) = source.sample()
    # This process's share of the machine's cores; psutil unprimed would say 0.0.
    assert s.utilization_pct > 0.5 * 100 * used / wall / psutil.cpu_count(), (s.utilization_pct, used, wall)


def test_cpu_source_of_a_script_that_ended_gives_no_sample_and_no_error() -> None:
    # dptui run watches the script's process; its last poll can come after the script was reaped
    # (seen as a "telemetry poll failed" traceback at the end of a real pytorch-cifar run).
    script = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        source = CpuSource(["cpu:0", "cpu:1"], thread_ids=lambda: {}, pid=script.pid)
        assert len(source.sample()) == 2
    finally:
        script.kill()
        script.wait()
    assert source.sample() == ()


def test_cpu_per_thread_utilisation_tells_busy_from_idle() -> None:
    stop = threading.Event()
    busy = threading.Thread(target=_spin, args=(stop,), daemon=True)
    idle = threading.Thread(target=stop.wait, daemon=True)
    busy.start()
    idle.start()
    try:
        tids = {"cpu:0": busy.native_id, "cpu:1": idle.native_id}
        source = CpuSource(["cpu:0", "cpu:1", "cpu:2"], thread_ids=lambda: tids)
        used, wall = _until_used(lambda: _thread_cpu(busy.native_id), 0.2)
        by_device = {s.device: s.utilization_pct for s in source.sample()}
    finally:
        stop.set()
        busy.join()
        idle.join()
    # What the busy thread really got (little, next to other busy processes), not a fixed figure.
    got = 100 * used / wall
    assert by_device["cpu:0"] > 0.5 * got, (by_device, got)
    assert by_device["cpu:1"] < 5.0, by_device
    assert by_device["cpu:0"] > 2 * by_device["cpu:1"], by_device
    assert 0.0 <= by_device["cpu:2"] <= 100.0  # no thread: the process figure


def test_cpu_device_whose_thread_is_unknown_gets_the_process_figure() -> None:
    source = CpuSource(["cpu:0", "cpu:1"], thread_ids=lambda: {"cpu:0": -1})
    _busy_for(0.2)
    first, second = source.sample()
    assert first.utilization_pct == second.utilization_pct > 0.0


def test_cpu_source_rejects_other_devices() -> None:
    with pytest.raises(ValueError, match="cpu:N"):
        CpuSource(["cuda:0"])


# ---------------------------------------------------------------- poller


@dataclass
class _ListSource:
    devices: tuple[str, ...] = ("cpu:0",)
    failures: int = 0  # how many first calls raise
    calls: int = 0
    threads: set[str] = field(default_factory=set)

    def sample(self) -> tuple[DeviceSample, ...]:
        self.calls += 1
        self.threads.add(threading.current_thread().name)
        if self.calls <= self.failures:
            raise RuntimeError(f"boom {self.calls}")
        return (DeviceSample("cpu:0", "virtual", time.monotonic()),)

    def close(self) -> None:
        pass


def test_poller_calls_back_at_the_interval_off_the_callers_thread() -> None:
    source = _ListSource()
    stamps: list[float] = []
    with TelemetryPoller(source, lambda samples: stamps.append(time.monotonic()), interval=0.2) as poller:
        wait_for(lambda: len(stamps) >= 4, "four samples")
        assert poller.running
    assert not poller.running
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    assert 0.15 < sum(gaps) / len(gaps) < 0.4, gaps
    assert source.threads == {"dptui-telemetry"}
    assert poller.last_error is None


def test_poller_stops_promptly_and_idempotently() -> None:
    got = threading.Event()
    poller = TelemetryPoller(_ListSource(), lambda samples: got.set(), interval=30.0).start()
    assert got.wait(2.0)  # the first sample comes at once, not after one interval
    started = time.monotonic()
    poller.stop()
    assert time.monotonic() - started < 1.0
    assert not poller.running
    poller.stop()


def test_poller_survives_a_raising_source_and_callback() -> None:
    source = _ListSource(failures=2)
    received: list[tuple[DeviceSample, ...]] = []

    def callback(samples: tuple[DeviceSample, ...]) -> None:
        received.append(samples)
        if len(received) == 1:
            raise ValueError("bad callback")

    with TelemetryPoller(source, callback, interval=0.2) as poller:
        wait_for(lambda: len(received) >= 2, "two samples through")
    assert source.calls >= 4
    assert poller.last_error == "ValueError: bad callback"


def test_poller_keeps_the_last_error_text() -> None:
    with TelemetryPoller(_ListSource(failures=10**6), lambda samples: None, interval=0.2) as poller:
        wait_for(lambda: poller.last_error is not None, "an error")
    assert poller.last_error.startswith("RuntimeError: boom")


def test_poller_rejects_a_too_short_interval() -> None:
    with pytest.raises(ValueError, match="at least 0.2 s"):
        TelemetryPoller(_ListSource(), lambda samples: None, interval=0.1)


# ---------------------------------------------------------------- combined


def test_combined_source_keeps_the_requested_order() -> None:
    a = SimpleNamespace(devices=("cuda:0",), sample=lambda: (DeviceSample("cuda:0", "GPU", 0.0),))
    b = CpuSource(["cpu:0", "cpu:1"])
    combined = CombinedSource([a, b], ["cpu:1", "cuda:0", "cpu:0"])
    assert [s.device for s in combined.sample()] == ["cpu:1", "cuda:0", "cpu:0"]
    with pytest.raises(ValueError):
        CombinedSource([a, b], ["cpu:0", "cuda:0"])


def test_open_telemetry_mixes_cuda_and_cpu_in_order() -> None:
    source = open_telemetry(["cpu:0", "cuda:0", "cpu:1"])
    try:
        samples = source.sample()
    finally:
        source.close()
    assert [s.device for s in samples] == ["cpu:0", "cuda:0", "cpu:1"]
    assert samples[0].name == "virtual"
    with pytest.raises(ValueError, match="mps:0"):
        open_telemetry(["mps:0"])


# ---------------------------------------------------------------- NVML, real library


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU fallback")
def test_nvml_without_a_gpu_degrades_without_raising() -> None:
    source = NvmlSource(["cuda:0", "cuda:1"])
    samples = source.sample()
    source.close()
    source.close()
    assert [s.device for s in samples] == ["cuda:0", "cuda:1"]
    for s in samples:
        assert s.missing["device"]  # e.g. "NVML unavailable: NVML Shared Library Not Found"
        assert s.name == "GPU"
        assert s.utilization_pct is None and not s.lost


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nvml_samples_a_real_gpu() -> None:
    source = NvmlSource(["cuda:0"])
    try:
        (s,) = source.sample()
    finally:
        source.close()
    assert "device" not in s.missing, s.missing
    assert s.name not in ("", "GPU")
    assert s.memory_total_bytes and s.memory_total_bytes > 0
    assert s.memory_used_bytes is not None and s.memory_used_bytes <= s.memory_total_bytes
    assert s.utilization_pct is not None and 0.0 <= s.utilization_pct <= 100.0


# ---------------------------------------------------------------- NVML, fake library


@dataclass(eq=False)
class FakeGpu:
    """One NVML device; its handle is the object itself."""

    uuid: str  # torch's form, without "GPU-"
    bus: int
    name: str
    util: int = 0
    fail: dict[str, type[pynvml.NVMLError]] = field(default_factory=dict)  # NVML function -> error
    mig: bool = False  # a MIG instance: NVML names it "MIG-<uuid>" and it shares its parent's bus


class FakeNvml(types.ModuleType):
    """Just the part of pynvml that NvmlSource uses, with the real exception classes."""

    NVMLError = pynvml.NVMLError
    NVMLError_GpuIsLost = pynvml.NVMLError_GpuIsLost
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
    NVML_CLOCK_SM = pynvml.NVML_CLOCK_SM

    def __init__(self, gpus: list[FakeGpu], init_error: type[pynvml.NVMLError] | None = None) -> None:
        super().__init__("pynvml")
        self.gpus = gpus  # in NVML (PCI) order
        self.init_error = init_error
        self.calls: Counter[str] = Counter()

    def _call(self, function: str, gpu: FakeGpu, value: object) -> object:
        self.calls[function] += 1
        if function in gpu.fail:
            raise gpu.fail[function]()
        return value

    def nvmlInit(self) -> None:
        self.calls["nvmlInit"] += 1
        if self.init_error:
            raise self.init_error()

    def nvmlShutdown(self) -> None:
        self.calls["nvmlShutdown"] += 1

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeGpu:
        self.calls["nvmlDeviceGetHandleByUUID"] += 1
        for gpu in self.gpus:
            if uuid == f"{'MIG' if gpu.mig else 'GPU'}-{gpu.uuid}":
                return gpu
        raise pynvml.NVMLError_NotFound()

    def nvmlDeviceGetHandleByPciBusId(self, bus_id: str) -> FakeGpu:
        self.calls["nvmlDeviceGetHandleByPciBusId"] += 1
        domain, bus, rest = bus_id.split(":")  # NVML reads each part as hex, whatever its width
        for gpu in self.gpus:  # the parent GPU comes first: NVML's bus ids name whole GPUs
            if int(domain, 16) == 0 and int(bus, 16) == gpu.bus and rest == "00.0" and not gpu.mig:
                return gpu
        raise pynvml.NVMLError_NotFound()

    def nvmlDeviceGetName(self, gpu: FakeGpu) -> str:
        return self._call("nvmlDeviceGetName", gpu, gpu.name)

    def nvmlDeviceGetMemoryInfo(self, gpu: FakeGpu) -> SimpleNamespace:
        return self._call("nvmlDeviceGetMemoryInfo", gpu, SimpleNamespace(total=80 << 30, used=gpu.bus << 20))

    def nvmlDeviceGetEnforcedPowerLimit(self, gpu: FakeGpu) -> int:
        return self._call("nvmlDeviceGetEnforcedPowerLimit", gpu, 700_000)

    def nvmlDeviceGetUtilizationRates(self, gpu: FakeGpu) -> SimpleNamespace:
        return self._call("nvmlDeviceGetUtilizationRates", gpu, SimpleNamespace(gpu=gpu.util, memory=0))

    def nvmlDeviceGetTemperature(self, gpu: FakeGpu, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._call("nvmlDeviceGetTemperature", gpu, 41)

    def nvmlDeviceGetPowerUsage(self, gpu: FakeGpu) -> int:
        return self._call("nvmlDeviceGetPowerUsage", gpu, 123_456)

    def nvmlDeviceGetClockInfo(self, gpu: FakeGpu, clock: int) -> int:
        assert clock == pynvml.NVML_CLOCK_SM
        return self._call("nvmlDeviceGetClockInfo", gpu, 1980)


SLOW = FakeGpu("aaaaaaaa-0000-0000-0000-000000000001", bus=0x1B, name="Slow GPU", util=10)
FAST = FakeGpu("bbbbbbbb-0000-0000-0000-000000000002", bus=0x3B, name="Fast GPU", util=90)


@pytest.fixture
def install_fake(monkeypatch: pytest.MonkeyPatch):
    """Installs a fake pynvml and a torch that sees `cuda_order` (torch's view of each GPU)."""

    def install(nvml: FakeNvml, cuda_order: list[SimpleNamespace]) -> FakeNvml:
        monkeypatch.setitem(sys.modules, "pynvml", nvml)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(cuda_order))
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: cuda_order[i])
        return nvml

    return install


def _props(gpu: FakeGpu, uuid: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        name=f"torch {gpu.name}",
        uuid=uuid or gpu.uuid,
        pci_domain_id=0,
        pci_bus_id=gpu.bus,
        pci_device_id=0,
    )


def _fresh(gpu: FakeGpu, **changes: object) -> FakeGpu:
    return FakeGpu(**{**gpu.__dict__, "fail": {}, **changes})


def test_nvml_maps_cuda_devices_by_uuid_not_by_index(install_fake) -> None:
    slow, fast = _fresh(SLOW), _fresh(FAST)
    nvml = install_fake(FakeNvml([slow, fast]), [_props(fast), _props(slow)])  # CUDA: fastest first
    source = NvmlSource(["cuda:0", "cuda:1"])
    cuda0, cuda1 = source.sample()
    assert (cuda0.device, cuda0.name, cuda0.utilization_pct) == ("cuda:0", "Fast GPU", 90.0)
    assert (cuda1.device, cuda1.name, cuda1.utilization_pct) == ("cuda:1", "Slow GPU", 10.0)
    assert cuda0.memory_used_bytes == 0x3B << 20
    assert cuda0.memory_total_bytes == 80 << 30
    assert cuda0.temperature_c == 41.0
    assert cuda0.power_w == pytest.approx(123.456)
    assert cuda0.power_limit_w == pytest.approx(700.0)
    assert cuda0.sm_clock_mhz == 1980
    assert cuda0.missing == {} and not cuda0.lost
    assert nvml.calls["nvmlDeviceGetHandleByPciBusId"] == 0


def test_nvml_falls_back_to_the_pci_bus_id(install_fake) -> None:
    slow, fast = _fresh(SLOW), _fresh(FAST)
    install_fake(FakeNvml([slow, fast]), [_props(fast, uuid="not-known-to-nvml")])
    (s,) = NvmlSource(["cuda:0"]).sample()
    assert s.name == "Fast GPU" and "device" not in s.missing


def test_nvml_device_matching_nothing_is_reported_missing(install_fake) -> None:
    install_fake(FakeNvml([_fresh(SLOW)]), [_props(_fresh(FAST), uuid="unknown")])
    # Torch's second device does not exist at all.
    cuda0, cuda1 = NvmlSource(["cuda:0", "cuda:1"]).sample()
    assert "no NVML device matches cuda:0" in cuda0.missing["device"]
    assert cuda0.name == "torch Fast GPU"
    assert cuda1.missing["device"] == "no CUDA device 1 (torch sees 1)"


def test_nvml_unsupported_field_is_none_with_a_reason(install_fake) -> None:
    fail = {
        "nvmlDeviceGetTemperature": pynvml.NVMLError_NotSupported,
        "nvmlDeviceGetPowerUsage": pynvml.NVMLError_NoPermission,
    }
    gpu = _fresh(FAST, fail=fail)
    install_fake(FakeNvml([gpu]), [_props(gpu)])
    (s,) = NvmlSource(["cuda:0"]).sample()
    assert s.temperature_c is None and s.missing["temperature_c"] == "not supported"
    assert s.power_w is None and s.missing["power_w"] == "no permission"
    assert s.utilization_pct == 90.0 and s.sm_clock_mhz == 1980 and s.memory_used_bytes is not None
    assert "device" not in s.missing and not s.lost


def test_nvml_static_failure_is_reported_on_every_sample(install_fake) -> None:
    fail = {
        "nvmlDeviceGetEnforcedPowerLimit": pynvml.NVMLError_NotSupported,
        "nvmlDeviceGetName": pynvml.NVMLError_Unknown,
    }
    gpu = _fresh(FAST, fail=fail)
    install_fake(FakeNvml([gpu]), [_props(gpu)])
    source = NvmlSource(["cuda:0"])
    for s in source.sample() + source.sample():
        assert s.power_limit_w is None and s.missing == {"power_limit_w": "not supported"}
        assert s.name == "torch Fast GPU"  # NVML had no name; torch's stands in


def test_nvml_lost_gpu_marks_the_sample_lost(install_fake) -> None:
    lost, fine = _fresh(FAST, fail={"nvmlDeviceGetMemoryInfo": pynvml.NVMLError_GpuIsLost}), _fresh(SLOW)
    nvml = install_fake(FakeNvml([lost, fine]), [_props(lost), _props(fine)])
    source = NvmlSource(["cuda:0", "cuda:1"])
    for _ in range(3):
        gone, ok = source.sample()
        assert gone.lost and gone.missing == {"device": "GPU is lost"} and gone.utilization_pct is None
        assert not ok.lost and ok.utilization_pct == 10.0
    # Lost at open (memory info), so only the fine GPU was asked for utilisation.
    assert nvml.calls["nvmlDeviceGetUtilizationRates"] == 3


def test_nvml_lost_during_sampling(install_fake) -> None:
    gpu = _fresh(FAST)
    install_fake(FakeNvml([gpu]), [_props(gpu)])
    source = NvmlSource(["cuda:0"])
    assert not source.sample()[0].lost
    gpu.fail["nvmlDeviceGetTemperature"] = pynvml.NVMLError_GpuIsLost
    (s,) = source.sample()
    assert s.lost and s.temperature_c is None and s.missing["device"] == "GPU is lost"


def test_nvml_opens_handles_once_and_shuts_down_once(install_fake) -> None:
    slow, fast = _fresh(SLOW), _fresh(FAST)
    nvml = install_fake(FakeNvml([slow, fast]), [_props(fast), _props(slow)])
    source = NvmlSource(["cuda:0", "cuda:1"])
    for _ in range(20):
        source.sample()
    assert nvml.calls["nvmlInit"] == 1
    assert nvml.calls["nvmlDeviceGetHandleByUUID"] == 2
    assert nvml.calls["nvmlDeviceGetName"] == 2
    assert nvml.calls["nvmlDeviceGetEnforcedPowerLimit"] == 2
    assert nvml.calls["nvmlDeviceGetUtilizationRates"] == 40
    source.close()
    source.close()
    assert nvml.calls["nvmlShutdown"] == 1
    (s, _) = source.sample()  # after close: no NVML call, no exception
    assert s.missing == {"device": "telemetry closed"}
    assert nvml.calls["nvmlDeviceGetUtilizationRates"] == 40


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (pynvml.NVMLError_LibraryNotFound, "NVML unavailable: NVML Shared Library Not Found"),
        (pynvml.NVMLError_DriverNotLoaded, "NVML unavailable: Driver Not Loaded"),
    ],
)
def test_nvml_init_failure_degrades_with_torchs_name(install_fake, error, reason) -> None:
    nvml = install_fake(FakeNvml([], init_error=error), [_props(FAST)])
    source = NvmlSource(["cuda:0"])
    (s,) = source.sample()
    assert s.missing == {"device": reason}
    assert s.name == "torch Fast GPU"
    source.close()
    assert nvml.calls["nvmlShutdown"] == 0  # never initialised


def test_nvml_without_pynvml_degrades(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    (s,) = NvmlSource(["cuda:0"]).sample()
    assert s.missing["device"].startswith("NVML unavailable: pynvml cannot be imported")


def test_nvml_tries_a_mig_instances_uuid_before_the_bus_id_it_shares_with_its_parent() -> None:
    props = SimpleNamespace(uuid="cccccccc-0000-0000-0000-000000000003", pci_domain_id=0, pci_bus_id=0x1B,
                            pci_device_id=0)
    keys = [key for _, key in _identity_keys(FakeNvml([]), props)]
    assert keys[:3] == ["GPU-cccccccc-0000-0000-0000-000000000003", "MIG-cccccccc-0000-0000-0000-000000000003",
                        "cccccccc-0000-0000-0000-000000000003"]
    assert all(key.endswith(":1b:00.0") for key in keys[3:])  # the bus id last


def test_nvml_binds_a_mig_instance_not_its_parent_and_says_mig(install_fake) -> None:
    parent = _fresh(FAST)
    instance = FakeGpu("cccccccc-0000-0000-0000-000000000003", bus=FAST.bus, name="NVIDIA A100-SXM4-40GB", util=7,
                       mig=True)
    install_fake(FakeNvml([parent, instance]), [_props(instance)])  # CUDA_VISIBLE_DEVICES=MIG-ccc...
    (s,) = NvmlSource(["cuda:0"]).sample()
    assert s.name == "NVIDIA A100-SXM4-40GB MIG" and s.utilization_pct == 7.0 and "device" not in s.missing


class LegacyPynvml(FakeNvml):
    """pynvml 11.x shadowing nvidia-ml-py: string arguments must be bytes (ctypes c_char_p)."""

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if isinstance(uuid, str):
            raise TypeError("bytes or integer address expected instead of str instance")
        return super().nvmlDeviceGetHandleByUUID(uuid.decode())


def test_a_legacy_pynvml_package_is_named_and_training_goes_on(install_fake) -> None:
    gpu = _fresh(FAST)
    nvml = install_fake(LegacyPynvml([gpu]), [_props(gpu)])
    source = open_telemetry(["cuda:0", "cpu:0"])
    try:
        cuda, cpu = source.sample()
    finally:
        source.close()
    assert cuda.missing == {"device": "NVML unavailable: legacy pynvml package, install nvidia-ml-py"}
    assert cuda.name == "torch Fast GPU" and cpu.device == "cpu:0"
    assert nvml.calls["nvmlShutdown"] == 1  # what was initialised is shut down
