"""Shared fixtures for the engine tests (the `cuda` marker itself is declared in pyproject)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from dpengine import DataParallel


@pytest.fixture
def make_dp() -> Iterator[Callable[..., DataParallel]]:
    """Build DataParallel objects that are closed (worker threads stopped) after the test."""
    made: list[DataParallel] = []

    def build(*args, **kwargs) -> DataParallel:
        dp = DataParallel(*args, **kwargs)
        made.append(dp)
        return dp

    yield build
    for dp in made:
        dp.close()


@pytest.fixture
def keep_num_threads() -> Iterator[int]:
    """The main thread's intra-op thread count, put back after the test whatever it did."""
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)
