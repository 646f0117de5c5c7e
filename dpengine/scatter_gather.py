"""Scatter inputs to replicas and gather their outputs, with torch.nn.parallel's rules.

Differences from torch, on purpose:
- args and kwargs are scattered together, so a replica never ends up with kwargs
  but no positional inputs (torch's `scatter_kwargs` padding bug);
- tensors that would split into different numbers of chunks raise instead of
  being zipped to the shortest (torch silently drops rows there);
- explicit or weighted chunk sizes, besides torch's even `tensor.chunk` rule.
On virtual CPU devices `split` and `cat` are the differentiable scatter and gather (a chunk
copied where torch's copy would change its layout); on CUDA torch's own `Scatter`/`Gather`
autograd functions do the copies.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.nn.parallel._functions import Gather as _CudaGather
from torch.nn.parallel._functions import Scatter as _CudaScatter


class Split:
    """How a batch is cut: torch's even rule, explicit sizes, or weights per device."""

    def __init__(
        self,
        device_count: int,
        chunk_sizes: Sequence[int] | None = None,
        weights: Sequence[float] | None = None,
    ) -> None:
        if chunk_sizes is not None and weights is not None:
            raise ValueError("give either chunk_sizes or weights, not both")
        if chunk_sizes is not None:
            chunk_sizes = [int(s) for s in chunk_sizes]
            if len(chunk_sizes) != device_count or any(s < 0 for s in chunk_sizes):
                raise ValueError(
                    f"chunk_sizes {chunk_sizes} must hold one non-negative size per device "
                    f"({device_count} devices)"
                )
        if weights is not None:
            weights = [float(w) for w in weights]
            if len(weights) != device_count or any(not w >= 0 for w in weights) or sum(weights) <= 0:
                raise ValueError(
                    f"weights {weights} must hold one non-negative weight per device "
                    f"({device_count} devices), not all zero"
                )
        self.device_count = device_count
        self.chunk_sizes = chunk_sizes
        self.weights = weights
        # Plans by batch size, for the chunk_sizes and weights they were made from.
        self._plans: dict[int, list[tuple[int, int]]] = {}
        self._planned_for: tuple[Any, Any] = (chunk_sizes, weights)

    # A dataset's last batch adds a size; the cap keeps an ever-changing size from growing it.
    MAX_CACHED_PLANS = 64

    def plan(self, rows: int) -> list[tuple[int, int]]:
        """(device slot, rows) for each replica that gets a chunk, in slot order (do not change it)."""
        if self._planned_for[0] is not self.chunk_sizes or self._planned_for[1] is not self.weights:
            self._plans.clear()  # someone set new sizes or weights on this Split
            self._planned_for = (self.chunk_sizes, self.weights)
        plan = self._plans.get(rows)
        if plan is None:
            plan = self._plan(rows)
            if len(self._plans) >= self.MAX_CACHED_PLANS:
                self._plans.clear()
            self._plans[rows] = plan
        return plan

    def _plan(self, rows: int) -> list[tuple[int, int]]:
        if self.chunk_sizes is not None:
            if sum(self.chunk_sizes) != rows:
                raise ValueError(
                    f"chunk_sizes {self.chunk_sizes} sum to {sum(self.chunk_sizes)}, "
                    f"but the batch has {rows} rows"
                )
            sizes = self.chunk_sizes
        elif self.weights is not None:
            sizes = weighted_sizes(rows, self.weights)
        else:
            return list(enumerate(even_sizes(rows, self.device_count)))
        plan = [(slot, size) for slot, size in enumerate(sizes) if size > 0]
        if not plan:
            # An empty batch: like torch.chunk, every device that takes part gets an empty chunk.
            taking_part = self.weights if self.weights is not None else [1] * self.device_count
            plan = [(slot, 0) for slot, weight in enumerate(taking_part) if weight > 0]
        return plan


def even_sizes(rows: int, count: int) -> list[int]:
    """torch.chunk's rule: ceil(rows/count) each, the last the rest; fewer chunks can come back."""
    if rows == 0:
        return [0] * count
    per_chunk = math.ceil(rows / count)
    full, rest = divmod(rows, per_chunk)
    return [per_chunk] * full + ([rest] if rest else [])


