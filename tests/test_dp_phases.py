"""A DataParallel script's phase clock (dpengine/script/dp_phases.py) driven as swap.py drives it: what
between two steps of one DataParallel is its data, and what is not (another DataParallel's forwards,
its own evaluation)."""

from __future__ import annotations

import time

import pytest
from ui_fakes import step_event

from dpengine.script.dp_phases import DpPhases

TEACHER_S = 0.06


class Script:
    """Steps and forwards of a script's DataParallels, by name, told to the clock as swap.py tells it."""

    def __init__(self) -> None:
        self.posted: dict[tuple[str, int], object] = {}
        self.phases = DpPhases(lambda instance, record, loss: self.posted.__setitem__((instance, record.step), record))
        self.steps: dict[str, int] = {}

    def forward(self, instance: str, grad: bool = True, seconds: float = 0.0) -> None:
        step = self.steps[instance] = self.steps.get(instance, 0) + 1
        self.phases.release()
        self.phases.forward_begins(instance, step, grad)
        time.sleep(seconds)  # the forward's own work
        self.phases.forward_returns(instance, grad)
        if grad:
            self.phases.backward_done(instance, step)
            self.phases.backward_ends()
        self.phases.hold(instance, step_event(step, 1, step, 0, 8, ("cpu:0",)).record)

    def record(self, instance: str, step: int):
        self.phases.release(wait=True)
        return self.posted[instance, step]


def test_a_teachers_forward_between_two_steps_is_the_students_other_not_its_data():
    # Distillation: `with torch.no_grad(): t = teacher(x)` before `student(x)`. Its time read as the
    # student's input wait: "input-bound, raise num_workers".
    script = Script()
    script.forward("student")
    script.forward("teacher", grad=False, seconds=TEACHER_S)
    script.forward("student")
    second = script.record("student", 2)
    assert second.others_forward_ms >= TEACHER_S * 1000 and second.data_ms < TEACHER_S * 1000 / 2, second
    assert second.eval_ms is None
    assert script.record("teacher", 1).data_ms is None  # a forward without grad: no step


def test_a_generators_forward_before_the_discriminators_next_step_is_not_its_data():
    script = Script()
    script.forward("discriminator")  # on real images
    script.forward("generator", seconds=TEACHER_S)  # fake = G(z)
    script.forward("discriminator")  # on fake.detach()
    second = script.record("discriminator", 2)
    assert second.others_forward_ms >= TEACHER_S * 1000 and second.data_ms < TEACHER_S * 1000 / 2, second


def test_another_models_forward_inside_an_evaluation_counts_once_in_the_evaluation():
    # The model's validation also validates its EMA copy, between model.eval() and model.train().
    script = Script()
    script.forward("model")
    script.phases.eval_begins("model")
    script.forward("model", grad=False)
    script.forward("ema", grad=False, seconds=TEACHER_S)
    script.phases.eval_ends("model")
    script.forward("model")
    after = script.record("model", 3)
    assert after.eval_ms >= TEACHER_S * 1000 and after.others_forward_ms is None, after
    assert after.data_ms == pytest.approx(0.0, abs=TEACHER_S * 1000 / 2)
