"""Scatter and gather: torch.chunk's table, structure handling, and the fixes over torch."""

from __future__ import annotations

import math
import threading
import warnings
from collections import OrderedDict, namedtuple
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from dpengine.scatter_gather import Split, even_sizes, gather, scatter_kwargs
from reference_loop import chunk_sizes

CPU = torch.device("cpu")
Pair = namedtuple("Pair", ["a", "b"])


def cpus(count: int) -> list[str]:
    return [f"cpu:{i}" for i in range(count)]


def devs(count: int) -> list[torch.device]:
    return [torch.device("cpu", i) for i in range(count)]


@dataclass
class Config:
    scale: float
    tensor: torch.Tensor  # a dataclass is not split, even when it holds a tensor


class Recorder(nn.Module):
    """Records what each replica was called with; returns one row per input row."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(()))
        self.calls: list[dict] = []
        self._lock = threading.Lock()

    def forward(self, *args, **kwargs):
        with self._lock:
            self.calls.append(
                {"thread": threading.current_thread().name, "args": args, "kwargs": kwargs}
            )
        first = _first_tensor((args, kwargs))
        if first is None:
            return self.weight.view(1, 1) * 1.0
        return first.reshape(first.size(0), -1).sum(1, keepdim=True) * self.weight

    def by_thread(self) -> dict[str, dict]:
        return {c["thread"]: c for c in self.calls}


def _first_tensor(obj):
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (tuple, list)):
        for item in obj:
            found = _first_tensor(item)
            if found is not None:
                return found
    if isinstance(obj, dict):
        return _first_tensor(list(obj.values()))
    return None


# ----------------------------------------------------------------- the chunk table

TABLE = [(30, 3), (10, 3), (5, 4), (6, 4), (2, 3), (9, 4), (10, 4), (17, 8), (0, 3), (7, 1), (1, 4)]


@pytest.mark.parametrize(("rows", "count"), TABLE)
def test_even_sizes_follow_torch_chunk(rows: int, count: int) -> None:
    assert even_sizes(rows, count) == chunk_sizes(rows, count)


def test_even_sizes_table_values() -> None:
    # The cases the reference verified, spelled out (fewer chunks than devices included).
    table = {(30, 3): [10, 10, 10], (10, 3): [4, 4, 2], (5, 4): [2, 2, 1], (6, 4): [2, 2, 2],
             (2, 3): [1, 1], (9, 4): [3, 3, 3], (10, 4): [3, 3, 3, 1],
             (17, 8): [3, 3, 3, 3, 3, 2], (0, 3): [0, 0, 0]}
    for (rows, count), sizes in table.items():
        assert chunk_sizes(rows, count) == sizes  # torch agrees with the table...
        assert even_sizes(rows, count) == sizes  # ...and so does the engine


@pytest.mark.parametrize(("rows", "count"), TABLE)
def test_last_step_shows_the_chunk_table(make_dp, rows: int, count: int) -> None:
    module = nn.Linear(3, 2)
    dp = make_dp(module, cpus(count))
    x = torch.randn(rows, 3)
    out = dp(x)
    expected = chunk_sizes(rows, count)
    step = dp.last_step
    assert list(step.chunk_sizes) == expected
    assert list(step.devices) == cpus(count)[: len(expected)]
    assert step.batch_size == rows
    torch.testing.assert_close(out, module(x))


def test_chunks_along_dim_1(make_dp) -> None:
    dp = make_dp(Recorder(), cpus(3), dim=1)
    x = torch.randn(2, 10, 4)
    out = dp(x)
    assert list(dp.last_step.chunk_sizes) == chunk_sizes(10, 3) == [4, 4, 2]
    calls = dp.module.by_thread()
    for i, want in enumerate(x.chunk(3, 1)):
        assert torch.equal(calls[f"dpengine-cpu:{i}"]["args"][0], want)
    assert out.shape == (2, 3)  # gathered along dim 1: one column per replica


def _shares_storage(chunk: torch.Tensor, batch: torch.Tensor) -> bool:
    return chunk.untyped_storage().data_ptr() == batch.untyped_storage().data_ptr()


def test_chunks_past_device_0_are_contiguous_as_torchs_copies_make_them() -> None:
    """torch's scatter copies every chunk but device 0's (`.to(device)`): none of those is a strided view."""
    x = torch.randn(5, 9, requires_grad=True)
    args, _, slots = scatter_kwargs((x,), {}, devs(3), Split(3), dim=1)
    chunks = [a[0] for a in args]
    assert slots == [0, 1, 2]
    assert _shares_storage(chunks[0], x) and not chunks[0].is_contiguous()  # device 0's: torch's view
    for chunk, want in zip(chunks[1:], x.detach().chunk(3, 1)[1:]):
        assert chunk.is_contiguous() and not _shares_storage(chunk, x)
        assert torch.equal(chunk, want)
    sum((i + 1) * c.sum() for i, c in enumerate(chunks)).backward()
    torch.testing.assert_close(x.grad, torch.tensor([1.0] * 3 + [2.0] * 3 + [3.0] * 3).expand(5, 9))


def test_dense_chunks_are_not_copied() -> None:
    """Chunks along dim 0 already have the layout a copy would give them: no copy on the hot path."""
    x = torch.randn(9, 4)
    channels_last = torch.randn(6, 3, 4, 4).to(memory_format=torch.channels_last)
    for batch in (x, channels_last):
        args, _, _ = scatter_kwargs((batch,), {}, devs(3), Split(3))
        assert all(_shares_storage(a[0], batch) for a in args)
    assert all(a[0].is_contiguous(memory_format=torch.channels_last) for a in args)


def test_a_module_viewing_its_dim_1_chunk_works_where_torch_copies_it(make_dp) -> None:
    """Transformer-XL's `target.view(-1)` on a dim-1 chunk, BalancedDataParallel's gpu0_bsz=0 split."""

    class ViewingLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(1, 1)

        def forward(self, target: torch.Tensor) -> torch.Tensor:
            return self.proj(target.view(-1, 1).float()).view(target.size(0), -1)

    module = ViewingLoss()
    dp = make_dp(module, cpus(3), dim=1, chunk_sizes=[0, 7, 7])
    target = torch.randn(4, 14)
    out = dp(target)
    torch.testing.assert_close(out, module(target.contiguous()))
    out.sum().backward()
    assert dp.last_step.chunk_sizes == (7, 7)
    # device 0's chunk stays torch's view: the same module fails there, as on GPUs
    even = make_dp(ViewingLoss(), cpus(3), dim=1)
    with pytest.raises(RuntimeError, match=r"(?s)in replica 0 on device cpu:0.*view size is not compatible"):
        even(target)


# ----------------------------------------------------------------- structure


def test_scatter_splits_tensors_in_every_container() -> None:
    x = torch.arange(30.0).view(10, 3)
    y = torch.arange(10.0)
    od = OrderedDict([("z", x + 1), ("w", y + 1)])
    inputs = ((x, [y, (x * 2,)]), {"k": y * 3}, od, Pair(x, y), 1.5, "text", None)
    args, kwargs, slots = scatter_kwargs(inputs, {"kw": x * 5}, devs(3), Split(3))
    assert slots == [0, 1, 2]
    for i, (a, kw) in enumerate(zip(args, kwargs)):
        chunk = lambda t: t.chunk(3)[i]  # noqa: E731
        assert isinstance(a, tuple) and len(a) == len(inputs)
        assert isinstance(a[0], tuple) and isinstance(a[0][1], list) and isinstance(a[0][1][1], tuple)
        assert torch.equal(a[0][0], chunk(x))
        assert torch.equal(a[0][1][0], chunk(y))
        assert torch.equal(a[0][1][1][0], chunk(x * 2))
        assert type(a[1]) is dict and torch.equal(a[1]["k"], chunk(y * 3))
        assert type(a[2]) is OrderedDict and list(a[2]) == ["z", "w"]
        assert torch.equal(a[2]["z"], chunk(x + 1)) and torch.equal(a[2]["w"], chunk(y + 1))
        assert type(a[3]) is Pair
        assert torch.equal(a[3].a, chunk(x)) and torch.equal(a[3].b, chunk(y))
        assert a[4] is inputs[4] and a[5] is inputs[5] and a[6] is None
        assert list(kw) == ["kw"] and torch.equal(kw["kw"], chunk(x * 5))


def test_replicas_receive_split_structures_and_shared_objects(make_dp) -> None:
    recorder = Recorder()
    dp = make_dp(recorder, cpus(3))
    x = torch.randn(9, 2)
    config = Config(2.0, torch.randn(9))
    label = "same-object"
    scale = 0.25
    od = OrderedDict(b=x * 2, a=x * 3)
    dp(x, [x + 1], od, Pair(x, x - 1), config, label, scale, None, mask=x > 0, note=label, cfg=config)
    calls = recorder.by_thread()
    assert sorted(calls) == ["dpengine-cpu:0", "dpengine-cpu:1", "dpengine-cpu:2"]
    for i in range(3):
        args, kwargs = calls[f"dpengine-cpu:{i}"]["args"], calls[f"dpengine-cpu:{i}"]["kwargs"]
        piece = x.chunk(3)[i]
        assert torch.equal(args[0], piece)
        assert type(args[1]) is list and torch.equal(args[1][0], piece + 1)
        assert type(args[2]) is OrderedDict and list(args[2]) == ["b", "a"]
        assert torch.equal(args[2]["a"], piece * 3)
        assert type(args[3]) is Pair and torch.equal(args[3].b, piece - 1)
        # Not split: the very same objects on every replica.
        assert args[4] is config and args[5] is label and args[6] is scale and args[7] is None
        assert torch.equal(kwargs["mask"], piece > 0)
        assert kwargs["note"] is label and kwargs["cfg"] is config


def test_small_batch_with_non_tensor_kwarg_keeps_positional_inputs(make_dp) -> None:
    # torch: batch 2 on 3 devices with a non-tensor kwarg leaves the 3rd replica without args.
    recorder = Recorder()
    dp = make_dp(recorder, cpus(3))
    x = torch.randn(2, 4)
    out = dp(x, flag=True)
    assert len(recorder.calls) == 2
    for call in recorder.calls:
        assert len(call["args"]) == 1 and call["args"][0].shape == (1, 4)
        assert call["kwargs"] == {"flag": True}
    assert list(dp.last_step.chunk_sizes) == [1, 1]
    torch.testing.assert_close(out, x.sum(1, keepdim=True))


def test_scatter_kwargs_pads_nothing_for_small_batches() -> None:
    args, kwargs, slots = scatter_kwargs((torch.randn(2, 4),), {"flag": True}, devs(3), Split(3))
    assert slots == [0, 1] and len(args) == len(kwargs) == 2
    assert all(len(a) == 1 for a in args) and kwargs == [{"flag": True}, {"flag": True}]


def test_mismatched_batches_raise_instead_of_dropping_rows(make_dp) -> None:
    recorder = Recorder()
    dp = make_dp(recorder, cpus(3))
    with pytest.raises(ValueError, match="10 rows.*4 rows"):
        dp(torch.randn(10, 2), torch.randn(4, 2))
    with pytest.raises(ValueError, match="same batch size"):
        dp(torch.randn(10, 2), other=torch.randn(4, 2))
    assert recorder.calls == []  # nothing ran


def test_batches_that_split_into_the_same_chunk_count_are_fine(make_dp) -> None:
    recorder = Recorder()
    dp = make_dp(recorder, cpus(3))
    x, y = torch.randn(30, 2), torch.randn(60, 2)
    dp(x, y)
    for i in range(3):
        args = recorder.by_thread()[f"dpengine-cpu:{i}"]["args"]
        assert torch.equal(args[0], x.chunk(3)[i]) and args[0].size(0) == 10
        assert torch.equal(args[1], y.chunk(3)[i]) and args[1].size(0) == 20


@pytest.mark.parametrize("position", ["first", "second", "kwarg"])
def test_zero_dim_input_raises_a_clear_error(make_dp, position: str) -> None:
    dp = make_dp(Recorder(), cpus(2))
    scalar, batch = torch.tensor(3.0), torch.randn(4, 2)
    with pytest.raises(ValueError, match="0-dim tensor"):
        if position == "first":
            dp(scalar, batch)
        elif position == "second":
            dp(batch, scalar)
        else:
            dp(batch, s=scalar)


def test_no_inputs_runs_once_on_the_first_device(make_dp) -> None:
    recorder = Recorder()
    dp = make_dp(recorder, cpus(3))
    out = dp()
    assert [c["thread"] for c in recorder.calls] == ["dpengine-cpu:0"]
    assert recorder.calls[0]["args"] == () and recorder.calls[0]["kwargs"] == {}
    torch.testing.assert_close(out, recorder.weight.view(1, 1))


def test_non_tensor_inputs_go_to_every_device(make_dp) -> None:
    recorder = Recorder()
    dp = make_dp(recorder, cpus(3))
    dp(2.5, tag="x")
    assert sorted(c["thread"] for c in recorder.calls) == [f"dpengine-cpu:{i}" for i in range(3)]
    assert all(c["args"] == (2.5,) and c["kwargs"] == {"tag": "x"} for c in recorder.calls)


def test_scattered_chunks_are_differentiable() -> None:
    x = torch.randn(7, 3, requires_grad=True)
    args, _, _ = scatter_kwargs((x,), {}, devs(3), Split(3))
    weights = [1.0, 2.0, 3.0]
    sum(w * a[0].sum() for w, a in zip(weights, args)).backward()
    expected = torch.cat([torch.full((s, 3), w) for w, s in zip(weights, even_sizes(7, 3))])
    torch.testing.assert_close(x.grad, expected)


# ----------------------------------------------------------------- gather


def test_gather_concatenates_nested_structures_and_keeps_types() -> None:
    parts = [torch.randn(2, 3), torch.randn(3, 3)]
    outputs = [
        (p, [p * 2], OrderedDict(b=p + 1, a=p - 1), Pair(p, p.sum(1)), None) for p in parts
    ]
    out = gather(outputs, CPU)
    assert type(out) is tuple and type(out[1]) is list and type(out[2]) is OrderedDict
    assert type(out[3]) is Pair and out[4] is None
    assert list(out[2]) == ["b", "a"]
    torch.testing.assert_close(out[0], torch.cat(parts))
    torch.testing.assert_close(out[1][0], torch.cat(parts) * 2)
    torch.testing.assert_close(out[2]["a"], torch.cat(parts) - 1)
    torch.testing.assert_close(out[3].b, torch.cat([p.sum(1) for p in parts]))


def test_gather_along_dim_1_and_its_backward() -> None:
    parts = [torch.randn(2, k, requires_grad=True) for k in (3, 1)]
    out = gather(parts, CPU, dim=1)
    torch.testing.assert_close(out, torch.cat(parts, 1))
    (out * torch.arange(4.0)).sum().backward()
    torch.testing.assert_close(parts[0].grad, torch.arange(3.0).expand(2, 3))
    torch.testing.assert_close(parts[1].grad, torch.full((2, 1), 3.0))


def test_gather_scalars_become_a_vector_with_torchs_warning() -> None:
    scalars = [torch.tensor(1.0, requires_grad=True), torch.tensor(2.0, requires_grad=True)]
    with pytest.warns(UserWarning, match="Was asked to gather along dimension 0, but all input tensors were scalars"):
        out = gather(scalars, CPU)
    assert out.shape == (2,)
    torch.testing.assert_close(out, torch.tensor([1.0, 2.0]))
    (out * torch.tensor([3.0, 4.0])).sum().backward()
    assert scalars[0].grad.item() == 3.0 and scalars[1].grad.item() == 4.0


def test_scalar_outputs_through_data_parallel(make_dp) -> None:
    module = nn.Linear(3, 1)

    class Loss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = module

        def forward(self, x):
            return self.inner(x).sum()

    dp = make_dp(Loss(), cpus(3))
    x = torch.randn(10, 3)
    with pytest.warns(UserWarning, match="Was asked to gather along dimension 0, but all input tensors were scalars"):
        out = dp(x)
    expected = torch.stack([module(c).sum() for c in x.chunk(3)])
    assert out.shape == (3,)
    torch.testing.assert_close(out, expected)


def test_none_output_stays_none(make_dp) -> None:
    class Nothing(nn.Module):
        def forward(self, x):
            return None

    assert gather([None, None], CPU) is None
    dp = make_dp(Nothing(), cpus(2))
    assert dp(torch.randn(4, 2)) is None


def test_gather_dicts_of_different_lengths_raise() -> None:
    with pytest.raises(ValueError, match="same number of keys"):
        gather([{"a": torch.zeros(1)}, {"a": torch.zeros(1), "b": torch.zeros(1)}], CPU)


def test_dicts_of_different_lengths_from_replicas_raise(make_dp) -> None:
    class Ragged(nn.Module):
        def forward(self, x):
            out = {"a": x}
            if x[0, 0] < 0:  # only the chunk that starts with a negative row
                out["extra"] = x
            return out

    dp = make_dp(Ragged(), cpus(2))
    x = torch.ones(4, 2)
    x[2, 0] = -1.0  # first row of chunk 1
    with pytest.raises(ValueError, match="same number of keys"):
        dp(x)


def test_gather_keeps_bf16_and_no_float_promotion() -> None:
    parts = [torch.randn(2, 2, dtype=torch.bfloat16) for _ in range(3)]
    out = gather(parts, CPU)
    assert out.dtype == torch.bfloat16 and out.shape == (6, 2)


def test_weighted_split_plan_is_proportional() -> None:
    for rows, weights in [(30, [2, 1, 1]), (31, [1, 1, 1]), (10, [3, 0, 1]), (7, [0.5, 0.25, 0.25])]:
        split = Split(len(weights), weights=weights)
        plan = split.plan(rows)
        sizes = dict(plan)
        assert sum(sizes.values()) == rows
        for slot, w in enumerate(weights):
            exact = rows * w / sum(weights)
            assert abs(sizes.get(slot, 0) - exact) < 1
            if w == 0:
                assert slot not in sizes
        assert all(math.isfinite(s) and s > 0 for s in sizes.values())


def test_gather_warning_is_only_for_dim_0() -> None:
    parts = [torch.randn(2, 2), torch.randn(2, 2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gather(parts, CPU)  # no warning for ordinary tensors


def test_split_plans_are_made_once_per_batch_size_and_follow_new_sizes() -> None:
    split = Split(3)
    first = split.plan(10)
    assert split.plan(10) is first and first == [(0, 4), (1, 4), (2, 2)]
    assert split.plan(6) == [(0, 2), (1, 2), (2, 2)]
    split.chunk_sizes = [1, 1, 8]  # a new explicit split on the same object
    assert split.plan(10) == [(0, 1), (1, 1), (2, 8)]
