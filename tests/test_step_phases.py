"""A rank's phase clock (dpengine.script.step_phases.RankSteps) on a clock the test moves: where a
step ends (several optimizers, no_sync micro-batches, a GradScaler's skipped step), its phases, and
a pause before step N."""

from __future__ import annotations

import warnings

import pytest
import torch

from dpengine.script.step_phases import RankSteps


class MovedClock:
    """Marks are the test's time, in seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def mark(self) -> float:
        return self.now

    def ms(self, start: float, end: float) -> float:
        return (end - start) * 1000.0

    def done(self, mark: float) -> bool:
        return True

    def wait(self, mark: float) -> None:
        pass

    def memory(self):
        return 100, 200


@pytest.fixture
def clock() -> MovedClock:
    return MovedClock()


@pytest.fixture
def sent() -> list:
    return []


@pytest.fixture
def steps(clock, sent) -> RankSteps:
    return RankSteps(0, clock, sent.append)


def micro_batch(steps: RankSteps, clock: MovedClock, *, synced: bool = True, loss: float = 1.0,
                forward: float = 0.010, compute: float = 0.020, wait: float = 0.0) -> None:
    steps.forward_begins(8, synced=synced)
    clock.now += forward
    steps.forward_ends()
    steps.backward_begins(torch.tensor(loss))
    clock.now += compute
    if synced:
        steps.bucket_ready(last=True)
        clock.now += wait
        steps.bucket_done(last=True)
    steps.backward_ends()


def optimizer_step(steps: RankSteps, clock: MovedClock, seconds: float = 0.005) -> None:
    steps.optimizer_begins()
    clock.now += seconds
    steps.optimizer_ends()


def test_a_step_is_cut_into_its_phases(steps, clock, sent):
    micro_batch(steps, clock)
    optimizer_step(steps, clock)
    clock.now += 0.030  # the next batch loads
    micro_batch(steps, clock, forward=0.010, compute=0.020, wait=0.015)
    clock.now += 0.002  # the script's own work
    optimizer_step(steps, clock, 0.005)
    steps.finish()
    first, second = sent
    assert (first.step, second.step) == (0, 1)
    assert second.data_ms == pytest.approx(30) and second.forward_ms == pytest.approx(10)
    assert second.backward_ms == pytest.approx(20) and second.comm_wait_ms == pytest.approx(15)
    assert second.optimizer_ms == pytest.approx(5) and second.other_ms == pytest.approx(2)
    assert second.total_ms == pytest.approx(82)
    assert second.forward_start_ms == pytest.approx(30) and second.comm_wait_start_ms == pytest.approx(60)
    assert second.allreduce_end_ms == pytest.approx(75) and second.optimizer_start_ms == pytest.approx(77)
    assert (second.memory_bytes, second.peak_memory_bytes, second.samples, second.loss) == (100, 200, 8, 1.0)


def test_a_loss_that_requires_grad_is_read_without_a_warning_in_the_scripts_stderr(steps, clock, sent):
    # dptui's own rank loop hands the graph's loss; torch warns (once per process, unless
    # warn_always) when such a tensor is turned into a float.
    weight = torch.tensor(2.0, requires_grad=True)
    warn_always = torch.is_warn_always_enabled()
    torch.set_warn_always(True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            steps.forward_begins(8, synced=True)
            steps.forward_ends()
            steps.backward_begins(weight * 3)
            steps.backward_ends()
            optimizer_step(steps, clock)
            steps.finish()
    finally:
        torch.set_warn_always(warn_always)
    assert [str(w.message) for w in caught] == []
    assert sent[0].loss == pytest.approx(6.0)


def test_no_sync_micro_batches_are_one_step(steps, clock, sent):
    for _ in range(2):
        micro_batch(steps, clock, synced=False, loss=0.5)
        micro_batch(steps, clock, synced=False, loss=0.25)
        micro_batch(steps, clock, synced=True, loss=0.25)
        optimizer_step(steps, clock)
    steps.finish()
    assert [(s.step, s.micro_batches, s.samples, s.loss) for s in sent] == [(0, 3, 24, 1.0), (1, 3, 24, 1.0)]


def test_several_optimizers_end_the_step_at_the_last_before_the_next_forward(steps, clock, sent):
    micro_batch(steps, clock)
    optimizer_step(steps, clock, 0.004)
    clock.now += 0.001
    optimizer_step(steps, clock, 0.006)
    micro_batch(steps, clock)
    assert len(sent) == 1 and sent[0].optimizer_ms == pytest.approx(10) and sent[0].other_ms == pytest.approx(1)


def test_a_skipped_optimizer_step_ends_at_the_synchronised_backward(steps, clock, sent):
    micro_batch(steps, clock)  # a GradScaler found inf: no optimizer.step
    clock.now += 0.050
    micro_batch(steps, clock)
    optimizer_step(steps, clock)
    steps.finish()
    assert [s.step for s in sent] == [0, 1]
    assert sent[0].optimizer_ms == 0 and sent[0].total_ms == pytest.approx(30)
    assert sent[1].data_ms == pytest.approx(50)  # from the skipped step's end


def test_a_pause_before_step_n_is_not_counted_as_input(clock, sent):
    def before_step(number: int) -> bool:
        if number == 1:
            clock.now += 10.0  # paused for ten seconds
            return True
        return False

    steps = RankSteps(0, clock, sent.append, before_step)
    micro_batch(steps, clock)
    optimizer_step(steps, clock)
    clock.now += 0.003
    micro_batch(steps, clock)
    optimizer_step(steps, clock)
    steps.finish()
    assert sent[1].data_ms == pytest.approx(0) and sent[1].total_ms < 100


def closure_step(steps: RankSteps, clock: MovedClock, *, before: float = 0.001, calls: int = 1,
                 between: float = 0.003, after: float = 0.004, wait: float = 0.0) -> None:
    """optimizer.step(closure), as Lightning's loop and LBFGS run it: forward and backward inside."""
    steps.optimizer_begins()
    clock.now += before  # zero_grad in the closure
    for call in range(calls):
        if call:
            clock.now += between  # LBFGS's own work between its closure calls
        micro_batch(steps, clock, wait=wait)
    clock.now += after  # the update itself
    steps.optimizer_ends()


