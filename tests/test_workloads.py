"""Workloads: builtins, user targets (file and module), their errors, and check_workload."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from dpengine.run.workloads import (
    BUILTIN_WORKLOADS,
    Workload,
    WorkloadError,
    builtin_workload,
    check_workload,
    load_workload,
)

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
FIXTURE_FILE = FIXTURES / "workload_fixtures.py"
EXAMPLE = ROOT / "examples" / "custom_workload.py"


def fixture(factory: str) -> str:
    return f"{FIXTURE_FILE}:{factory}"


def load_error(model: str, dataset: str | None = None) -> str:
    with pytest.raises(WorkloadError) as info:
        load_workload(model, dataset)
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    return message


# --- builtins ------------------------------------------------------------------------------------

SHAPES = {  # name: (items, input shape, target shape, target dtype, output shape of one item, batch)
    "seed": (100, (5,), (2,), torch.float32, (2,), 30),
    "mlp": (4096, (512,), (), torch.int64, (10,), 256),
    "cnn": (2048, (3, 32, 32), (), torch.int64, (10,), 128),
}


@pytest.mark.parametrize("name", BUILTIN_WORKLOADS)
def test_builtin_shapes_and_batch(name: str) -> None:
    items, input_shape, target_shape, target_dtype, output_shape, batch = SHAPES[name]
    workload = builtin_workload(name)
    x, y = workload.dataset[0]
    assert workload.name == name
    assert isinstance(workload.dataset, TensorDataset) and len(workload.dataset) == items
    assert (x.shape, y.shape, y.dtype) == (input_shape, target_shape, target_dtype)
    assert workload.batch_size == batch and workload.lr > 0
    with torch.no_grad():
        assert workload.model(x.unsqueeze(0)).shape == (1, *output_shape)
    check_workload(workload)


def test_builtin_classes_are_all_present() -> None:
    for name in ("mlp", "cnn"):
        labels = builtin_workload(name).dataset.tensors[1]
        assert labels.bincount(minlength=10).min() > len(labels) // 50


def test_builtin_optimizers() -> None:
    seed = builtin_workload("seed").make_optimizer()
    assert type(seed) is torch.optim.SGD and seed.defaults["momentum"] == 0
    mlp = builtin_workload("mlp").make_optimizer(lr=0.5)
    assert mlp.defaults["momentum"] == 0.9 and mlp.param_groups[0]["lr"] == 0.5


@pytest.mark.parametrize("name", BUILTIN_WORKLOADS)
def test_builtin_is_deterministic_per_seed(name: str) -> None:
    a, b, c = builtin_workload(name, seed=1), builtin_workload(name, seed=1), builtin_workload(name, seed=2)
    for left, right in zip(a.dataset.tensors, b.dataset.tensors):
        assert torch.equal(left, right)
    for key, value in a.model.state_dict().items():
        assert torch.equal(value, b.model.state_dict()[key])
    assert not torch.equal(a.dataset.tensors[0], c.dataset.tensors[0])
    assert not torch.equal(a.dataset.tensors[1], c.dataset.tensors[1])
    first_weight = next(iter(a.model.parameters()))
    assert not torch.equal(first_weight, next(iter(c.model.parameters())))


def test_builtin_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    state = torch.get_rng_state()
    for name in BUILTIN_WORKLOADS:
        builtin_workload(name, seed=7)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_seed_loss_falls_with_plain_sgd(seed: int) -> None:
    workload = builtin_workload("seed", seed)
    optimizer = workload.make_optimizer()
    x, y = workload.dataset.tensors
    losses = [F.mse_loss(workload.model(x), y).item()]
    for _ in range(10):
        batches = DataLoader(workload.dataset, batch_size=workload.batch_size)
        assert len(batches) == 4
        for inputs, targets in batches:
            loss = workload.loss_fn(workload.model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            losses.append(F.mse_loss(workload.model(x), y).item())
    assert losses[1] < 0.8 * losses[0]  # visibly, within the first epoch
    assert all(after < before for before, after in zip(losses, losses[1:]))


def test_unknown_builtin() -> None:
    expected = "unknown builtin workload 'resnet'; expected one of seed, mlp, cnn$"
    with pytest.raises(WorkloadError, match=expected):
        builtin_workload("resnet")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(model="not a module"), "Workload.model must be an nn.Module, got a str"),
        (dict(dataset=(torch.zeros(2, 5), torch.zeros(2, 2))), "Workload.dataset must be a map-style"),
        (dict(loss_fn=None), "Workload.loss_fn must be callable, got None"),
        (dict(batch_size=0), "Workload.batch_size must be a positive int, got 0"),
        (dict(lr=-1.0), "Workload.lr must be a positive number, got -1.0"),
    ],
)
def test_workload_validates_fields(change: dict, message: str) -> None:
    dataset = TensorDataset(torch.zeros(2, 5))
    fields = dict(name="w", model=nn.Linear(5, 2), dataset=dataset, loss_fn=F.mse_loss)
    with pytest.raises(WorkloadError, match=message.replace("(", r"\(")):
        Workload(**(fields | change))


def test_workload_rejects_iterable_dataset() -> None:
    class Stream(IterableDataset):
        def __iter__(self):
            yield torch.zeros(5), torch.zeros(2)

    with pytest.raises(WorkloadError, match="got a Stream"):
        Workload("w", nn.Linear(5, 2), Stream(), F.mse_loss)


# --- user workloads ------------------------------------------------------------------------------


def test_load_builtin_by_name() -> None:
    workload = load_workload("seed", seed=3)
    assert torch.equal(workload.dataset.tensors[0], builtin_workload("seed", 3).dataset.tensors[0])


def test_load_workload_from_file() -> None:
    workload = load_workload(fixture("make_workload"))
    assert (workload.name, workload.batch_size, workload.lr) == ("fixture", 8, 1e-3)
    assert workload.loss_fn is F.l1_loss
    assert isinstance(workload.make_optimizer(), torch.optim.Adam)
    check_workload(workload)
    assert str(FIXTURES) not in sys.path


def test_load_passes_seed_to_factories_that_take_it() -> None:
    a, b = load_workload(fixture("make_workload"), seed=1), load_workload(fixture("make_workload"), seed=2)
    assert not torch.equal(a.dataset.tensors[0], b.dataset.tensors[0])
    c = load_workload(fixture("make_model"), fixture("make_classes"), seed=1)
    assert torch.equal(a.dataset.tensors[0], c.dataset.tensors[0])


def test_load_workload_from_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(FIXTURES))
    workload = load_workload("workload_fixtures:make_workload")
    assert workload.name == "fixture"
    bare = load_workload("workload_fixtures:make_model", "workload_fixtures:make_classes")
    assert isinstance(bare.model, nn.Linear) and len(bare.dataset) == 40


def test_relative_path_target(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(FIXTURES.parent)
    assert load_workload("fixtures/workload_fixtures.py:make_workload").name == "fixture"


def test_bare_module_loss_follows_target_dtype() -> None:
    classes = load_workload(fixture("make_model"), fixture("make_classes"))
    values = load_workload(fixture("make_model"), fixture("make_values"))
    assert classes.loss_fn is F.cross_entropy and values.loss_fn is F.mse_loss
    assert classes.name == fixture("make_model")
    assert isinstance(classes.make_optimizer(), torch.optim.SGD) and classes.batch_size == 32
    check_workload(classes)
    check_workload(values)


def test_dataset_target_overrides_workload_dataset() -> None:
    workload = load_workload(fixture("make_workload"), fixture("make_values"))
    assert workload.name == "fixture" and workload.loss_fn is F.l1_loss
    assert workload.dataset.tensors[1].shape == (40, 2)
    assert load_workload("seed", fixture("make_classes")).dataset.tensors[1].dtype == torch.int64


def test_example_loads_in_both_forms() -> None:
    whole = load_workload(f"{EXAMPLE}:make_workload")
    assert isinstance(whole.make_optimizer(), torch.optim.Adam)
    check_workload(whole)
    split = load_workload(f"{EXAMPLE}:make_model", f"{EXAMPLE}:make_dataset")
    assert split.loss_fn is F.mse_loss
    check_workload(split)


def test_example_runs_standalone(capsys: pytest.CaptureFixture[str]) -> None:
    with torch.random.fork_rng(devices=[]):  # the example seeds the global RNG
        runpy.run_path(str(EXAMPLE), run_name="__main__")
    losses = [float(line.split()[-1]) for line in capsys.readouterr().out.splitlines()]
    assert len(losses) == 3 and losses[-1] < losses[0]


# --- errors: one line each -----------------------------------------------------------------------


@pytest.fixture
def user_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """examples/*.py under a temporary working directory, so targets can be relative."""
    monkeypatch.chdir(tmp_path)
    examples = tmp_path / "examples"
    examples.mkdir()
    (examples / "bad.py").write_text("import torch\n\nx = = 1\n")
    (examples / "raising.py").write_text('raise RuntimeError("broken at import\\nsecond line")\n')
    (examples / "exits.py").write_text("import sys\nsys.exit(2)\n")
    (examples / "missing_dep.py").write_text("import no_such_dependency_xyz\n")
    return examples


def test_target_without_colon() -> None:
    message = load_error("my_model")
    assert "expected a builtin (seed, mlp, cnn), package.module:factory or path/file.py:factory" in message
    assert "expected package.module:factory or path/file.py:factory" in load_error("seed", "my_data")
    assert "bad target 'examples/x.py:'" in load_error("examples/x.py:")


def test_module_not_found() -> None:
    message = load_error("no_such_module_xyz.models:make")
    assert message.startswith("module 'no_such_module_xyz.models' not found; install it, run from the folder")


def test_file_not_found(user_files: Path) -> None:
    assert load_error("examples/nope.py:make") == "file not found: examples/nope.py"


def test_file_with_syntax_error(user_files: Path) -> None:
    assert load_error("examples/bad.py:make") == "examples/bad.py line 3: invalid syntax"


def test_module_with_syntax_error(user_files: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(user_files))
    assert load_error("bad:make").endswith("bad.py line 3: invalid syntax")


def test_import_that_raises(user_files: Path) -> None:
    message = load_error("examples/raising.py:make")
    assert message == "importing examples/raising.py raised RuntimeError: broken at import second line"
    assert load_error("examples/exits.py:make") == "importing examples/exits.py raised SystemExit: 2"
    message = load_error("examples/missing_dep.py:make")
    assert message == (
        "importing examples/missing_dep.py raised ModuleNotFoundError: No module named 'no_such_dependency_xyz'"
    )


def test_module_whose_dependency_is_missing(user_files: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(user_files))
    message = load_error("missing_dep:make")
    assert message == (
        "importing module 'missing_dep' raised ModuleNotFoundError: No module named 'no_such_dependency_xyz'"
    )


def test_factory_missing_lists_callables() -> None:
    message = load_error(fixture("make_modle"))
    assert message.startswith(f"{FIXTURE_FILE} has no attribute 'make_modle'; did you mean make_model?")
    listed = message.split("callables there: ")[1].split(", ")
    assert "make_classes" in listed and listed[-1] == "..."  # a few, not all
    assert "Workload" not in listed and "TensorDataset" not in listed  # imported, not its own


def test_factory_not_callable() -> None:
    message = load_error(fixture("NOT_CALLABLE"))
    assert message == f"{fixture('NOT_CALLABLE')} is an int, not callable; expected a factory function"


def test_factory_needing_arguments() -> None:
    message = load_error(fixture("needs_arguments"))
    assert message.endswith("needs arguments (width); expected a factory callable with no arguments (or only seed)")


def test_factory_raising() -> None:
    assert load_error(fixture("explode")) == f"{fixture('explode')} raised KeyError: 'no weights here'"


def test_factory_returning_wrong_kind() -> None:
    assert load_error(fixture("make_list")).endswith("returned a list; expected an nn.Module or a Workload")
    message = load_error(fixture("make_model"), fixture("make_number"))
    assert message.endswith(
        "returned an int; expected a map-style Dataset (with __len__ and __getitem__) "
        "or an (inputs, targets) pair of tensors"
    )
    message = load_error(fixture("make_model"), fixture("make_mismatched_pair"))
    assert message.endswith(
        "returned tensors of shapes (10, 5) and (9, 2); expected (inputs, targets) with the same number of rows"
    )
    assert "item 0 of the dataset from" in load_error(fixture("make_model"), fixture("make_list"))


def test_bare_module_needs_a_dataset() -> None:
    assert "returned a bare nn.Module, so a dataset is needed" in load_error(fixture("make_model"))


def test_empty_dataset() -> None:
    message = load_error(fixture("make_model"), fixture("make_empty"))
    source = fixture("make_empty")
    assert message == f"the dataset from {source} is empty; expected at least one (input, target) item"
    assert "is empty" in load_error(fixture("make_empty_workload"))


def test_error_is_a_value_error() -> None:
    assert issubclass(WorkloadError, ValueError)
    assert str(WorkloadError("a\n  b\n")) == "a b"


# --- check_workload ------------------------------------------------------------------------------


def test_check_catches_items_that_do_not_fit_the_model() -> None:
    workload = load_workload(fixture("make_model"), fixture("make_seven_features"))
    with pytest.raises(WorkloadError) as info:
        check_workload(workload)
    assert str(info.value) == (
        "dataset items of shape (7,) do not fit the model: "
        "mat1 and mat2 shapes cannot be multiplied (2x7 and 5x2)"
    )


def test_check_catches_targets_that_do_not_fit_the_loss() -> None:
    workload = load_workload(fixture("make_model"), fixture("make_three_targets"))
    with pytest.raises(WorkloadError) as info:
        check_workload(workload)
    message = str(info.value)
    assert message.startswith("the loss does not accept model output of shape (2, 2) and targets of shape (2, 3): ")
    assert "\n" not in message


def test_check_catches_a_loss_that_only_broadcasts() -> None:
    dataset = TensorDataset(torch.randn(4, 5), torch.randn(4))
    workload = Workload("w", nn.Linear(5, 1), dataset, F.mse_loss)
    expected = r"output of shape \(2, 1\) and targets of shape \(2,\): Using a target size"
    with pytest.raises(WorkloadError, match=expected):
        check_workload(workload)


def test_check_wants_a_scalar_loss() -> None:
    workload = Workload("w", nn.Linear(5, 2), TensorDataset(torch.randn(4, 5), torch.randn(4, 2)), torch.sub)
    expected = r"the loss returned a tensor of shape \(2, 2\); expected a single-element tensor$"
    with pytest.raises(WorkloadError, match=expected):
        check_workload(workload)


def test_check_leaves_the_model_as_it_was() -> None:
    workload = builtin_workload("cnn")
    model = workload.model
    model[4].eval()  # a submodule the user froze stays frozen
    before = {key: value.clone() for key, value in model.state_dict().items()}
    check_workload(workload, batch=4)
    assert model.training and not model[4].training and model[1].training
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert all(p.grad is None for p in model.parameters())
