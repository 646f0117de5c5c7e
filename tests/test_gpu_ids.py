"""GPU ids a script names under `dptui run` on a machine without GPUs (dpengine/script/gpu_ids.py)."""

from __future__ import annotations

import pytest
import torch

from dpengine.script import gpu_ids


@pytest.fixture
def no_gpus(monkeypatch):
    monkeypatch.setattr(gpu_ids, "cuda_device_count", lambda: 0)


def test_every_way_to_name_a_gpu_becomes_the_virtual_device_of_its_number(no_gpus):
    said: list[str] = []
    mapped = gpu_ids.as_virtual([0, "1", "cuda:2", torch.device("cuda", 3), "cpu:5"], said.append)
    assert mapped == ["cpu:0", "cpu:1", "cpu:2", "cpu:3", "cpu:5"]
    assert said == ["the script asks DataParallel for GPU 0, 1, cuda:2, 3 and this machine has none: dptui "
                    "ran them on virtual devices cpu:0, cpu:1, cpu:2, cpu:3"]


def test_one_device_alone_is_a_list_of_one_and_virtual_ones_are_not_said(no_gpus):
    said: list[str] = []
    assert gpu_ids.as_virtual(1, said.append) == ["cpu:1"]
    assert said == ["the script asks DataParallel for GPU 1 and this machine has none: dptui ran it on "
                    "virtual device cpu:1"]
    assert gpu_ids.as_virtual("cpu:1", said.append) == ["cpu:1"] and len(said) == 1
    assert gpu_ids.as_virtual(range(2), said.append) == ["cpu:0", "cpu:1"]


def test_output_device_follows_and_the_cpu_stays_the_cpu(no_gpus):
    assert gpu_ids.output_as_virtual(2) == "cpu:2"
    assert gpu_ids.output_as_virtual(-1) == -1
    assert gpu_ids.output_as_virtual("cpu") == "cpu"
    assert gpu_ids.output_as_virtual(None) is None


def test_with_gpus_the_ids_stay_as_written(monkeypatch):
    monkeypatch.setattr(gpu_ids, "cuda_device_count", lambda: 2)
    said: list[str] = []
    assert gpu_ids.as_virtual([0, 1], said.append) == [0, 1] and said == []
    assert gpu_ids.output_as_virtual(1) == 1