def test_forward_and_backward_in_an_optimizer_closure_are_not_optimizer_time(steps, clock, sent):
    for _ in range(3):
        clock.now += 0.030  # the next batch loads
        closure_step(steps, clock, wait=0.015)
    steps.finish()
    assert [s.step for s in sent] == [0, 1, 2]
    for step in sent:
        assert step.forward_ms == pytest.approx(10) and step.backward_ms == pytest.approx(20)
        assert step.comm_wait_ms == pytest.approx(15) and step.optimizer_ms == pytest.approx(4)
        assert step.micro_batches == 1
        phases = step.data_ms + step.forward_ms + step.backward_ms + step.comm_wait_ms + step.optimizer_ms
        assert phases + step.other_ms == pytest.approx(step.total_ms)
        assert step.other_ms == pytest.approx(0, abs=1e-9)
        # Disjoint on the step's axis: the update follows the backward, not before the forward.
        assert step.forward_start_ms < step.backward_start_ms < step.optimizer_start_ms
        assert step.optimizer_start_ms == pytest.approx(step.total_ms - 4)
    later = sent[1:]
    assert all(s.data_ms == pytest.approx(31) for s in later)  # the load and the closure's zero_grad


def test_an_lbfgs_closure_called_several_times_is_one_step(steps, clock, sent):
    closure_step(steps, clock, calls=3, between=0.003, after=0.002)
    closure_step(steps, clock, calls=2, between=0.003, after=0.002)
    steps.finish()
    first, second = sent
    assert (first.micro_batches, second.micro_batches) == (3, 2)
    assert first.forward_ms == pytest.approx(30) and first.backward_ms == pytest.approx(60)
    assert first.optimizer_ms == pytest.approx(2 * 3 + 2)  # its work between the calls, and the update
    assert second.optimizer_ms == pytest.approx(3 + 2)
    for step in sent:
        phases = step.data_ms + step.forward_ms + step.backward_ms + step.comm_wait_ms + step.optimizer_ms
        assert phases == pytest.approx(step.total_ms)


