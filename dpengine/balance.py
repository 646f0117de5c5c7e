"""Auto-balance: cut each batch so that no replica waits for another.

`Balancer` is pure: fed each step's chunk sizes and per-replica times, it estimates every
device's time per row (ratio of sums over the recent steps, so a noisy step weighs little) and
proposes weights, one per device, under which the predicted slowest replica finishes earliest.
It adopts them only when that prediction beats the current split's by `margin` and MIN_GAIN_MS (hysteresis),
so measurement noise does not make the split oscillate, and keeps them only when the steps that
follow measure faster too: where a replica's time does not grow with its rows (a tiny model,
all fixed costs) per-row estimates mislead, so such a trial is undone and not retried for a while.
Weights, not sizes: the same plan cuts any batch, including an epoch's smaller last one
(`balanced_sizes`).

Load changes while it runs (another job moves from one device to another), so every judgement
is made on fresh measurements: a trial that measured no faster than the split before it is
undone and that split measured again before anything is concluded (if it now measures slower
than the trial did, the conditions changed, not the trial's merit, and the trial comes back);
a hold against retrying ends when the current split's time per row moves by LOAD_CHANGE; and a
device that got no rows for PROBE_AFTER steps (a batch smaller than the device count) is given
a probe share for one step, so its estimate never goes stale for good. The even-split time it
reports is marked unsure when the per-row model fits the measurements badly (fixed costs).

Both backends use it: `DataParallel(balance="auto")` feeds it from its own step records, and
every DDP rank feeds an identical copy from timings gathered to all ranks, so all ranks derive
the same split.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from .scatter_gather import Split, even_sizes, weighted_sizes

WARMUP_STEPS = 2  # the first steps pay for thread start-up and allocator growth: ignored
MIN_STEPS = 3  # steps measured at the current split before deciding
WINDOW = 8  # recent steps the per-row estimate is taken over
MARGIN = 0.05  # a new split must be predicted this much faster than the current one
MIN_GAIN_MS = 0.05  # and by this much: below it the gain is the clocks' jitter, not the split's
HOLD_STEPS = 50  # after a new split that measured no faster, keep the old one this long (doubling)
MAX_HOLD_STEPS = 1600
LOAD_CHANGE = 0.25  # a hold ends once the current split's time per row moves this much
PROBE_AFTER = 32  # a device without rows for this many steps gets a probe share for one step
FIT_SAMPLES = 16  # per device, the last (rows, ms) measurements, across splits, for the fit check
UNSURE_FIT = 0.20  # relative residuals of the per-row model beyond this: even_ms is a guess

Balance = str | tuple[float, ...]  # "even", "auto", or one weight per device


@dataclass(frozen=True, slots=True)
class BalancePlan:
    """The balancer's view after a step, for the record and the UI."""

    weights: tuple[float, ...]  # per device slot, summing to 1
    changed: bool  # this step's measurements made the balancer adopt `weights`
    # The slowest replica's time under `weights`, and under torch's even split, for the last
    # batch; None while some device has no estimate yet.
    predicted_ms: float | None
    even_ms: float | None
    # The per-row model fits the measurements badly (residuals over UNSURE_FIT): even_ms is a guess.
    even_unsure: bool = False