def weighted_sizes(rows: int, weights: Sequence[float]) -> list[int]:
    """Rows in proportion to weights, rounded by largest remainder (ties to the lower slot)."""
    total = sum(weights)
    exact = [rows * w / total for w in weights]
    sizes = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - sizes[i]), i))
    for i in by_remainder[: rows - sum(sizes)]:
        sizes[i] += 1
    return sizes


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields")


def _tensors_in(obj: Any) -> list[torch.Tensor]:
    """The tensors scatter will split, in the order the builder meets them."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)) and len(obj) > 0:
        return [t for item in obj for t in _tensors_in(item)]
    if isinstance(obj, dict) and len(obj) > 0:
        return [t for value in obj.values() for t in _tensors_in(value)]
    return []


def _split_tensor(
    tensor: torch.Tensor, plan: list[tuple[int, int]], devices: Sequence[torch.device], dim: int
) -> tuple[torch.Tensor, ...]:
    sizes = [size for _, size in plan]
    if devices[0].type == "cuda":
        targets = [devices[slot].index for slot, _ in plan]
        return _CudaScatter.apply(targets, sizes, dim, tensor)
    chunks = tensor.split(sizes, dim)
    # torch's scatter copies a chunk to each device other than the batch's (`.to(device)`,
    # preserve_format: a dense layout is kept, any other made contiguous): only device 0's
    # chunk can be a strided view there (so `.view(-1)` of a dim-1 chunk works on the others).
    # The batch is on device 0 here; dense chunks (dim 0's) already have the copy's layout.
    return tuple([
        chunk if slot == 0 or chunk.is_contiguous() or _dense(chunk)
        else chunk.clone(memory_format=torch.preserve_format)  # what .to() makes of it
        for (slot, _), chunk in zip(plan, chunks)
    ])


def _dense(tensor: torch.Tensor) -> bool:
    """Whether its elements fill its span without gaps or overlap (torch's non-overlapping-and-dense)."""
    if tensor.is_contiguous(memory_format=torch.channels_last):
        return True
    expected = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride()), key=lambda pair: pair[1]):
        if size != 1:
            if stride != expected:
                return False
            expected *= size
    return True


def _build(obj: Any, chunks: Iterator, count: int) -> list:
    """Per-replica copies of obj's structure, taking tensor chunks from `chunks` in order."""
    if isinstance(obj, torch.Tensor):
        return list(next(chunks))
    if _is_namedtuple(obj):
        return [type(obj)(*fields) for fields in zip(*(_build(f, chunks, count) for f in obj))]
    if isinstance(obj, tuple) and len(obj) > 0:
        return [tuple(items) for items in zip(*(_build(x, chunks, count) for x in obj))]
    if isinstance(obj, list) and len(obj) > 0:
        return [list(items) for items in zip(*(_build(x, chunks, count) for x in obj))]
    if isinstance(obj, dict) and len(obj) > 0:
        values = [_build(v, chunks, count) for v in obj.values()]
        return [type(obj)(zip(obj.keys(), vals)) for vals in zip(*values)]
    # Not split: every replica gets the same object (torch's rule, floats, strings, None...).
    return [obj] * count


def _row_count(tensor: torch.Tensor, dim: int) -> int:
    if tensor.dim() == 0:
        raise ValueError(
            f"cannot scatter a 0-dim tensor along dim {dim}: pass a batch with at least one dimension"
        )
    return tensor.size(dim)