def test_fsdp_collectives_in_forward_and_backward_are_comm_wait_not_those_phases(steps, clock, sent):
    micro_batch(steps, clock)
    optimizer_step(steps, clock)
    clock.now += 0.030  # data
    steps.forward_begins(8, synced=True)
    assert steps.collective_begins()  # the all-gather of the first layer: the other rank is late
    clock.now += 0.040
    assert not steps.collective_begins()  # its wait, inside it: timed once
    steps.collective_ends()
    clock.now += 0.010
    steps.forward_ends()
    steps.backward_begins(torch.tensor(1.0))
    clock.now += 0.020
    assert steps.in_backward and steps.collective_begins()  # reduce-scatter
    clock.now += 0.005
    steps.collective_ends()
    steps.backward_ends()
    assert steps.collective_begins()  # between backward and the update (a gradient-norm all-reduce)
    clock.now += 0.003
    steps.collective_ends()
    optimizer_step(steps, clock)
    steps.finish()
    _, step = sent
    assert step.data_ms == pytest.approx(30) and step.forward_ms == pytest.approx(10)
    assert step.comm_wait_ms == pytest.approx(48) and step.backward_ms == pytest.approx(20)
    assert step.total_ms == pytest.approx(113) and step.other_ms == pytest.approx(0)
    assert step.comm_wait_start_ms == pytest.approx(30) and step.allreduce_end_ms == pytest.approx(108)


def collective(steps: RankSteps, clock: MovedClock, seconds: float) -> None:
    """A blocking torch.distributed call of the script's (collectives.py): waiting for the others."""
    assert steps.collective_begins()
    clock.now += seconds
    steps.collective_ends()


def test_a_loss_all_reduced_between_forward_and_backward_is_comm_wait_not_other(steps, clock, sent):
    # torchvision's detection reference logs reduce_dict(loss_dict) there: a rank on time waits in it
    # for the late one, and that wait was its own time (other), so no rank stood out.
    for _ in range(2):
        clock.now += 0.001
        steps.forward_begins(8, synced=True)
        clock.now += 0.010
        steps.forward_ends()
        collective(steps, clock, 0.050)
        steps.backward_begins(torch.tensor(1.0))
        clock.now += 0.020
        steps.bucket_ready(last=True)
        clock.now += 0.002  # the gradients' all-reduce: the ranks left the loss's together
        steps.bucket_done(last=True)
        steps.backward_ends()
        optimizer_step(steps, clock)
    steps.finish()
    step = sent[1]
    assert step.comm_wait_ms == pytest.approx(52) and step.other_ms == pytest.approx(0, abs=1e-9)
    assert step.data_ms == pytest.approx(1) and step.forward_ms == pytest.approx(10)
    assert step.backward_ms == pytest.approx(20)
    # The timeline's one comm_wait span starts at the longest wait; ranks align on the gradients' all-reduce.
    assert step.comm_wait_start_ms == pytest.approx(11) and step.allreduce_end_ms == pytest.approx(83)


def test_a_collective_after_the_optimizer_step_is_the_next_steps_comm_wait_not_its_data(steps, clock, sent):
    # A loss all-reduced for logging after optimizer.step: the rank on time waits there for a rank slow
    # in its update, and that wait was the next step's data (input-bound, said of the wrong rank).
    micro_batch(steps, clock)
    optimizer_step(steps, clock)
    collective(steps, clock, 0.050)
    clock.now += 0.004  # the next batch
    micro_batch(steps, clock)
    optimizer_step(steps, clock)
    steps.finish()
    first, second = sent
    assert first.comm_wait_ms == pytest.approx(0) and first.total_ms == pytest.approx(35)
    assert second.data_ms == pytest.approx(4) and second.comm_wait_ms == pytest.approx(50)
    assert second.total_ms == pytest.approx(89) and second.other_ms == pytest.approx(0, abs=1e-9)


