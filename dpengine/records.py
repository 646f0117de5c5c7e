"""What the engine recorded about one step: frozen, so it can cross threads as is."""

from __future__ import annotations

from dataclasses import dataclass

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ReplicaRecord:
    """One replica's share of a step."""

    index: int
    device: str  # "cpu:1", "cuda:0"
    chunk_size: int  # rows along the scatter dim
    input_shapes: tuple[Shape, ...]
    output_shapes: tuple[Shape, ...]
    forward_ms: float
    # CPU: bytes of tensors the replica saved for backward. CUDA: memory_allocated after forward.
    memory_bytes: int
    # CUDA only: the device's peak allocation during the step.
    peak_memory_bytes: int | None = None
    # Time spent in this replica's autograd nodes; None until its backward has run.
    backward_ms: float | None = None
    # False when a parallel_apply override ran the replica: forward_ms is then the span of the
    # whole parallel_apply (every replica ran within it) and memory_bytes is 0.
    forward_timed: bool = True
    # Where the replica's phases began, in ms from the step's start (the DataParallel forward's
    # call); None where not recorded (older logs): a timeline then lays phases end to end.
    forward_start_ms: float | None = None
    backward_start_ms: float | None = None


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One forward (and, once it ran, its backward) through DataParallel."""

    step: int  # forward count of this DataParallel, from 1
    dim: int
    batch_size: int  # rows along dim of the first scattered tensor
    input_shapes: tuple[Shape, ...]
    output_shapes: tuple[Shape, ...]
    replicas: tuple[ReplicaRecord, ...]
    scatter_ms: float
    replicate_ms: float
    apply_ms: float
    gather_ms: float
    total_ms: float  # the whole forward, as the caller saw it
    backward_ms: float | None = None  # wall time of the backward over all replicas
    # Whether autograd was on (torch.is_grad_enabled()) when the forward was called: off under
    # torch.no_grad() and torch.inference_mode(), an evaluation's or inference's forward.
    grad: bool = True
    split: str = "even"  # how the batch was cut: even, sizes, weights or auto
    split_weights: tuple[float, ...] = ()  # per device slot, summing to 1 (weights, auto)
    balanced: bool = False  # the auto-balancer chose this split
    # Auto-balance only: the slowest replica's predicted time under torch's even split, and
    # whether that is a guess (the per-row model fits the measurements badly).
    even_ms: float | None = None
    even_ms_unsure: bool = False
    # The engine's phases' starts, in ms from the step's start; None where not recorded.
    scatter_start_ms: float | None = None
    replicate_start_ms: float | None = None
    apply_start_ms: float | None = None
    gather_start_ms: float | None = None
    backward_start_ms: float | None = None
    # `dptui run`: the script's own phases around the step (dpengine.script.dp_phases), as a DDP
    # rank's: input wait since the previous step of this DataParallel ended, and optimizer.step
    # time after its backward, before the next forward. None where not recorded.
    data_ms: float | None = None
    optimizer_ms: float | None = None
    # Where the first of those optimizer steps began, in ms from the DataParallel forward's call, on
    # the host clock (the timeline draws it there); None where no optimizer stepped, or not recorded.
    optimizer_start_ms: float | None = None
    # An evaluation of this DataParallel since its previous step (forwards without grad): from
    # model.eval() or its first such forward to model.train() or its last one's return, on the host
    # clock; counted in the step's other, not its data. None where there was none, or not recorded.
    eval_ms: float | None = None
    # The script's other DataParallels' forwards in that time (a distillation teacher's, a GAN
    # generator's): in the step's other too, not its data. None where there were none, or not recorded.
    others_forward_ms: float | None = None

    @property
    def chunk_sizes(self) -> tuple[int, ...]:
        return tuple(r.chunk_size for r in self.replicas)

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(r.device for r in self.replicas)