def scatter_kwargs(
    inputs: tuple,
    kwargs: dict[str, Any],
    devices: Sequence[torch.device],
    split: Split,
    dim: int = 0,
) -> tuple[list[tuple], list[dict[str, Any]], list[int]]:
    """Split args and kwargs together; returns per-replica args, kwargs and device slots."""
    inputs = tuple(inputs)
    kwargs = dict(kwargs or {})
    tensors = _tensors_in((inputs, kwargs))
    if not tensors:
        # torch: no inputs at all run once on the first device; other objects go to every device.
        count = 1 if not inputs and not kwargs else len(devices)
        return [inputs] * count, [kwargs] * count, list(range(count))
    plan, chunks = _split_all(tensors, devices, split, dim)
    per_replica = _build((inputs, kwargs), iter(chunks), len(plan))
    return (
        [args for args, _ in per_replica],
        [kw for _, kw in per_replica],
        [slot for slot, _ in plan],
    )


def scatter(inputs: Any, target_gpus: Sequence[torch.device], dim: int = 0) -> Any:
    """torch.nn.parallel.scatter: one piece of `inputs` per device (a tuple of chunks for a tensor).

    Devices that would get no rows get no piece, as with torch.chunk.
    """
    tensors = _tensors_in(inputs)
    if not tensors:
        return [inputs] * len(target_gpus)
    _, chunks = _split_all(tensors, target_gpus, Split(len(target_gpus)), dim)
    if isinstance(inputs, torch.Tensor):
        return tuple(chunks[0])
    return _build(inputs, iter(chunks), len(chunks[0]))


def _split_all(
    tensors: list[torch.Tensor], devices: Sequence[torch.device], split: Split, dim: int
) -> tuple[list[tuple[int, int]], list[tuple[torch.Tensor, ...]]]:
    """The plan of the first tensor, and every tensor cut into that many chunks."""
    rows = [_row_count(tensor, dim) for tensor in tensors]
    plan = split.plan(rows[0])
    for tensor in tensors[1:]:
        other = split.plan(tensor.size(dim)) if tensor.size(dim) != rows[0] else plan
        if [slot for slot, _ in other] != [slot for slot, _ in plan]:
            raise ValueError(
                f"inputs disagree on the batch along dim {dim}: one tensor of "
                f"{tensors[0].size(dim)} rows splits into {len(plan)} chunks, another of "
                f"{tensor.size(dim)} rows into {len(other)}; torch would silently drop rows here, "
                f"so give every scattered tensor the same batch size"
            )
    chunks = []
    for tensor in tensors:
        tensor_plan = plan if tensor.size(dim) == rows[0] else split.plan(tensor.size(dim))
        chunks.append(_split_tensor(tensor, tensor_plan, devices, dim))
    return plan, chunks


_SCALAR_WARNING = (
    "Was asked to gather along dimension 0, but all input tensors were scalars; "
    "will instead unsqueeze and return a vector."
)


def _gather_tensors(outputs: Sequence[torch.Tensor], target: torch.device, dim: int) -> torch.Tensor:
    if target.type == "cpu" and all(o.device.type == "cpu" for o in outputs):
        if dim == 0 and all(o.dim() == 0 for o in outputs):
            warnings.warn(_SCALAR_WARNING)
            outputs = [o.view(1) for o in outputs]
        return torch.cat(list(outputs), dim)
    # torch's Gather takes the string "cpu" for a CPU target (a torch.device("cpu") fails there).
    return _CudaGather.apply("cpu" if target.type == "cpu" else target, dim, *outputs)


def gather(outputs: Sequence[Any], target: torch.device, dim: int = 0) -> Any:
    """Concatenate replica outputs on `target`, keeping their structure (torch's gather_map)."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return _gather_tensors(outputs, target, dim)
    if first is None:
        return None
    if isinstance(first, dict):
        if not all(len(first) == len(o) for o in outputs):
            raise ValueError("All dicts must have the same number of keys")
        return type(first)((k, gather([o[k] for o in outputs], target, dim)) for k in first)
    if _is_namedtuple(first):
        return type(first)._make(gather(items, target, dim) for items in zip(*outputs, strict=True))
    if isinstance(first, (tuple, list)):
        return type(first)(gather(items, target, dim) for items in zip(*outputs, strict=True))
    raise TypeError(
        f"cannot gather replica outputs of type {type(first).__name__}: "
        "return tensors, or tuples, lists, dicts or namedtuples of them"
    )