def test_a_second_optimizer_after_a_collective_keeps_it_in_its_own_step(steps, clock, sent):
    micro_batch(steps, clock)
    optimizer_step(steps, clock)
    collective(steps, clock, 0.007)  # between a GAN's two updates
    optimizer_step(steps, clock)
    micro_batch(steps, clock)
    first = sent[0]
    assert first.comm_wait_ms == pytest.approx(7) and first.other_ms == pytest.approx(0, abs=1e-9)
    assert first.total_ms == pytest.approx(47)


def test_collectives_before_the_first_step_are_no_steps(steps, clock, sent):
    assert not steps.collective_begins()  # init_process_group's barrier, DDP's broadcast of the weights
    steps.collective_ends()
    clock.now += 0.5
    micro_batch(steps, clock)
    optimizer_step(steps, clock)
    steps.finish()
    assert sent[0].comm_wait_ms == 0 and sent[0].total_ms == pytest.approx(35)


def accumulated_step(steps: RankSteps, clock: MovedClock, micro_batches: int, *, load: float = 0.030,
                     sync: float = 0.002, in_closure: bool = True) -> None:
    """Lightning's loop with accumulate_grad_batches: each batch broadcasts (its SIGTERM flag) and loads,
    the micro-batches before the last under no_sync(), the last inside optimizer.step(closure)."""
    for index in range(micro_batches):
        last = index == micro_batches - 1
        collective(steps, clock, sync) if steps.started else clock.__setattr__("now", clock.now + sync)
        clock.now += load
        if last and in_closure:
            closure_step(steps, clock, before=0.001, after=0.004)
        else:
            micro_batch(steps, clock, synced=last)
    if not in_closure:
        optimizer_step(steps, clock, 0.004)


@pytest.mark.parametrize("in_closure, micro_batches", [(True, 3), (True, 1), (False, 3)],
                         ids=["lightning", "lightning without accumulation", "plain loop"])
def test_every_micro_batchs_input_is_data_and_its_broadcast_comm_wait(steps, clock, sent, in_closure, micro_batches):
    for _ in range(3):
        accumulated_step(steps, clock, micro_batches, in_closure=in_closure)
    steps.finish()
    for step in sent[1:]:
        assert step.micro_batches == micro_batches
        # each batch's load, and the closure's zero_grad
        assert step.data_ms == pytest.approx(micro_batches * 30 + (1 if in_closure else 0))
        assert step.comm_wait_ms == pytest.approx(micro_batches * 2)
        assert step.forward_ms == pytest.approx(micro_batches * 10)
        assert step.backward_ms == pytest.approx(micro_batches * 20)
        assert step.optimizer_ms == pytest.approx(4) and step.other_ms == pytest.approx(0, abs=1e-9)
        assert step.total_ms == pytest.approx(micro_batches * 62 + 5 if in_closure else micro_batches * 62 + 4)


def test_the_loss_between_a_forward_and_its_backward_is_not_the_next_micro_batchs_input(steps, clock, sent):
    for _ in range(2):
        for index in range(2):
            clock.now += 0.003  # the micro-batch loads
            steps.forward_begins(8, synced=index == 1)
            clock.now += 0.010
            steps.forward_ends()
            clock.now += 0.006  # the loss, computed in the script
            steps.backward_begins(torch.tensor(1.0))
            clock.now += 0.020
            steps.backward_ends()
        optimizer_step(steps, clock)
    steps.finish()
    step = sent[1]
    assert step.data_ms == pytest.approx(3 + 3) and step.other_ms == pytest.approx(2 * 6)