def parse_balance(text: str, device_count: int | None = None) -> Balance:
    """"even", "auto", or weights "W1,W2,..." (one per device when `device_count` is given).

    Raises ValueError with one line saying what would be right.
    """
    text = text.strip()
    if text in ("even", "auto"):
        return text
    parts = [p.strip() for p in text.split(",")]
    try:
        weights = tuple(float(p) for p in parts)
    except ValueError:
        raise ValueError(f"expected even, auto or weights like 2,1,1, not {text!r}") from None
    if any(not (math.isfinite(w) and w >= 0) for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weights {text!r} must be non-negative numbers, not all zero")
    if device_count is not None and len(weights) != device_count:
        raise ValueError(f"{len(weights)} weights {text!r} for {device_count} devices: give one per device")
    return weights


def check_balance(balance: Balance, device_count: int) -> Balance:
    """`balance` if it fits `device_count` devices (one weight each); a ValueError otherwise."""
    if not isinstance(balance, str) and len(balance) != device_count:
        raise ValueError(f"{len(balance)} weights for {device_count} devices: give one per device")
    return balance


def balanced_sizes(rows: int, weights: Sequence[float], min_rows: int = 1) -> list[int]:
    """Rows per device minimizing the largest rows/weight, each at least `min_rows` when they fit.

    With fewer rows than that needs, the rows go by weight alone (some devices get none).
    """
    count = len(weights)
    if min_rows * count > rows or any(w <= 0 for w in weights):
        return weighted_sizes(rows, weights)
    total = sum(weights)
    sizes = [max(min_rows, math.floor(rows * w / total)) for w in weights]
    # At most `count` rows to move either way: give each to where it costs least.
    while sum(sizes) < rows:
        i = min(range(count), key=lambda k: ((sizes[k] + 1) / weights[k], k))
        sizes[i] += 1
    while sum(sizes) > rows:
        i = max((k for k in range(count) if sizes[k] > min_rows), key=lambda k: (sizes[k] / weights[k], -k))
        sizes[i] -= 1
    return sizes


class BalancedSplit(Split):
    """The balancer's split: every batch cut by `balanced_sizes` (a Split with `weights` may leave a device none)."""

    def __init__(self, weights: Sequence[float], min_rows: int = 1) -> None:
        super().__init__(len(weights), weights=weights)
        self.min_rows = min_rows

    def plan(self, rows: int) -> list[tuple[int, int]]:
        sizes = balanced_sizes(rows, self.weights, self.min_rows)
        plan = [(slot, size) for slot, size in enumerate(sizes) if size > 0]
        return plan or [(slot, 0) for slot in range(self.device_count)]


class Balancer:
    """Per-row time estimates and the weights they call for; one instance per device set.

    Pure and deterministic: the same observations give the same decisions (DDP relies on it).
    """

    def __init__(
        self, device_count: int, *, allow_zero: bool = False, warmup: int = WARMUP_STEPS,
        min_steps: int = MIN_STEPS, window: int = WINDOW, margin: float = MARGIN,
        probe_after: int = PROBE_AFTER,
    ) -> None:
        if device_count < 1:
            raise ValueError("the balancer needs at least one device")
        self.device_count = device_count
        self.min_rows = 0 if allow_zero else 1
        self.margin = margin
        self._warmup = warmup
        self._min_steps = min_steps
        self._probe_after = probe_after
        # The current split's recent steps: cleared whenever the split changes.
        self._history: deque[tuple[tuple[int, ...], tuple[float, ...]]] = deque(maxlen=window)
        self.weights: tuple[float, ...] = (1.0 / device_count,) * device_count
        self.changes = 0
        # Each device's last estimate: one left without rows keeps its rate.
        self._rates: list[float | None] = [None] * device_count
        # Per device, its last measurements across splits, for how well time follows rows.
        self._samples = [deque(maxlen=FIT_SAMPLES) for _ in range(device_count)]
        self._idle = [0] * device_count  # steps since each device last got rows
        # A new split on trial: the weights before it and the slowest replica's ms per row then.
        self._trial: tuple[tuple[float, ...], float] | None = None
        # A trial undone, its split and what it measured, while the split before is measured again.
        self._recheck: tuple[tuple[float, ...], float] | None = None
        self._probe: tuple[float, ...] | None = None  # the weights a one-step probe interrupted
        self._hold = 0  # steps left before another split may be tried
        self._hold_ms = 0.0  # the current split's ms per row when the hold began
        self._next_hold = HOLD_STEPS

    def observe(self, chunk_sizes: Sequence[int], times_ms: Sequence[float]) -> BalancePlan | None:
        """Take one step's rows and time per device slot (0 rows: not in that step).

        Returns the plan once there are enough measurements (None before); `changed` is set
        when the balancer adopted new weights, which then hold from the next step on.
        """
        if len(chunk_sizes) != self.device_count or len(times_ms) != self.device_count:
            raise ValueError(f"one chunk size and one time per device ({self.device_count}) expected")
        if self._warmup > 0:
            self._warmup -= 1
            return None
        sizes = tuple(int(n) for n in chunk_sizes)
        times = tuple(float(t) for t in times_ms)
        for i, (n, t) in enumerate(zip(sizes, times)):
            if n > 0:
                self._samples[i].append((n, t))
                self._idle[i] = 0
            else:
                self._idle[i] += 1
        rows = sum(sizes)
        if self._probe is not None:
            # A probe step: its rates count, its split is not the one being judged. Back to it.
            for i, (n, t) in enumerate(zip(sizes, times)):
                if n > 0 and not self._has_rows(i):  # (the others' estimates come from the history)
                    self._rates[i] = t / n
            self.weights, self._probe = self._probe, None
            return self._plan(rows, True)
        self._history.append((sizes, times))
        rates = self.per_row_ms()
        if rates is None:
            return self._start_probe(rows)
        if len(self._history) < self._min_steps:
            return self._plan(rows, False, rates)
        measured = self._measured_ms_per_row()
        if self._trial is not None:
            before, before_ms = self._trial
            self._trial = None
            if measured >= before_ms * (1.0 - self.margin / 2):
                # No faster than the split before measured: go back to it, and measure it again
                # before concluding anything (the load may have changed meanwhile).
                self._recheck = (self.weights, measured)
                return self._adopt(before, rows, rates)
            self._next_hold = HOLD_STEPS
        elif self._recheck is not None:
            trial, trial_ms = self._recheck
            self._recheck = None
            if trial_ms < measured * (1.0 - self.margin):
                # The split before now measures slower than the trial did: the conditions
                # changed, and the trial is the better split under them.
                self._next_hold = HOLD_STEPS
                return self._adopt(trial, rows, rates)
            # The trial really was no faster: keep this split, and wait longer each time.
            self._hold, self._next_hold = self._next_hold, min(2 * self._next_hold, MAX_HOLD_STEPS)
            self._hold_ms = measured
        if self._hold > 0:
            if abs(measured - self._hold_ms) <= LOAD_CHANGE * self._hold_ms:
                self._hold -= 1
                return self._start_probe(rows) or self._plan(rows, False, rates)
            self._hold, self._next_hold = 0, HOLD_STEPS  # the load changed since the hold began
        current = self.predict_ms(rows, self.weights, rates)
        candidate = self._ideal_weights(rates)
        if self.predict_ms(rows, candidate, rates) >= min(current * (1.0 - self.margin), current - MIN_GAIN_MS):
            return self._start_probe(rows) or self._plan(rows, False, rates)
        self._trial = (self.weights, measured)
        return self._adopt(candidate, rows, rates)

    def _adopt(self, weights: tuple[float, ...], rows: int, rates: Sequence[float]) -> BalancePlan:
        self.weights = weights
        self.changes += 1
        # What was measured under the old split says little about the new one's fixed costs.
        self._history.clear()
        return self._plan(rows, True, rates)

    def _start_probe(self, rows: int) -> BalancePlan | None:
        """Give the device longest without rows a share of about one row for the next step, if
        it has waited PROBE_AFTER steps and no trial is being judged; None otherwise."""
        idle = max(range(self.device_count), key=lambda i: (self._idle[i], -i))
        if self._idle[idle] < self._probe_after or self._trial or self._recheck or rows < 1:
            return None
        others = sum(w for i, w in enumerate(self.weights) if i != idle)
        probe = list(self.weights)
        probe[idle] = others / max(rows - 1, 1)  # its share of `rows` is one row
        self._probe, self.weights = self.weights, normalized(probe)
        self._idle[idle] = 0  # one probe per PROBE_AFTER steps, whatever it gets
        return self._plan(rows, True)

    def _plan(self, rows: int, changed: bool, rates: Sequence[float] | None = None) -> BalancePlan:
        rates = self.per_row_ms() if rates is None else rates
        if rates is None:
            return BalancePlan(self.weights, changed, None, None)
        even_rows = even_sizes(rows, self.device_count) + [0] * self.device_count
        even = _slowest(even_rows, rates)
        # Under the even split itself the prediction is what was measured; elsewhere it stands
        # on the per-row model.
        at_even = balanced_sizes(rows, self.weights, self.min_rows) == even_rows[:self.device_count]
        return BalancePlan(self.weights, changed, self.predict_ms(rows, self.weights, rates), even,
                           not at_even and self._fits_badly(rates))

    def _has_rows(self, device: int) -> bool:
        return any(sizes[device] > 0 for sizes, _ in self._history)

    def _fits_badly(self, rates: Sequence[float]) -> bool:
        """Whether the per-row model, with these rates, misses some device's recent measurements
        (at every row count it ran lately, across splits) by more than UNSURE_FIT, as RMS.

        It says a device's time is its rate times its rows. Where time does not follow rows
        (fixed costs) or the load changed, it misses at the row counts the device ran before,
        and a prediction for other row counts, such as the even split's, is a guess.
        """
        limit = UNSURE_FIT * UNSURE_FIT
        for rate, samples in zip(rates, self._samples):
            misses = [((rate * n - t) / t) ** 2 for n, t in samples if t > 0]
            if misses and sum(misses) / len(misses) > limit:
                return True
        return False

    def per_row_ms(self) -> tuple[float, ...] | None:
        """Each device's smoothed time per row; None until every device has run some rows.

        A device without rows in the window keeps its last estimate.
        """
        rows = [0] * self.device_count
        times = [0.0] * self.device_count
        for sizes, spent in self._history:
            for i, (n, t) in enumerate(zip(sizes, spent)):
                if n > 0:
                    rows[i] += n
                    times[i] += t
        for i, n in enumerate(rows):
            if n:
                self._rates[i] = times[i] / n
        if any(r is None for r in self._rates):
            return None
        return tuple(self._rates)

    def _measured_ms_per_row(self) -> float:
        """The slowest replica's time per row of the batch, over the window: the median step's, so
        that one step slowed by something else (a busy machine's late wake-up) does not decide."""
        return statistics.median(max(t) / max(sum(n), 1) for n, t in self._history)

    def predict_ms(self, rows: int, weights: Sequence[float], rates: Sequence[float]) -> float:
        """The slowest replica's predicted time for a batch of `rows` cut by `weights`."""
        return _slowest(balanced_sizes(rows, weights, self.min_rows), rates)

    def _ideal_weights(self, rates: Sequence[float]) -> tuple[float, ...]:
        # Equal finishing times: rows in inverse proportion to each device's time per row.
        speeds = [1.0 / max(r, 1e-9) for r in rates]
        total = sum(speeds)
        return tuple(s / total for s in speeds)


def _slowest(sizes: Sequence[int], rates: Sequence[float]) -> float:
    return max((n * r for n, r in zip(sizes, rates)), default=0.0)


def describe_split(split: Split | None) -> tuple[str, tuple[float, ...], bool]:
    """(kind, weights summing to 1, chosen by the balancer) of a split, for step records."""
    if split is None or (split.chunk_sizes is None and split.weights is None):
        return "even", (), False
    if split.chunk_sizes is not None:
        return "sizes", (), False
    by_balancer = isinstance(split, BalancedSplit)
    return ("auto" if by_balancer else "weights"), normalized(split.weights), by_balancer


def split_options(balance: Balance) -> dict:
    """DataParallel/set_split keyword arguments for a `parse_balance` value."""
    if isinstance(balance, str):
        return {"balance": balance}
    return {"balance": "weights", "weights": list(balance)}


def balance_name(balance: Balance) -> str:
    return balance if isinstance(balance, str) else "weights"


def balance_weights(balance: Balance) -> tuple[float, ...]:
    """The shares of the batch a `parse_balance` value asks for; () for "even" and "auto"."""
    return () if isinstance(balance, str) else normalized(balance)


def normalized(weights: Sequence[float]) -> tuple[float, ...]:
    total = sum(weights)
    return tuple(w / total for w in weights)
