"""DDP ranks a script starts itself with torch.multiprocessing.spawn (the DDP tutorial's multigpu.py),
watched under plain `dptui run` as torchrun's ranks are (rank_bootstrap.py).

Spawned children are fresh interpreters the script's swap does not reach. dptui run's bootstrap puts
dpengine/script/spawned on PYTHONPATH (`carry_into_spawned_children`), so each child imports its
sitecustomize, which calls `install` before the child unpickles its target: torch's DDP is swapped
for the recording one, and the link to dptui (DPTUI_RANK_CHANNEL, DPTUI_RANK_TOKEN) opens when the
script's init_process_group returns, since only then is the child's rank known. torch's spawn wrapper
runs the child's function; ours around it says how it ended (script_finished or rank_failed).
"""

from __future__ import annotations

import functools
import os
import sys

from . import rank_wire

SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "spawned")

_link = None


def carry_into_spawned_children() -> None:
    """dptui run's bootstrap: the script's spawned children find the sitecustomize above, when a dptui
    listens for ranks."""
    if os.environ.get(rank_wire.CHANNEL):
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        os.environ["PYTHONPATH"] = os.pathsep.join([SITE_DIR, *paths])


def install() -> None:
    import torch.multiprocessing  # noqa: F401 - binds torch.multiprocessing.spawn, the module

    from . import ddp_swap
    from .rank_bootstrap import on_process_group, rank_steps

    channel, token = os.environ.pop(rank_wire.CHANNEL), os.environ.pop(rank_wire.TOKEN, "")
    # A spawn child's own children (DataLoader workers) are no ranks.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != SITE_DIR)

    def joined(said: dict) -> None:
        _join(channel, token)
        if _link is not None:
            _link.post({"type": "process_group", "rank": _link.rank, **said})

    on_process_group(joined)
    ddp_swap.install(lambda clock: rank_steps(_link, clock) if _link is not None else None, _notice)
    spawn = sys.modules["torch.multiprocessing.spawn"]
    spawn._wrap = _watched(spawn._wrap)


def _join(channel: str, token: str) -> None:
    global _link
    if _link is not None:
        return
    import torch.distributed as dist

    from .rank_bootstrap import connect, hello

    rank = dist.get_rank()
    _link = connect(channel, hello(token, rank=rank, local_rank=int(os.environ.get("LOCAL_RANK", rank)),
                                   world_size=dist.get_world_size()))


def _notice(text: str) -> None:
    if _link is not None:
        _link.notice(text)


def _watched(wrap):
    """torch's spawn wrapper, with the child's function watched: how it ended goes to dptui."""

    @functools.wraps(wrap)
    def watched_wrap(fn, i, args, *rest):
        return wrap(functools.partial(_run, fn), i, args, *rest)

    return watched_wrap


def _run(fn, i, *args):
    from .bootstrap import exit_status
    from .rank_bootstrap import script_ended

    try:
        fn(i, *args)
    except SystemExit as done:
        script_ended(_link, exit_status(done), None)
        raise
    except BaseException as error:
        script_ended(_link, 1, error)
        raise
    script_ended(_link, 0, None)