def test_after_a_skipped_update_a_collective_is_the_next_steps(steps, clock, sent):
    micro_batch(steps, clock)  # a GradScaler found inf: no optimizer.step
    collective(steps, clock, 0.010)
    clock.now += 0.002
    micro_batch(steps, clock)
    optimizer_step(steps, clock)
    steps.finish()
    first, second = sent
    assert first.total_ms == pytest.approx(30) and first.comm_wait_ms == 0
    assert second.comm_wait_ms == pytest.approx(10) and second.data_ms == pytest.approx(2)


def evaluation(steps: RankSteps, clock: MovedClock, *, batches: int, forward: float, load: float,
               sync: float = 0.0, train_call: bool = True) -> None:
    """A validation loop between steps: model.eval(), then per batch its input and a forward without grad,
    a metric all-reduced at the end, then model.train() (Lightning only sets `.training` back: no call)."""
    steps.eval_begins()
    for _ in range(batches):
        clock.now += load
        clock.now += forward
        steps.eval_forward_ends()
    if sync:
        collective(steps, clock, sync)
    if train_call:
        steps.eval_ends()


def test_an_evaluation_between_steps_is_other_not_the_next_steps_data(steps, clock, sent):
    # A validation loop every N steps was the next step's data: the run read as input-bound.
    micro_batch(steps, clock)
    optimizer_step(steps, clock)
    evaluation(steps, clock, batches=4, forward=0.010, load=0.005, sync=0.003)
    clock.now += 0.002  # the next training batch loads
    micro_batch(steps, clock)
    optimizer_step(steps, clock)
    micro_batch(steps, clock)
    optimizer_step(steps, clock)
    steps.finish()
    first, second, third = sent
    assert second.data_ms == pytest.approx(2) and second.comm_wait_ms == pytest.approx(3)
    assert second.eval_ms == pytest.approx(60) and second.other_ms == pytest.approx(60)
    assert second.total_ms == pytest.approx(2 + 3 + 60 + 35)
    # drawn where they ran: the evaluation from the step's start, the input after it, then forward
    assert (second.other_start_ms, second.data_start_ms, second.forward_start_ms) == pytest.approx((0, 63, 65))
    assert (first.other_start_ms, first.data_start_ms) == (None, 0.0)
    assert first.eval_ms == third.eval_ms == 0 and third.other_ms == pytest.approx(0, abs=1e-9)


def test_without_model_train_an_evaluation_ends_at_its_last_forward(steps, clock, sent):
    # Lightning restores `.training` itself: what follows the last forward (its metrics' all-reduce,
    # the next batch) is the next step's.
    micro_batch(steps, clock)
    optimizer_step(steps, clock)
    evaluation(steps, clock, batches=2, forward=0.010, load=0.005, sync=0.003, train_call=False)
    clock.now += 0.007
    micro_batch(steps, clock)
    optimizer_step(steps, clock)
    steps.finish()
    second = sent[1]
    assert second.eval_ms == pytest.approx(30) and second.data_ms == pytest.approx(7)
    assert second.comm_wait_ms == pytest.approx(3) and second.total_ms == pytest.approx(30 + 3 + 7 + 35)


def test_without_model_train_the_work_between_the_last_forward_and_the_training_fetch_is_other(steps, clock, sent):
    # Lightning: its validation loop's loader runs out (StopIteration), then ModelCheckpoint saves and
    # the logs are written, then the training fetch. The save was the next step's data.
    micro_batch(steps, clock)
    optimizer_step(steps, clock)
    steps.eval_begins()
    for _ in range(2):
        steps.input_begins()  # the validation loader's batch
        clock.now += 0.005
        clock.now += 0.010
        steps.eval_forward_ends()
    steps.input_begins()
    steps.input_exhausted()  # its loader ran out: no input began there
    clock.now += 0.030  # the checkpoint
    steps.input_begins()  # the training loader's
    clock.now += 0.004
    collective(steps, clock, 0.002)  # Lightning's broadcast after the fetch: the input's
    micro_batch(steps, clock)
    optimizer_step(steps, clock)
    steps.finish()
    second = sent[1]
    assert second.eval_ms == pytest.approx(30) and second.other_ms == pytest.approx(60)
    assert second.data_ms == pytest.approx(4) and second.comm_wait_ms == pytest.approx(2)
    assert (second.other_start_ms, second.data_start_ms) == pytest.approx((0, 60))


