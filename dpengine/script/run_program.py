"""Run a user's program as `python PATH ARGS` / `python -m MODULE ARGS` would: its argv, sys.path[0],
__main__ and __file__, its exit status, and a traceback with none of dptui's frames. Used by the
bootstrap of a DataParallel script and by a DDP rank's (rank_bootstrap)."""

from __future__ import annotations

import atexit
import io
import os
import pkgutil
import runpy
import signal
import sys
import traceback
import types
from collections.abc import Callable


def run_program(argv: list[str]) -> None:
    if argv[0] == "-m":
        module, args = argv[1], argv[2:]
        sys.argv = [module, *args]  # runpy puts the module's file in argv[0]
        sys.path[0] = os.getcwd()  # as `python -m` does
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except ImportError as error:
            if not _from_runpy(error):
                raise  # the module's own import failed: its traceback, as python shows it
            # dptui could not tell without importing its packages: the module is not there.
            print(f"dptui run: error: {error}", file=sys.stderr)
            sys.exit(2)
    else:
        path, args = argv[0], argv[1:]
        sys.argv = [path, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(path))  # as `python PATH` does, not ours
        run_file(path)


def run_file(path: str) -> None:
    """Run a script file as `python PATH` does: `__file__` and its code's file name are absolute (as
    Python makes them since 3.9, so a script that changes directory still finds what is beside it),
    sys.argv[0] stays as given. runpy.run_path keeps a relative path relative, and sets argv[0]."""
    absolute = os.path.abspath(path)
    if pkgutil.get_importer(absolute) is not None or absolute.endswith(".pyc"):  # a directory or zip
        runpy.run_path(path, run_name="__main__")  # file with a __main__.py, or compiled code
        return
    with io.open_code(absolute) as file:
        code = compile(file.read(), absolute, "exec")
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=absolute, __cached__=None, __loader__=None, __package__=None, __spec__=None)
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = main  # as runpy does while the script runs: pickle and spawn find it
    try:
        exec(code, main.__dict__)
    finally:
        sys.modules["__main__"] = saved


def run_script(argv: list[str], ended: Callable[[int, BaseException | None], None] | None = None) -> None:
    """Run the program as `python PATH ARGS` / `python -m MODULE ARGS` would, to its exit status.

    `ended(exit_code, error)` runs first, once: error is None when the script's last line ran or it
    raised SystemExit, else what it raised (its traceback is then printed as Python prints it).
    """
    try:
        run_program(argv)
    except SystemExit as done:
        if ended is not None:
            ended(exit_status(done), None)
        raise  # the interpreter turns it into the status
    except BaseException as error:  # noqa: BLE001 - shown as Python would, minus our frames
        traceback.print_exception(type(error), error, user_frames(error.__traceback__))
        sys.stderr.flush()
        if ended is not None:
            ended(1, error)
        if isinstance(error, KeyboardInterrupt):
            # As Python does: exit handlers, then die of SIGINT so the status says so (130).
            atexit._run_exitfuncs()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        sys.exit(1)
    if ended is not None:
        ended(0, None)


def exit_status(done: SystemExit) -> int:
    """The status the interpreter makes of a SystemExit: None is 0, an int itself, anything else 1."""
    if done.code is None:
        return 0
    return done.code if isinstance(done.code, int) else 1


def _from_runpy(error: BaseException) -> bool:
    """runpy raised it itself, looking for the module (not the module, running)."""
    tb = error.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_filename in (os.path.abspath(runpy.__file__), "<frozen runpy>")


def user_frames(tb):
    """Drop the bootstrap's and runpy's frames from the top, as `python script.py` shows none.

    Ours are absolute paths (`python -m` imports by absolute path); runpy's is frozen or its file.
    """
    ours = (os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>")
    while tb is not None and tb.tb_frame.f_code.co_filename in ours:
        tb = tb.tb_next
    return tb
