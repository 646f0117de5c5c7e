"""`python -m dpengine.script.rank_bootstrap (PATH | -m MODULE) [ARGS...]`: what torchrun runs on every
rank under `dptui run --nproc-per-node N` (rank_wire.py).

In order: the parent-death signal (the rank's parent is torchrun's agent: if it dies, the rank goes
too); the side channel to dptui (DPTUI_RANK_CHANNEL, with DPTUI_RANK_TOKEN in the hello); torch's
DistributedDataParallel swapped for the recording one (ddp_swap.py) and the phase clock's hooks
(training_hooks.py); then the script, exactly as `python PATH ARGS` would run it (bootstrap.py's
run_script). At its end `script_finished` (its exit status) or `rank_failed` (one line and its
traceback), and the sender is flushed. dptui then knows the script's end from the rank's, so that
an abort in gloo's interpreter teardown after it is reported as such, never as a failure.
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import sys
import traceback

from . import rank_wire

USAGE = ("dpengine.script.rank_bootstrap runs on the ranks that `dptui run --nproc-per-node N SCRIPT.py` "
         "starts through torchrun; run that instead")

# What an empty run means, said when a rank's script ended well without a step recorded.
NO_DDP = ("the script built no torch.nn.parallel.DistributedDataParallel nor FSDP, so dptui recorded no step: it "
          "records the optimizer steps of DDP and FSDP (fully_shard, FullyShardedDataParallel), not gradients the "
          "script all-reduces itself")
NO_STEP = ("the script built a DistributedDataParallel or FSDP but trained no step through it (a forward with "
           "gradients enabled, then backward or optimizer.step), so dptui recorded no step")


def main() -> None:
    argv = sys.argv[1:]
    if not argv or argv == ["-m"] or rank_wire.CHANNEL not in os.environ or rank_wire.TOKEN not in os.environ:
        sys.exit(f"rank_bootstrap: {USAGE}")
    from .keeper import die_with_parent

    die_with_parent(os.getppid(), signal.SIGKILL)  # torchrun's agent: a rank never outlives it
    from .whole_lines import write_whole_lines

    write_whole_lines()
    env = os.environ
    local_rank = int(env.get("LOCAL_RANK", 0))
    link = connect(env.pop(rank_wire.CHANNEL), hello(
        env.pop(rank_wire.TOKEN), rank=int(env.get("RANK", 0)), local_rank=local_rank,
        world_size=int(env.get("WORLD_SIZE", 1)), node_rank=int(env.get("GROUP_RANK", 0)),
        restart=int(env.get("TORCHELASTIC_RESTART_COUNT", 0))))
    if link is not None:
        from . import ddp_swap

        ddp_swap.install(lambda clock: rank_steps(link, clock), link.notice)
        on_process_group(lambda said: link.post({"type": "process_group", "rank": link.rank, **said}))
    from .run_program import run_script

    run_script(argv, lambda exit_code, error: script_ended(link, exit_code, error))


def hello(token: str, *, rank: int, local_rank: int, world_size: int, node_rank: int = 0, restart: int = 0) -> dict:
    import torch

    # device_count, not is_available: it asks NVML, so a process that forks CUDA ranks after it joined
    # (the script's own, as rank 0) can still fork them, as under plain python.
    device = f"cuda:{local_rank}" if local_rank < torch.cuda.device_count() else "cpu"
    return {"token": token, "rank": rank, "local_rank": local_rank, "world_size": world_size,
            "node_rank": node_rank, "host": socket.gethostname(), "pid": os.getpid(), "device": device,
            "restart": restart}


def connect(address: str, hello: dict):
    """The rank's link to dptui, or None (said in one line) if dptui cannot be reached."""
    from .rank_link import RankLink

    try:
        return RankLink.connect(address, hello)
    except (OSError, ValueError) as error:
        print(f"dptui: rank {hello['rank']} cannot reach dptui at {address} ({error}); it trains unrecorded",
              file=sys.stderr)
        return None


def on_process_group(then) -> None:
    """`then({"backend", "timeout_s"})` each time the script's init_process_group returns: the
    collective timeout it chose (None: torch's default for the backend), for dptui's pause notice."""
    import torch.distributed as dist

    c10d = sys.modules["torch.distributed.distributed_c10d"]
    init = c10d.init_process_group

    @functools.wraps(init)
    def init_process_group(*args, **kwargs):
        result = init(*args, **kwargs)
        timeout = kwargs.get("timeout")
        then({"backend": str(dist.get_backend()),
              "timeout_s": timeout.total_seconds() if hasattr(timeout, "total_seconds") else None})
        return result

    c10d.init_process_group = init_process_group
    dist.init_process_group = init_process_group


def rank_steps(link, clock):
    """The rank's phase clock, made when the script builds its first DDP (which chooses the clock)."""
    from . import training_hooks
    from .step_phases import HELD_AT_MOST_S, RankSteps

    steps = RankSteps(link.rank, clock, link.post_step, link.before_step, release_after_s=HELD_AT_MOST_S)
    training_hooks.listen(steps)
    return steps


def script_ended(link, exit_code: int, error: BaseException | None) -> None:
    """The last step, then how the script ended, flushed: before the interpreter's teardown."""
    if link is None:
        return
    from . import ddp_swap

    steps = ddp_swap.current_steps()
    if steps is not None:
        steps.finish()
    if error is None and exit_code == 0:
        unseen = NO_DDP if steps is None else NO_STEP if not steps.started else None
        if unseen is not None:
            link.notice(unseen)  # the hub says it once for every rank
    if error is None:
        link.script_finished(exit_code)
    else:
        from .run_program import user_frames

        # The script's frames only, as on its stderr: none of the bootstrap's or runpy's.
        text = "".join(traceback.format_exception(type(error), error, user_frames(error.__traceback__)))
        line = f"{type(error).__name__}: {error}".splitlines()[0] if str(error) else type(error).__name__
        link.rank_failed(socket.gethostname(), line, text)
    link.flush()


if __name__ == "__main__":
    main()
