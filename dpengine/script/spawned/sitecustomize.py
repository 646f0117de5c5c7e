"""On the path of the interpreters a script under `dptui run` starts: watch multiprocessing's spawned
children, those its forkserver forks, and the processes it starts with subprocess as ranks
(LOCAL_RANK and WORLD_SIZE > 1 in their environment: Lightning's own launcher re-runs the script so)
as DDP ranks (dpengine.script.spawned_rank), then run the sitecustomize this one shadows.

Python imports one `sitecustomize`, the first on sys.path; this one does nothing else in a process
that is none of those, or when no dptui listens (DPTUI_RANK_CHANNEL unset).
"""

import importlib.machinery
import importlib.util
import os
import sys

FORKSERVER = "from multiprocessing.forkserver import main"  # the server's `python -c` command


def _watch() -> None:
    spawned = "--multiprocessing-fork" in sys.argv
    forkserver = any(arg.startswith(FORKSERVER) for arg in getattr(sys, "orig_argv", ()))
    started_as_rank = not (spawned or forkserver) and "LOCAL_RANK" in os.environ and _world_size() > 1
    if not (spawned or forkserver or started_as_rank) or not os.environ.get("DPTUI_RANK_CHANNEL"):
        return
    try:
        from dpengine.script import spawned_rank
    except ImportError:  # an interpreter without dptui's packages: nothing to watch with
        return
    if spawned:
        spawned_rank.install()
    elif forkserver:
        spawned_rank.install_in_forkserver()
    else:
        spawned_rank.install_in_started_rank()


def _whole_lines() -> None:
    if os.environ.get("DPTUI_WHOLE_LINES") != "1":
        return
    try:
        from dpengine.script.whole_lines import write_whole_lines
    except ImportError:
        return
    write_whole_lines()


def _world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_whole_lines()
_watch()
_chain()
