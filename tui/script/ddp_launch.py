"""`dptui run --nproc-per-node N ... SCRIPT.py ARGS`: the torchrun command line behind it.

Every option before the script that is not dptui's is torchrun's and reaches torchrun as given
(`--rdzv-*`, `--nproc-per-node gpu`, ...): torch's own parser says which they are and which take a
value, so they mean exactly what they mean to torchrun. The ranks run dptui's bootstrap, which runs
the script as `python SCRIPT.py` would (dpengine/script/rank_bootstrap.py).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from dpengine.script.rank_wire import BOOTSTRAP_MODULE

from ..usage import UsageError
from .target import ScriptTarget

NPROC_FLAGS = ("--nproc-per-node", "--nproc_per_node")
# How torchrun marks each line of a rank's output with the rank (--tee and this template): its global rank.
LINE_PREFIX_TEMPLATE = "[dptui-rank ${rank}]:"
LINE_PREFIX_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
# torchrun options that decide where the ranks' output goes: given by the user, dptui leaves it to them.
_OUTPUT_DESTS = frozenset({"tee", "redirects", "local_ranks_filter"})
_NOT_WITH_DPTUI = {"no_python": "--no-python", "run_path": "--run-path"}  # the ranks must run dptui's bootstrap


@dataclass(frozen=True)
class DdpLaunch:
    """What torchrun is asked for, and what dptui needs to know of it."""

    torchrun_args: tuple[str, ...]  # as given, in order
    target: ScriptTarget
    nproc_per_node: str  # as given: "2", or torchrun's "gpu", "cpu", "auto"
    nnodes: str  # "M" or "MIN:MAX"
    node_rank: int
    master_addr: str
    master_port: int | None
    standalone: bool
    max_restarts: int
    rdzv_id: str
    rdzv_endpoint: str
    output_is_users: bool  # --tee / --redirects / --local-ranks-filter given: lines carry no rank dptui can read
    bootstrap: str = BOOTSTRAP_MODULE  # what each rank runs first (tests put a rank of their own here)

    @property
    def world_size(self) -> int | None:
        """Ranks in all, when the flags say (not with --nproc-per-node gpu or elastic --nnodes MIN:MAX)."""
        if not self.nproc_per_node.isdigit() or not self.nnodes.isdigit():
            return None
        return int(self.nproc_per_node) * int(self.nnodes)

    @property
    def several_nodes(self) -> bool:
        return self.nnodes != "1" and self.nnodes != "1:1"

    def argv(self, tag_lines: bool) -> list[str]:
        """The launcher's command; `tag_lines`: each rank's output line carries its rank (--tee)."""
        tee = ["--tee", "3"] if tag_lines and not self.output_is_users else []
        head = ["-m", self.target.program] if self.target.module else [self.target.program]
        return [sys.executable, "-m", "torch.distributed.run", *self.torchrun_args, *tee,
                "-m", self.bootstrap, *head, *self.target.args]


def _torchrun_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()

    def error(message: str) -> None:
        raise UsageError(f"torchrun's options: {message}")

    parser.error = error  # one line and exit 2, from the caller, never argparse's usage text
    return parser


def _takes_value(action: argparse.Action) -> bool:
    return action.nargs != 0


def ddp_requested(argv: Sequence[str], dptui_value_options: frozenset[str]) -> bool:
    """Whether the options before the script ask for ranks (--nproc-per-node), read without importing torch."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--", "-m") or not arg.startswith("-"):
            return False
        name, has_value = arg.split("=", 1)[0], "=" in arg
        if name in NPROC_FLAGS:
            return True
        # An option we do not know here may take a value: a bare word after it is not yet the script.
        takes = name in dptui_value_options or name not in _DPTUI_FLAGS
        if takes and not has_value and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            i += 2
        else:
            i += 1
    return False


_DPTUI_FLAGS = frozenset({"--headless", "--json", "--no-telemetry", "--standalone", "-h", "--help"})