def test_an_evaluation_without_forwards_or_train_call_lasts_to_the_next_step(steps, clock, sent):
    # model.eval() and forwards the clock cannot see (HF Trainer evaluates the module without its DDP),
    # and no model.train() before the next forward: all of it is the evaluation's.
    micro_batch(steps, clock)
    optimizer_step(steps, clock)
    steps.eval_begins()
    clock.now += 0.040
    micro_batch(steps, clock)
    optimizer_step(steps, clock)
    steps.finish()
    assert sent[1].eval_ms == pytest.approx(40) and sent[1].data_ms == pytest.approx(0, abs=1e-9)


def test_evaluations_before_the_first_step_or_inside_one_are_not_counted(steps, clock, sent):
    evaluation(steps, clock, batches=2, forward=0.010, load=0.005)  # Lightning's sanity check
    micro_batch(steps, clock, synced=False)
    steps.eval_begins()  # between two micro-batches, before the update: the step's own time
    clock.now += 0.010
    steps.eval_ends()
    micro_batch(steps, clock)
    optimizer_step(steps, clock)
    steps.finish()
    (only,) = sent
    assert only.eval_ms == 0 and only.data_ms == pytest.approx(10) and only.micro_batches == 2


def test_a_model_put_in_eval_mode_to_train_is_no_evaluation(steps, clock, sent):
    # `model.eval()` before each step to freeze BatchNorm, then a forward with grad: the batch loaded
    # between them is data, not an evaluation.
    micro_batch(steps, clock)
    optimizer_step(steps, clock)
    steps.eval_begins()
    clock.now += 0.020
    steps.trains_in_eval_mode()
    micro_batch(steps, clock)
    optimizer_step(steps, clock)
    steps.finish()
    assert sent[1].eval_ms == 0 and sent[1].data_ms == pytest.approx(20)


def test_work_after_the_update_before_the_dataloaders_fetch_is_other_and_the_fetch_on_is_data(steps, clock, sent):
    # An EMA of the weights after optimizer.step was the next step's data: "raise num_workers".
    micro_batch(steps, clock)
    optimizer_step(steps, clock)
    clock.now += 0.040  # the EMA update
    collective(steps, clock, 0.003)  # a loss all-reduced for logging
    steps.input_begins()
    clock.now += 0.006  # the fetch
    collective(steps, clock, 0.002)  # a broadcast after it (Lightning's, at each batch)
    clock.now += 0.001  # to the device
    steps.input_begins()  # a second loader's fetch: the input began at the first
    micro_batch(steps, clock)
    optimizer_step(steps, clock)
    steps.finish()
    second = sent[1]
    assert second.data_ms == pytest.approx(7) and second.other_ms == pytest.approx(40)
    assert second.comm_wait_ms == pytest.approx(5) and second.eval_ms == 0
    assert (second.other_start_ms, second.data_start_ms, second.forward_start_ms) == pytest.approx((0, 43, 52))


def test_an_evaluations_own_fetches_are_not_the_next_steps_input(steps, clock, sent):
    micro_batch(steps, clock)
    optimizer_step(steps, clock)
    steps.eval_begins()
    steps.input_begins()  # the validation loader's
    clock.now += 0.020
    steps.eval_forward_ends()
    steps.eval_ends()
    clock.now += 0.001
    steps.input_begins()  # the training loader's
    clock.now += 0.004
    micro_batch(steps, clock)
    optimizer_step(steps, clock)
    steps.finish()
    second = sent[1]
    assert second.eval_ms == pytest.approx(20) and second.data_ms == pytest.approx(4)
    assert second.other_ms == pytest.approx(21)
