"""`dptui run --nproc-per-node N [torchrun's options] [OPTIONS] (SCRIPT.py | -m MODULE) [ARGS...]`.

A DDP script's ranks under torch's own launcher, watched: live rank panels and the straggler
verdict, or with --headless each rank's output as under torchrun and a per-rank summary at the end.
Bad input is one line on stderr and exit 2 before anything starts. Exit status: 0 when every rank
succeeded; else that of torchrun's first failure (128+N for signal N); 130 after Ctrl-C, 143 after SIGTERM.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..usage import EXIT_USAGE, Parser, UsageError, check_json_output, number, open_log
from .ddp_launch import DdpLaunch, parse_launch, split_options
from .ddp_run import DdpRun
from .run_args import DDP_USAGE, add_grace, add_summary, parse_target
from .run_output import json_lines, run_app, run_headless, watch_figures

# dptui's own options here, each with whether it takes a value; every other option is torchrun's.
OPTIONS = {"--headless": False, "--json": False, "--log": True, "--summary": True, "--grace": True, "--telemetry-interval": True,
           "--no-telemetry": False, "-h": False, "--help": False}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="dptui run", usage=DDP_USAGE,
        description="Run your DistributedDataParallel script unchanged under torchrun (python -m "
        "torch.distributed.run), with every rank's steps recorded: phases, loss, memory, and which rank "
        "is the straggler and why. Options before the script that are not listed here are torchrun's "
        "and mean what they mean to torchrun (--nproc-per-node, --nnodes, --node-rank, --master-addr, "
        "--master-port, --standalone, --max-restarts, --rdzv-*, ...).",
        epilog="Exit status: 0 when every rank succeeds; else that of torchrun's first failure (128+N for signal N); "
        "130 after Ctrl-C, 143 after SIGTERM; 2 bad usage.",
    )
    parser.add_argument("--headless", action="store_true",
                        help="no UI: each rank's output as under torchrun, a per-rank summary at the end")
    parser.add_argument("--json", action="store_true",
                        help='with --headless: JSON Lines events on stdout, the ranks\' output as {"type": '
                        '"output", "rank": R, ...} events')
    parser.add_argument("--log", metavar="FILE", help="write the run's events as JSON Lines to FILE")
    add_summary(parser)
    parser.add_argument("--telemetry-interval", type=number("telemetry interval", at_least=0.2),
                        default=1.0, metavar="S", help="seconds between samples of each rank's device or "
                        "process, >= 0.2 (default 1)")
    parser.add_argument("--no-telemetry", action="store_true", help="do not sample the ranks")
    add_grace(parser)
    return parser


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, DdpLaunch]:
    ours, torchrun, rest = split_options(argv, OPTIONS)
    args = build_parser().parse_args(ours)
    check_json_output(args)
    target = parse_target(rest, args.log, None, args.summary)
    launch = parse_launch(torchrun, target)
    if launch.several_nodes and launch.node_rank != 0 and not args.headless:
        raise UsageError(f"--node-rank {launch.node_rank}: nodes other than 0 run headless (add --headless); "
                         "node 0's dptui shows every rank")
    return args, launch


def main(argv: Sequence[str]) -> int:
    try:
        args, launch = parse(argv)
        log = open_log(args.log) if args.log else None
    except UsageError as error:
        print(f"dptui run: error: {error}", file=sys.stderr)
        return EXIT_USAGE

    capture = not args.headless or args.json
    run = DdpRun(launch, capture_output=capture, grace_s=args.grace,
                 pass_stderr_to=None if capture else sys.stderr.buffer,
                 telemetry_interval=None if args.no_telemetry else args.telemetry_interval)
    figures = watch_figures(run)
    try:
        if log is not None:
            run.subscribe(json_lines(log))
        if not args.headless:
            code = run_app(run)
            return run.exit_code if run.exit_code is not None else code
        # through torchrun, to every rank
        return run_headless(run, json_out=args.json, stop=run.stop, figures=figures)
    finally:
        run.kill()  # never leave torchrun or a rank behind, whatever happened here
        figures.write(args.summary, "dptui run")
        if log is not None:
            log.close()