def split_options(argv: Sequence[str], dptui_options: dict[str, bool]) -> tuple[list[str], list[str], list[str]]:
    """dptui's options, torchrun's options, then the program and its arguments (never parsed by us).

    `dptui_options`: dptui's option names, each with whether it takes a value.
    """
    actions = _torchrun_parser()._option_string_actions
    ours: list[str] = []
    torchrun: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return ours, torchrun, list(argv[i + 1:])
        if arg in ("-m", "--module") or not arg.startswith("-"):
            return ours, torchrun, list(argv[i:])
        name, has_value = arg.split("=", 1)[0], "=" in arg
        if name in dptui_options:
            width = 2 if dptui_options[name] and not has_value else 1
            ours += argv[i:i + width]
        elif name in actions:
            width = 2 if _takes_value(actions[name]) and not has_value else 1
            torchrun += argv[i:i + width]
        else:
            raise UsageError(f"unknown option {arg}: neither dptui's (dptui run --help) nor torchrun's "
                             "(python -m torch.distributed.run --help)")
        if i + width > len(argv):
            raise UsageError(f"{arg} needs a value")
        i += width
    return ours, torchrun, []


def parse_launch(torchrun_args: Sequence[str], target: ScriptTarget) -> DdpLaunch:
    """torchrun's options read by torchrun's own parser, and the combinations dptui refuses: a UsageError."""
    args = _torchrun_parser().parse_args([*torchrun_args, "script.py"])
    for dest, flag in _NOT_WITH_DPTUI.items():
        if getattr(args, dest):
            raise UsageError(f"{flag}: dptui runs each rank through its own Python bootstrap; leave {flag} out")
    nproc = str(args.nproc_per_node)
    if not (nproc.isdigit() and int(nproc) > 0) and nproc not in ("gpu", "cpu", "auto", "xpu"):
        raise UsageError(f"--nproc-per-node {nproc}: give a whole number of ranks >= 1, or gpu, cpu or auto")
    nnodes = str(args.nnodes)
    bounds = nnodes.split(":")
    if not (1 <= len(bounds) <= 2 and all(b.isdigit() and int(b) > 0 for b in bounds)):
        raise UsageError(f"--nnodes {nnodes}: give a number of nodes >= 1, or MIN:MAX")
    node_rank = _int("--node-rank", args.node_rank, 0)
    max_restarts = _int("--max-restarts", args.max_restarts, 0)
    port = None if args.master_port is None else _int("--master-port", args.master_port, 1)
    if port is not None and port > 65535:
        raise UsageError(f"--master-port {port}: give a port from 1 to 65535")
    if args.standalone and nnodes not in ("1", "1:1"):
        raise UsageError(f"--standalone runs one node; it cannot go with --nnodes {nnodes}")
    if bounds[-1].isdigit() and node_rank >= int(bounds[-1]):
        raise UsageError(f"--node-rank {node_rank}: nodes are numbered from 0 to {int(bounds[-1]) - 1} "
                         f"with --nnodes {nnodes}")
    return DdpLaunch(
        torchrun_args=tuple(torchrun_args), target=target, nproc_per_node=nproc, nnodes=nnodes,
        node_rank=node_rank, master_addr=str(args.master_addr), master_port=port, standalone=bool(args.standalone),
        max_restarts=max_restarts, rdzv_id=str(args.rdzv_id), rdzv_endpoint=str(args.rdzv_endpoint or ""),
        output_is_users=any(str(getattr(args, dest) or "") not in ("", "0") for dest in _OUTPUT_DESTS),
    )


def _int(flag: str, value: object, minimum: int) -> int:
    try:
        number = int(str(value))
    except ValueError:
        raise UsageError(f"{flag} {value}: give a whole number >= {minimum}") from None
    if number < minimum:
        raise UsageError(f"{flag} {value}: give a whole number >= {minimum}")
    return number
