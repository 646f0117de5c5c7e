"""What to train: a model, its dataset, its loss and how to optimise it.

Three ways to get a `Workload`:

- `builtin_workload("seed" | "mlp" | "cnn", seed)`: synthetic, deterministic per seed.
- `load_workload(TARGET, DATASET_TARGET, seed)`: user code named as
  `package.module:factory` or `path/to/file.py:factory`.
- Build one directly: `Workload(name, model, dataset, loss_fn, ...)`.

`check_workload` then runs two items through the model and the loss, so that a
mismatch is one clear `WorkloadError` line before training starts, not a
traceback from inside a replica.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.machinery
import importlib.util
import inspect
import itertools
import re
import sys
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn import Parameter
from torch.utils.data import Dataset, IterableDataset, TensorDataset, default_collate

from .failures import error_line, one_line

LossFn = Callable[[Tensor, Tensor], Tensor]
OptimizerFactory = Callable[[Iterable[Parameter], float], torch.optim.Optimizer]

BUILTIN_WORKLOADS: tuple[str, ...] = ("seed", "mlp", "cnn")

_TARGET_FORMS = "expected package.module:factory or path/file.py:factory"


class WorkloadError(ValueError):
    """A workload that cannot be built or does not fit together; always one line."""

    def __init__(self, message: str) -> None:
        super().__init__(one_line(message))


@dataclass(frozen=True, eq=False)
class Workload:
    """A model with the data and loss to train it. Items of `dataset` are (input, target) pairs.

    Frozen so that a workload handed to the engine cannot be re-pointed under it;
    the model's weights of course still train in place.
    """

    name: str
    model: nn.Module
    dataset: Dataset  # map-style: __len__ and __getitem__
    loss_fn: LossFn
    optimizer_factory: OptimizerFactory | None = None  # (params, lr) -> optimizer; None: SGD
    batch_size: int = 32  # default global batch
    lr: float = 0.01  # default learning rate

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise WorkloadError(f"Workload.model must be an nn.Module, got {_kind(self.model)}")
        if not _is_map_style(self.dataset):
            raise WorkloadError(
                f"Workload.dataset must be a map-style Dataset (with __len__ and __getitem__), "
                f"got {_kind(self.dataset)}"
            )
        if not callable(self.loss_fn):
            raise WorkloadError(f"Workload.loss_fn must be callable, got {_kind(self.loss_fn)}")
        if self.optimizer_factory is not None and not callable(self.optimizer_factory):
            raise WorkloadError(
                f"Workload.optimizer_factory must be None or callable(params, lr), "
                f"got {_kind(self.optimizer_factory)}"
            )
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise WorkloadError(f"Workload.batch_size must be a positive int, got {self.batch_size!r}")
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not self.lr > 0:
            raise WorkloadError(f"Workload.lr must be a positive number, got {self.lr!r}")

    def make_optimizer(self, lr: float | None = None) -> torch.optim.Optimizer:
        """The optimizer over the model's parameters, at `lr` or the workload's default."""
        lr = self.lr if lr is None else lr
        if self.optimizer_factory is None:
            return torch.optim.SGD(self.model.parameters(), lr=lr)
        return self.optimizer_factory(self.model.parameters(), lr)


# --- built-in workloads --------------------------------------------------------------------------


def builtin_workload(name: str, seed: int = 0) -> Workload:
    """A synthetic workload: same seed, same data and initial weights; the global RNG is left alone.

    - `seed`: the torch DataParallel tutorial's Linear(5, 2) on 100 random samples, regressing
      a hidden linear map (MSE, plain SGD, batch 30, so 4 steps an epoch).
    - `mlp`: 4096 x 512 features, MLP 512-2048-2048-10, 10 classes (cross-entropy, batch 256).
    - `cnn`: 2048 random 3x32x32 images, two conv-bn-relu blocks, pool, linear (batch 128).

    `mlp` and `cnn` train with SGD with momentum 0.9: plain SGD needs many epochs to leave
    chance level on them.
    """
    spec = _BUILTINS.get(name)
    if spec is None:
        expected = ", ".join(BUILTIN_WORKLOADS)
        raise WorkloadError(f"unknown builtin workload {name!r}; expected one of {expected}")
    gen = torch.Generator().manual_seed(seed)
    x, y = spec.data(gen)
    # The weights get their own seed, drawn after the data: seeding them with `seed` itself
    # would replay the very random stream the data came from.
    model_seed = int(torch.randint(2**62, (1,), generator=gen))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(model_seed)
        model = spec.model()
    return Workload(
        name=name,
        model=model,
        dataset=TensorDataset(x, y),
        loss_fn=spec.loss,
        optimizer_factory=spec.optimizer,
        batch_size=spec.batch_size,
        lr=spec.lr,
    )


@dataclass(frozen=True)
class _Builtin:
    data: Callable[[torch.Generator], tuple[Tensor, Tensor]]
    model: Callable[[], nn.Module]
    loss: LossFn
    optimizer: OptimizerFactory | None
    batch_size: int
    lr: float


def _seed_data(gen: torch.Generator) -> tuple[Tensor, Tensor]:
    x = torch.randn(100, 5, generator=gen)
    weight = torch.randn(5, 2, generator=gen)
    bias = torch.randn(2, generator=gen)
    return x, x @ weight + bias + 0.1 * torch.randn(100, 2, generator=gen)


def _seed_model() -> nn.Module:
    return nn.Linear(5, 2)


def _mlp_data(gen: torch.Generator) -> tuple[Tensor, Tensor]:
    x = torch.randn(4096, 512, generator=gen)
    # Labels are the argmax of a hidden linear map, so the task is learnable.
    return x, (x @ torch.randn(512, 10, generator=gen)).argmax(dim=1)


def _mlp_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10)
    )


def _cnn_data(gen: torch.Generator) -> tuple[Tensor, Tensor]:
    x = torch.randn(2048, 3, 32, 32, generator=gen)
    # Labels are a hidden linear map of the 8x8 patch means, which the net's pooling can find.
    patches = F.avg_pool2d(x, 8).flatten(1)
    return x, (patches @ torch.randn(patches.shape[1], 10, generator=gen)).argmax(dim=1)


def _cnn_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AvgPool2d(8), nn.Flatten(), nn.Linear(32 * 4 * 4, 10),
    )  # fmt: skip


def _sgd_momentum(params: Iterable[Parameter], lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


_BUILTINS: dict[str, _Builtin] = {
    # lr 0.05: the loss drops by a quarter or more in the first epoch and still falls at epoch 10.
    "seed": _Builtin(_seed_data, _seed_model, F.mse_loss, None, batch_size=30, lr=0.05),
    "mlp": _Builtin(_mlp_data, _mlp_model, F.cross_entropy, _sgd_momentum, batch_size=256, lr=0.03),
    "cnn": _Builtin(_cnn_data, _cnn_model, F.cross_entropy, _sgd_momentum, batch_size=128, lr=0.03),
}


# --- user workloads --------------------------------------------------------------------------------


def load_workload(model_target: str, dataset_target: str | None = None, seed: int = 0) -> Workload:
    """Build a workload from a builtin name or user code.

    `model_target` is a builtin name (`seed`, `mlp`, `cnn`) or a TARGET: `package.module:factory`,
    or `path/to/file.py:factory` (a path when the part before the last colon ends in `.py` or
    contains a slash; the file's folder need not be on sys.path). The factory is called with
    no arguments, plus `seed=seed` if it takes a `seed` parameter, and returns a `Workload` or
    a bare `nn.Module`.

    `dataset_target` names a factory, called the same way, that returns a map-style Dataset or
    an `(inputs, targets)` pair of tensors; it replaces the workload's dataset. It is required
    when the model factory returns a bare module. A bare module trains with cross-entropy when
    the targets are integer-typed (int tensors or Python ints), else with MSE; with SGD, batch
    32, lr 0.01 (the `Workload` defaults).

    Every failure is a one-line `WorkloadError`. Call `check_workload` next to try a batch.
    """
    if model_target in BUILTIN_WORKLOADS:
        made: Any = builtin_workload(model_target, seed)
    elif ":" not in model_target:
        raise WorkloadError(
            f"bad model target {model_target!r}: expected a builtin ({', '.join(BUILTIN_WORKLOADS)}), "
            f"package.module:factory or path/file.py:factory"
        )
    else:
        made = _call_target(model_target, seed)
        if not isinstance(made, (Workload, nn.Module)):
            raise WorkloadError(f"{model_target} returned {_kind(made)}; expected an nn.Module or a Workload")

    if isinstance(made, Workload):
        if dataset_target is None:
            _require_items(made.dataset, model_target)
            return made
        return replace(made, dataset=_load_dataset(dataset_target, seed))

    if dataset_target is None:
        raise WorkloadError(
            f"{model_target} returned a bare nn.Module, so a dataset is needed: give a dataset target "
            f"(--dataset package.module:factory or path/file.py:factory) or return a Workload"
        )
    dataset = _load_dataset(dataset_target, seed)
    _, target = _item(dataset, 0, dataset_target)
    return Workload(name=model_target, model=made, dataset=dataset, loss_fn=_default_loss(target))


def _load_dataset(target: str, seed: int) -> Dataset:
    made = _call_target(target, seed)
    if isinstance(made, (tuple, list)) and len(made) == 2 and all(isinstance(t, Tensor) for t in made):
        inputs, targets = made
        if inputs.dim() == 0 or targets.dim() == 0 or len(inputs) != len(targets):
            raise WorkloadError(
                f"{target} returned tensors of shapes {_shape(inputs)} and {_shape(targets)}; "
                f"expected (inputs, targets) with the same number of rows"
            )
        made = TensorDataset(inputs, targets)
    elif not _is_map_style(made):
        raise WorkloadError(
            f"{target} returned {_kind(made)}; expected a map-style Dataset (with __len__ and "
            f"__getitem__) or an (inputs, targets) pair of tensors"
        )
    _require_items(made, target)
    return made


def _is_map_style(value: Any) -> bool:
    # Strings and tuples are sized and indexable too, but a tuple here is most likely an
    # (inputs, targets) pair passed where a Dataset belongs.
    indexable = hasattr(value, "__len__") and hasattr(value, "__getitem__")
    return indexable and not isinstance(value, (IterableDataset, str, bytes, tuple))


def _require_items(dataset: Dataset, source: str) -> None:
    if len(dataset) == 0:  # type: ignore[arg-type]
        raise WorkloadError(f"the dataset from {source} is empty; expected at least one (input, target) item")


def _default_loss(target: Any) -> LossFn:
    integer = isinstance(target, int) or (
        isinstance(target, Tensor) and not (target.is_floating_point() or target.is_complex())
    )
    return F.cross_entropy if integer else F.mse_loss


# --- resolving a TARGET ----------------------------------------------------------------------------

_module_ids = itertools.count()
_SEED_KINDS = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _call_target(target: str, seed: int) -> Any:
    """Import what `target` names, check it is a factory and call it."""
    where, _, attr = target.rpartition(":")
    if not where or not attr.isidentifier():
        raise WorkloadError(f"bad target {target!r}: {_TARGET_FORMS}")
    if where.endswith(".py") or "/" in where or "\\" in where:
        module = _import_file(where)
    elif all(part.isidentifier() for part in where.split(".")):
        module = _import_module(where)
    else:
        raise WorkloadError(f"bad target {target!r}: {_TARGET_FORMS}")

    if not hasattr(module, attr):
        raise WorkloadError(f"{where} has no attribute {attr!r}; {_callables_hint(module, attr)}")
    factory = getattr(module, attr)
    if not callable(factory):
        raise WorkloadError(f"{target} is {_kind(factory)}, not callable; expected a factory function")

    kwargs: dict[str, Any] = {}
    try:
        params = dict(inspect.signature(factory).parameters)
    except (TypeError, ValueError):  # some builtins and C callables have no signature
        params = {}
    seed_param = params.get("seed")
    if seed_param is not None and seed_param.kind in _SEED_KINDS:
        kwargs["seed"] = seed
    required = [
        name for name, p in params.items()
        if name not in kwargs and p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]  # fmt: skip
    if required:
        raise WorkloadError(
            f"{target} needs arguments ({', '.join(required)}); expected a factory callable with no "
            f"arguments (or only seed)"
        )
    try:
        return factory(**kwargs)
    except (Exception, SystemExit) as exc:  # user code: report it, never crash the caller
        raise WorkloadError(f"{target} raised {error_line(exc)}") from exc


def _import_file(path: str) -> ModuleType:
    file = Path(path)
    if not file.is_file():
        raise WorkloadError(f"file not found: {path}" if not file.exists() else f"not a file: {path}")
    # A fresh, unique name per load: files of the same stem must not shadow each other in
    # sys.modules, and registering it there is what dataclasses and pickling expect.
    stem = re.sub(r"\W", "_", file.stem)
    name = f"dptui_user_{next(_module_ids)}_{stem}"
    loader = importlib.machinery.SourceFileLoader(name, str(file))
    spec = importlib.util.spec_from_file_location(name, file, loader=loader)
    assert spec is not None  # an explicit loader always gives a spec
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        loader.exec_module(module)
    except SyntaxError as exc:
        del sys.modules[name]
        raise WorkloadError(_syntax_error(exc, path, file)) from exc
    except (Exception, SystemExit) as exc:
        del sys.modules[name]
        raise WorkloadError(f"importing {path} raised {error_line(exc)}") from exc
    return module


def _import_module(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (name == exc.name or name.startswith(exc.name + ".")):
            raise WorkloadError(
                f"module {name!r} not found; install it, run from the folder that holds it, "
                f"or name a file: path/file.py:factory"
            ) from exc
        raise WorkloadError(f"importing module {name!r} raised {error_line(exc)}") from exc
    except SyntaxError as exc:
        raise WorkloadError(_syntax_error(exc, name, None)) from exc
    except (Exception, SystemExit) as exc:
        raise WorkloadError(f"importing module {name!r} raised {error_line(exc)}") from exc


def _syntax_error(exc: SyntaxError, shown: str, file: Path | None) -> str:
    where = exc.filename or shown
    # Say the path as the user wrote it when the error is in that very file.
    if file is not None and exc.filename and Path(exc.filename).resolve() == file.resolve():
        where = shown
    return f"{where} line {exc.lineno}: {exc.msg}"


def _callables_hint(module: ModuleType, wanted: str) -> str:
    # Its own public functions and classes, not what it imported.
    here = module.__name__
    own = sorted(
        name
        for name, value in vars(module).items()
        if callable(value) and not name.startswith("_") and getattr(value, "__module__", "") == here
    )
    if not own:
        return "it defines no public callables"
    close = difflib.get_close_matches(wanted, own, n=1)
    shown = ", ".join(own[:8]) + (", ..." if len(own) > 8 else "")
    return (f"did you mean {close[0]}? " if close else "") + f"callables there: {shown}"


# --- checking that it fits -------------------------------------------------------------------------


def check_workload(workload: Workload, batch: int = 2) -> None:
    """Run the model and the loss on the first `batch` items; raise WorkloadError if they do not fit.

    The model runs under no_grad in eval mode (so BatchNorm running stats stay as they were);
    each submodule's training flag is restored afterwards. Inputs go to the model's device.
    """
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    dataset, model = workload.dataset, workload.model
    count = min(batch, len(dataset))  # type: ignore[arg-type]
    if count == 0:
        raise WorkloadError(f"the dataset of {workload.name} is empty; expected at least one item")
    items = [_item(dataset, i, workload.name) for i in range(count)]
    try:
        inputs, targets = default_collate(items)
    except Exception as exc:
        raise WorkloadError(f"the first {count} dataset items cannot be batched: {error_line(exc)}") from exc

    device = next(itertools.chain(model.parameters(), model.buffers()), torch.empty(0)).device
    inputs, targets = _to(inputs, device), _to(targets, device)
    flags = [(m, m.training) for m in model.modules()]
    try:
        with torch.no_grad():
            model.eval()
            try:
                output = model(inputs)
            except Exception as exc:
                raise WorkloadError(
                    f"dataset items of shape {_shape(items[0][0])} do not fit the model: "
                    f"{error_line(exc, with_type=False)}"
                ) from exc
            with warnings.catch_warnings():
                # A loss that only warns (MSE broadcasting (N, 1) against (N,)) would train on
                # nonsense, so its warnings count as a misfit here.
                warnings.simplefilter("error", UserWarning)
                try:
                    loss = workload.loss_fn(output, targets)
                except Exception as exc:
                    raise WorkloadError(
                        f"the loss does not accept model output of shape {_shape(output)} "
                        f"and targets of shape {_shape(targets)}: {error_line(exc, with_type=False)}"
                    ) from exc
    finally:
        for module, training in flags:
            module.training = training
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise WorkloadError(f"the loss returned {_kind(loss)}; expected a single-element tensor")


def _item(dataset: Dataset, index: int, source: str) -> tuple[Any, Any]:
    try:
        item = dataset[index]
    except Exception as exc:
        raise WorkloadError(f"reading item {index} of the dataset from {source} raised {error_line(exc)}") from exc
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise WorkloadError(
            f"item {index} of the dataset from {source} is {_kind(item)}; expected an (input, target) pair"
        )
    return item[0], item[1]


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    return value


def _shape(value: Any) -> str:
    """A tensor's shape as a tuple, `(7,)`, else what the value is."""
    if isinstance(value, Tensor):
        return str(tuple(value.shape))
    return _kind(value)


def _kind(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    name = type(value).__name__
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"
