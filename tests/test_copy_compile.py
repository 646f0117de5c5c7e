"""A DataParallel under copy.deepcopy, pickle, torch.save and torch.compile behaves as torch's (issue 19.1).

The engine's threads, locks and step in flight are not part of what is copied or pickled: a copy
makes its own workers when it first runs. Under `dptui run` (real child processes at the end),
torch.save writes a file that loads without dptui.
"""

from __future__ import annotations

import copy
import importlib
import io
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from dpengine import DataParallel

data_parallel = importlib.import_module("dpengine.data_parallel")  # the package's name is the functional form

SCRIPTS = Path(__file__).parent / "fixtures" / "scripts"
DPTUI = [sys.executable, "-m", "tui.cli", "run", "--headless", "--json", "--no-telemetry"]
DEVICES = ["cpu:0", "cpu:1", "cpu:2"]


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def train_step(dp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = dp(x)
    out.sum().backward()
    return out


def via_pickle(dp):
    return pickle.loads(pickle.dumps(dp))


def via_torch_save(dp):
    buffer = io.BytesIO()
    torch.save(dp, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIES = {"deepcopy": copy.deepcopy, "pickle": via_pickle, "torch.save": via_torch_save}


@pytest.mark.parametrize("how", COPIES)
@pytest.mark.parametrize("ran", [False, True], ids=["before its first forward", "after"])
def test_a_copy_keeps_the_modules_state_and_runs_on_its_own_workers(make_dp, how, ran):
    dp = make_dp(model(), device_ids=DEVICES, balance="weights", weights=[2, 1, 1])
    dp.note = "the user's own attribute"
    x = torch.randn(12, 6)
    if ran:
        train_step(dp, x)
        dp(x)  # a step in flight: its backward never comes
    clone = COPIES[how](dp)
    try:
        assert type(clone) is DataParallel and clone.note == "the user's own attribute"
        assert clone.devices == dp.devices and clone._split.weights == [2.0, 1.0, 1.0]
        for (name, a), b in zip(dp.state_dict().items(), clone.state_dict().values()):
            assert torch.equal(a, b), name
        assert clone.module[0].weight is not dp.module[0].weight
        assert clone.worker_thread_ids() == {} and clone.last_step is None
        out = train_step(clone, x)
        assert clone.last_step.step == 1 and clone.last_step.chunk_sizes == (6, 3, 3)
        assert set(clone.worker_thread_ids().values()).isdisjoint(dp.worker_thread_ids().values())
        assert clone.module[0].weight.grad is not None
        # the original trains on, unaffected
        before = dp.step_count
        train_step(dp, x)
        assert dp.last_step.step == before + 1
        assert out.shape == (12, 3)
    finally:
        clone.close()


def test_a_deepcopy_shares_nothing_it_should_not(make_dp):
    dp = make_dp(model(), device_ids=DEVICES)
    hook_calls = []
    dp.register_forward_hook(lambda *_: hook_calls.append(1))
    clone = copy.deepcopy(dp)
    try:
        with torch.no_grad():
            clone.module[0].weight.add_(1.0)
        assert not torch.equal(clone.module[0].weight, dp.module[0].weight)
        clone(torch.randn(6, 6))
        assert hook_calls == [1]  # the module's hooks are part of its state, as for torch's
        assert clone._records is not dp._records and clone._records._subscribers == []
    finally:
        clone.close()


def test_the_torch_form_loads_as_torchs_dataparallel_and_back(make_dp):
    dp = make_dp(model(), device_ids=DEVICES, chunk_sizes=[2, 5, 5])
    train_step(dp, torch.randn(12, 6))
    state = dp.torch_state()
    assert b"dpengine." not in pickle.dumps(state)  # no class of dpengine.*: it loads without it
    for name in ("devices", "_split", "_balancer", "_pool", "_record_lock", "_pending", "_plan"):
        assert name not in state
    plain = torch.nn.DataParallel.__new__(torch.nn.DataParallel)
    plain.__setstate__(copy.deepcopy(state))
    assert plain.device_ids == []  # virtual CPU devices: torch runs the module itself here
    x = torch.randn(4, 6)
    plain.eval(), dp.eval()
    with torch.no_grad():
        assert torch.equal(plain(x), dp.module(x))
    back = DataParallel.__new__(DataParallel)
    back.__setstate__(copy.deepcopy(state))
    try:
        assert back.devices == dp.devices and back._split.chunk_sizes == [2, 5, 5]
        assert not hasattr(back, "_dpengine")
        with torch.no_grad():
            assert torch.allclose(back(x.repeat(3, 1)), dp(x.repeat(3, 1)))
    finally:
        back.close()


def test_torchs_own_pickle_loads_into_dpengine():
    """A whole-model checkpoint of torch's DataParallel, read where the name means dpengine's (dptui run)."""
    plain = torch.nn.DataParallel(model())

    class AsDpengine(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) == ("torch.nn.parallel.data_parallel", "DataParallel"):
                return DataParallel
            return super().find_class(module, name)

    loaded = AsDpengine(io.BytesIO(pickle.dumps(plain))).load()
    assert type(loaded) is DataParallel and loaded.devices == [] and loaded.dim == 0
    x = torch.randn(4, 6)
    assert torch.equal(loaded(x), plain(x))


def test_torch_compile_of_the_dataparallel_runs_it_eagerly_and_says_so_once(make_dp, monkeypatch):
    monkeypatch.setattr(data_parallel, "_said_uncompiled", False)
    m = mlp()
    dp = make_dp(m, device_ids=DEVICES)
    compiled = torch.compile(dp, backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rows in (12, 12, 7):
            x = torch.randn(rows, 6)
            out = compiled(x)
            out.sum().backward()
            assert torch.allclose(out, m(x), atol=1e-6)
            assert dp.last_step.batch_size == rows  # recorded as without compile
    said = [w for w in caught if "torch.compile runs dpengine's DataParallel uncompiled" in str(w.message)]
    assert len(said) == 1


def test_a_dataparallel_of_a_compiled_model_runs_compiled_replicas(make_dp):
    from torch._dynamo.utils import counters

    m = mlp()
    reference = copy.deepcopy(m)
    compiled = torch.compile(m, backend="eager")
    dp = make_dp(compiled, device_ids=DEVICES)
    counters.clear()
    for rows in (12, 12, 9):
        x = torch.randn(rows, 6)
        out = dp(x)
        expected = reference(x)
        assert torch.allclose(out, expected, atol=1e-6)
        out.sum().backward()
        expected.sum().backward()
    assert counters["frames"]["ok"] > 0  # the replicas ran through dynamo
    for (name, p), q in zip(m.named_parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), name
    # torch's own replication would have made the model its own child and emptied it
    assert list(m._modules) == ["0", "1", "2"] and not getattr(m, "_is_replica", False)
    assert list(dp.state_dict())[0] == "module._orig_mod.0.weight"


def test_a_compiled_submodule_is_replicated_with_its_own_inner_module(make_dp):
    m = mlp()
    reference = copy.deepcopy(m)
    m[0] = torch.compile(m[0], backend="eager")
    dp = make_dp(m, device_ids=DEVICES)
    x = torch.randn(9, 6)
    dp(x).sum().backward()
    reference(x).sum().backward()
    assert torch.allclose(m[0]._orig_mod.weight.grad, reference[0].weight.grad, atol=1e-5)
    assert list(m[0]._orig_mod._parameters) == ["weight", "bias"]


def test_a_dataparallel_never_imports_dynamo_unless_something_compiles():
    """Importing torch._dynamo costs seconds: the compile guard must not pull it in."""
    script = (
        "import sys, copy, torch\n"
        "from dpengine import DataParallel\n"
        "dp = DataParallel(torch.nn.Linear(4, 2), ['cpu:0', 'cpu:1'])\n"
        "dp(torch.randn(6, 4)).sum().backward()\n"
        "copy.deepcopy(dp)(torch.randn(6, 4))\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


# -- under `dptui run`: real child processes -------------------------------------------


def run(*args: str, cwd: Path | None = None) -> tuple[subprocess.CompletedProcess, dict[str, str], list[dict]]:
    import json

    done = subprocess.run([*DPTUI, *args], capture_output=True, text=True, timeout=180, cwd=cwd)
    events = [json.loads(line) for line in done.stdout.splitlines()]
    printed = dict(
        e["line"].split(": ", 1) for e in events
        if e["type"] == "output" and e["stream"] == "stdout" and ": " in e["line"]
    )
    return done, printed, events


def test_under_dptui_run_copies_pickles_and_compiles_work_and_saves_load_without_dptui(tmp_path):
    done, printed, events = run("--devices", "cpu:0,cpu:1", str(SCRIPTS / "copies.py"), str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert printed == {
        "copy class": "True True", "copy note": "kept", "copy owns its parameters": "True",
        "copy equal": "True", "copy before training unchanged": "True", "copy output": "True",
        "pickled output": "True", "saved copy": "True", "compiled output": "True", "compiled again": "True",
    }
    steps = [e for e in events if e["type"] == "step"]
    assert len(steps) >= 4 and all([r["chunk_size"] for r in s["replicas"]] == [6, 6] for s in steps)
    said = [e for e in events if e["type"] == "output" and "uncompiled" in e["line"]]
    assert len(said) == 1
    # The files name torch's class and load in a python where dpengine cannot be imported.
    check = (
        "import sys; sys.modules['dpengine'] = None\n"
        "import torch\n"
        f"x, expected = torch.load({str(tmp_path / 'expected.pt')!r})\n"
        "for name in ('before', 'after'):\n"
        f"    dp = torch.load({str(tmp_path)!r} + f'/{{name}}.pt', weights_only=False)\n"
        "    print(name, type(dp).__module__, type(dp).__name__, dp.device_ids, dp.note)\n"
        "dp.eval()\n"
        "with torch.no_grad():\n"
        "    print('output', torch.allclose(dp(x), expected))\n"
    )
    plain = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.splitlines() == [
        "before torch.nn.parallel.data_parallel DataParallel [] kept",
        "after torch.nn.parallel.data_parallel DataParallel [] kept",
        "output True",
    ]


def test_under_dptui_run_timms_model_ema_deepcopies_the_dataparallel():
    """Real code: timm's train.py makes its EMA copy with deepcopy after the DataParallel wrap."""
    done, printed, events = run("--devices", "cpu:0,cpu:1,cpu:2", "timm_train_ema.py", cwd=SCRIPTS / "real")
    assert done.returncode == 0, done.stderr
    lines = [e["line"] for e in events if e["type"] == "output" and e["stream"] == "stdout"]
    assert sum(line.startswith("Test (EMA):") for line in lines) == 2
    assert lines[-1] == "EMA state_dict keys: ['module.0.weight', 'module.0.bias']"
    assert len([e for e in events if e["type"] == "step"]) >= 6


def test_under_dptui_run_a_dataparallel_of_a_compiled_model_trains():
    """The tutorial's torch.compile applied inside nn.DataParallel (RecursionError in replica 0 before)."""
    done, printed, events = run("--devices", "cpu:0,cpu:1,cpu:2", "compile_dataparallel.py", "--wrap", "inside",
                                cwd=SCRIPTS / "real")
    assert done.returncode == 0, done.stderr
    assert printed["compiled output matches eager"] == "True"
    steps = [e for e in events if e["type"] == "step"]
    assert [[r["chunk_size"] for r in s["replicas"]] for s in steps][:3] == [[8, 8, 8]] * 3
