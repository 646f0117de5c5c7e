"""Device lists: what is accepted, and clear errors for what is not."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from dpengine import DataParallel, auto_devices, available_devices, device_name, resolve_devices
from dpengine.devices import device_slots, parse_device

HAS_CUDA = torch.cuda.is_available()
CUDA_COUNT = torch.cuda.device_count() if HAS_CUDA else 0
no_cuda = pytest.mark.skipif(HAS_CUDA, reason="checks the behaviour of a machine without CUDA")


@pytest.mark.parametrize(
    ("specs", "expected"),
    [
        (["cpu:0", "cpu:1"], [("cpu", 0), ("cpu", 1)]),
        (["cpu:2", "cpu:0"], [("cpu", 2), ("cpu", 0)]),  # order is kept
        ([torch.device("cpu", 1), torch.device("cpu", 3)], [("cpu", 1), ("cpu", 3)]),
        (["cpu"], [("cpu", 0)]),
        ([torch.device("cpu")], [("cpu", 0)]),
        ([" cpu:1 "], [("cpu", 1)]),
        ("cpu:3", [("cpu", 3)]),  # a single entry is a one-device list
        (torch.device("cpu", 2), [("cpu", 2)]),
    ],
)
def test_cpu_specs_are_accepted(specs, expected) -> None:
    devices = resolve_devices(specs)
    assert [(d.type, d.index) for d in devices] == expected
    assert all(isinstance(d, torch.device) for d in devices)


def test_device_names_always_have_an_index() -> None:
    assert device_name(torch.device("cpu")) == "cpu:0"
    assert device_name(torch.device("cpu", 3)) == "cpu:3"
    assert device_name(torch.device("cuda", 1)) == "cuda:1"


@pytest.mark.skipif(CUDA_COUNT < 1, reason="needs a CUDA device")
@pytest.mark.cuda
@pytest.mark.parametrize("spec", [0, "0", "cuda:0", "cuda", torch.device("cuda", 0)])
def test_cuda_specs_are_accepted_where_cuda_exists(spec) -> None:
    assert resolve_devices([spec]) == [torch.device("cuda", 0)]


@no_cuda
@pytest.mark.parametrize("spec", ["cuda:0", 0, "0", "cuda", torch.device("cuda", 0), 3])
def test_cuda_specs_without_cuda_name_the_entry_and_what_is_available(spec) -> None:
    with pytest.raises(ValueError) as info:
        resolve_devices([spec])
    message = str(info.value)
    assert repr(spec) in message
    assert "available" in message and "no CUDA devices" in message and "cpu:0" in message


@pytest.mark.parametrize("spec", ["gpu:0", "cpu:x", "cpu:-1", -1, "meta", "", 1.5, None, True, "mps:0"])
def test_invalid_entries_are_named(spec) -> None:
    with pytest.raises(ValueError) as info:
        resolve_devices(["cpu:0", spec])
    message = str(info.value)
    assert f"invalid device {spec!r}" in message
    assert "available" in message


@pytest.mark.parametrize(
    "specs",
    [
        ["cpu:1", "cpu:1"],
        ["cpu:0", "cpu:1", torch.device("cpu", 1)],
        ["cpu", "cpu:0"],  # "cpu" is cpu:0
    ],
)
def test_duplicates_are_refused(specs) -> None:
    with pytest.raises(ValueError, match="listed twice") as info:
        resolve_devices(specs)
    message = str(info.value)
    assert repr(specs[-1]) in message and "available" in message


def test_mixing_cpu_and_cuda_is_refused() -> None:
    # Refused before existence is checked, so the message is the same with or without CUDA.
    with pytest.raises(ValueError, match="cannot mix cpu and cuda") as info:
        resolve_devices(["cpu:0", "cuda:0"])
    assert "'cuda:0'" in str(info.value) and "available" in str(info.value)
    with pytest.raises(ValueError, match="cannot mix cpu and cuda"):
        resolve_devices([0, "cpu:1"])


def test_empty_list_is_refused() -> None:
    with pytest.raises(ValueError, match="empty device list") as info:
        resolve_devices([])
    assert "available" in str(info.value)


def test_data_parallel_checks_its_device_list() -> None:
    with pytest.raises(ValueError, match="gpu:0"):
        DataParallel(nn.Linear(2, 2), ["gpu:0"])
    with pytest.raises(ValueError, match="empty device list"):
        DataParallel(nn.Linear(2, 2), [])
    # as torch's DataParallel takes device_ids=[0, 0]: a replica for each entry (dptui's --devices refuses it)
    assert resolve_devices(["cpu:1", "cpu:1"], repeats=True) == [torch.device("cpu", 1)] * 2


@no_cuda
def test_data_parallel_refuses_cuda_ids_without_cuda() -> None:
    for ids in ([0], [0, 1], ["cuda:0"]):
        with pytest.raises(ValueError, match="does not exist"):
            DataParallel(nn.Linear(2, 2), ids)


@no_cuda
def test_device_ids_none_without_cuda_calls_the_module_directly() -> None:
    calls: list[str] = []

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x, scale=1.0):
            calls.append(threading.current_thread().name)
            return self.lin(x) * scale

    module = Probe()
    before = threading.active_count()
    dp = DataParallel(module)
    assert dp.devices == [] and dp.device_ids == [] and dp.output_device is None
    x = torch.randn(4, 3)
    out = dp(x, scale=2.0)
    torch.testing.assert_close(out, module.lin(x) * 2.0)
    assert out.grad_fn is not None
    assert calls == [threading.current_thread().name]
    assert dp.last_step is None and dp.worker_thread_ids() == {}
    assert threading.active_count() == before


def test_ints_and_devices_mean_cuda_like_torch() -> None:
    # torch.nn.DataParallel's ints are CUDA indices; the parse does not depend on CUDA existing.
    assert parse_device(1) == torch.device("cuda", 1)
    assert parse_device("2") == torch.device("cuda", 2)
    assert parse_device(torch.device("cuda", 3)) == torch.device("cuda", 3)
    assert parse_device("cuda") == torch.device("cuda", 0)


def test_data_parallel_accepts_every_cpu_spelling(make_dp) -> None:
    module = nn.Linear(3, 2)
    dp = make_dp(module, ["cpu:0", torch.device("cpu", 1), "cpu:2"])
    assert dp.devices == [torch.device("cpu", i) for i in range(3)]
    x = torch.randn(6, 3)
    torch.testing.assert_close(dp(x), module(x))
    assert dp.last_step.devices == ("cpu:0", "cpu:1", "cpu:2")


def test_device_order_is_kept(make_dp) -> None:
    module = nn.Linear(3, 2)
    dp = make_dp(module, ["cpu:2", "cpu:0"])
    x = torch.randn(6, 3)
    torch.testing.assert_close(dp(x), module(x))
    assert dp.last_step.devices == ("cpu:2", "cpu:0")
    assert sorted(dp.worker_thread_ids()) == ["cpu:0", "cpu:2"]


def test_auto_and_available_devices() -> None:
    auto = auto_devices(virtual=3)
    if HAS_CUDA:
        assert auto == [torch.device("cuda", i) for i in range(CUDA_COUNT)]
    else:
        assert auto == [torch.device("cpu", i) for i in range(3)]
    offered = available_devices([torch.device("cpu", 5)])
    assert offered[:6] == [torch.device("cpu", i) for i in range(6)]
    assert all(d.type == "cpu" for d in offered)


def test_device_slots_fill_a_device_listed_twice_in_order() -> None:
    cpu0, cpu1 = torch.device("cpu", 0), torch.device("cpu", 1)
    listed = [cpu0, cpu0, cpu1]
    assert device_slots(listed, [cpu0, cpu0, cpu1]) == [0, 1, 2]
    assert device_slots(listed, [cpu1, cpu0]) == [2, 0]
    assert device_slots([cpu0, cpu1], [cpu0, cpu0]) == [0, 0]  # wanted more often than listed: its slot again
    assert device_slots(listed, [torch.device("cpu", 2)]) is None
