"""DDP ranks a script starts itself, watched under plain `dptui run` as torchrun's ranks are
(rank_bootstrap.py): torch.multiprocessing.spawn (the DDP tutorial's multigpu.py), start_processes with
any start method, and multiprocessing.Process children that call init_process_group.

The watch: torch's DDP swapped for the recording one, and the link to dptui (DPTUI_RANK_CHANNEL,
DPTUI_RANK_TOKEN) opened when the script's init_process_group returns, since only then is the process's
rank known. It reaches the children as they are made:
- fork: dptui run's bootstrap installs the watch in the script's process (`carry_into_spawned_children`);
  a forked child inherits it, forgets what was its parent's (os.register_at_fork) and joins at its own
  init_process_group. The script's process joins only a group of several (it is rank 0 of its children);
- spawn: a fresh interpreter. The bootstrap puts dpengine/script/spawned on PYTHONPATH, so the child
  imports its sitecustomize, which calls `install` before the child unpickles its target;
- forkserver: the server is such a fresh interpreter; its sitecustomize calls `install_in_forkserver`,
  and the children it forks inherit the watch from it, as from a forking script;
- subprocess (Lightning's launcher re-runs the script with LOCAL_RANK and WORLD_SIZE set): a fresh
  interpreter too, whose sitecustomize calls `install_in_started_rank`.
How the child's function ended (script_finished or rank_failed) is said by our wrapper around torch's
spawn wrapper (start_processes' children), around a Process's run (every other child), by the
bootstrap when the script ends (its own process, and a bare os.fork() child that returns into it), or
at os._exit (a bare os.fork() child's usual end).
"""

from __future__ import annotations

import atexit
import functools
import os
import sys

from . import rank_wire

SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "spawned")

_link = None
_ended = False  # this process's end was said: a Process's run around torch's wrapper says it once
_home_pid: int | None = None  # the process that starts ranks (the script's, a forkserver)


def carry_into_spawned_children() -> None:
    """dptui run's bootstrap, when a dptui listens for ranks: the script's children become ranks."""
    channel = os.environ.get(rank_wire.CHANNEL)
    if channel:
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        os.environ["PYTHONPATH"] = os.pathsep.join([SITE_DIR, *paths])
        _watch(channel, os.environ.get(rank_wire.TOKEN, ""), home=os.getpid())


def install() -> None:
    """A spawned child (sitecustomize): it is the rank."""
    _watch(*_take_channel(), home=None)


def install_in_started_rank() -> None:
    """A process the script started with subprocess as a rank (sitecustomize): Python runs the script
    as it would without dptui, so its end is said on the way out: after an uncaught exception 1 (with
    it), else sys.exit's status, else 0."""
    install()
    said_status = [0]
    exit_with, excepthook = sys.exit, sys.excepthook

    def exit(status=None):
        from .run_program import exit_status

        said_status[0] = exit_status(SystemExit(status))
        exit_with(status)

    def uncaught(kind, error, tb):
        say_end(1, error)
        excepthook(kind, error, tb)

    sys.exit, sys.excepthook = exit, uncaught
    atexit.register(lambda: say_end(said_status[0], None))


def install_in_forkserver() -> None:
    """The forkserver (sitecustomize): the children it forks are the ranks."""
    _watch(*_take_channel(), home=os.getpid())


def _take_channel() -> tuple[str, str]:
    channel, token = os.environ.pop(rank_wire.CHANNEL), os.environ.pop(rank_wire.TOKEN, "")
    # This process's spawned children (DataLoader workers) are no ranks.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != SITE_DIR)
    return channel, token


def _watch(channel: str, token: str, home: int | None) -> None:
    global _home_pid
    import multiprocessing.process

    import torch.distributed
    import torch.multiprocessing  # binds torch.multiprocessing.spawn, the module

    if not torch.distributed.is_available():  # a torch built without it: no rank to watch
        return
    from . import ddp_swap, training_hooks
    from .rank_bootstrap import on_process_group, rank_steps

    _home_pid = home

    def joined(said: dict) -> None:
        if os.getpid() == _home_pid and not _is_rank_among_others():
            return
        _join(channel, token)
        if _link is not None:
            _link.post({"type": "process_group", "rank": _link.rank, **said})

    on_process_group(joined)
    ddp_swap.install(lambda clock: rank_steps(_link, clock) if _link is not None else None, _notice)
    spawn = sys.modules["torch.multiprocessing.spawn"]
    spawn._wrap = _watched(spawn._wrap)
    process = multiprocessing.process.BaseProcess
    process._bootstrap = _watched_bootstrap(process._bootstrap)

    def forget_parent() -> None:
        """In a forked child: the parent's link, phase clock and end are the parent's. Its sender is
        a thread the child does not have; the child opens its own link if it joins a process group."""
        global _link, _ended
        _link, _ended = None, False
        ddp_swap.forget_steps()
        training_hooks.forget_listeners()

    os.register_at_fork(after_in_child=forget_parent)


def _is_rank_among_others() -> bool:
    """The script's own process joined a group of several (its children the other ranks): it is a rank.
    Alone, its DDP is one process's, recorded as a DataParallel script's (notices.py says it is not)."""
    import torch.distributed as dist

    return dist.get_world_size() > 1


def _join(channel: str, token: str) -> None:
    global _link
    if _link is not None:
        return
    import torch.distributed as dist

    from .rank_bootstrap import connect, hello

    rank = dist.get_rank()
    _link = connect(channel, hello(token, rank=rank, local_rank=int(os.environ.get("LOCAL_RANK", rank)),
                                   world_size=dist.get_world_size()))
    if _link is not None:
        os._exit = _saying_end(os._exit)


def _saying_end(exit_now):
    """A bare os.fork() child ends with os._exit, past every wrapper: its status is said first."""

    @functools.wraps(exit_now)
    def _exit(status):
        say_end(status, None)
        exit_now(status)

    return _exit


def _notice(text: str) -> None:
    if _link is not None:
        _link.notice(text)


def _watched(wrap):
    """torch's spawn wrapper, with the child's function watched: how it ended goes to dptui."""

    @functools.wraps(wrap)
    def watched_wrap(fn, i, args, *rest):
        return wrap(functools.partial(_run, fn), i, args, *rest)

    return watched_wrap


def _run(fn, *args):
    from .run_program import exit_status

    try:
        fn(*args)
    except SystemExit as done:
        say_end(exit_status(done), None)
        raise
    except BaseException as error:
        say_end(1, error)
        raise
    say_end(0, None)


def _watched_bootstrap(bootstrap):
    """multiprocessing's child entry: the Process's run (the script's target, or its subclass's run) is
    watched, before multiprocessing turns its end into the child's exit status."""

    @functools.wraps(bootstrap)
    def _bootstrap(self, *args, **kwargs):
        self.run = functools.partial(_run, self.run)
        return bootstrap(self, *args, **kwargs)

    return _bootstrap


def say_end(exit_code: int, error: BaseException | None) -> None:
    """How this process's function or script ended, said once if it is a rank."""
    global _ended
    if _ended or _link is None:
        return
    _ended = True
    from .rank_bootstrap import script_ended

    script_ended(_link, exit_code, error)
