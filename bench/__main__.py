"""`python -m bench`: run the suite, print a markdown table, write it to bench/results.md.

    python -m bench                 # everything (the GPU part skips without CUDA)
    python -m bench --only 1,3      # some benchmarks, by number or name
    python -m bench --gpu-only      # just 7, for a machine with a GPU
    python -m bench --quick         # fewer rounds: a smoke test, not a measurement
    python -m bench --skip view     # all but some (9, view: generates a 1 GB log once, in ~/.cache)
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from pathlib import Path

from .common import Goal, LoadMeter, Section, machine, render

BENCHES = {
    1: ("dispatch", "dispatch overhead"),
    2: ("compute", "compute-bound MLP"),
    3: ("training", "full training steps"),
    4: ("recording", "recording cost"),
    5: ("ui", "UI cost"),
    6: ("memory", "peak memory"),
    7: ("gpu", "GPU: dpengine vs torch.nn.DataParallel"),
    8: ("balance", "auto-balance"),
    9: ("view", "dptui view of a long run's log"),
    10: ("ddp_ranks", "DDP ranks: recording overhead"),
}
DEFAULT_OUT = Path(__file__).with_name("results.md")


def _select(text: str | None) -> list[int]:
    if not text:
        return list(BENCHES)
    chosen = []
    for part in text.split(","):
        part = part.strip()
        matches = [n for n, (name, _) in BENCHES.items() if part in (str(n), name)]
        if not matches:
            raise SystemExit(f"bench: unknown benchmark {part!r}; expected 1-{len(BENCHES)} or one of "
                             f"{', '.join(name for name, _ in BENCHES.values())}")
        chosen += matches
    return sorted(set(chosen))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help=f"comma-separated benchmark numbers or names (1-{len(BENCHES)})")
    parser.add_argument("--skip", help="comma-separated benchmark numbers or names to leave out")
    parser.add_argument("--gpu-only", action="store_true", help="run only 7 (GPU)")
    parser.add_argument("--quick", action="store_true", help="few rounds: checks the suite runs")
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                        help="before each benchmark wait up to S seconds for other processes to go quiet")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"markdown file (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    selected = [7] if args.gpu_only else _select(args.only)
    if args.skip:
        selected = [n for n in selected if n not in _select(args.skip)]

    info = machine()
    started = time.perf_counter()
    sections: list[Section] = []
    failed = False
    meter = LoadMeter()
    for number in selected:
        module_name, title = BENCHES[number]
        if args.wait_quiet > 0:
            others = meter.wait_quiet(args.wait_quiet)
            print(f"[bench] other load before {number}: {others:.2f} cores", file=sys.stderr, flush=True)
        print(f"[bench] {number} {title} ...", file=sys.stderr, flush=True)
        meter.start()
        t0 = time.perf_counter()
        try:
            module = importlib.import_module(f".{module_name}", __package__)
            section = module.run(quick=args.quick)
        except Exception as error:  # one broken benchmark must not hide the others
            failed = True
            traceback.print_exc()
            section = Section(number, title)
            section.goals.append(Goal(number, title, f"{type(error).__name__}: {error}", "error"))
        section.seconds = time.perf_counter() - t0
        section.others_cores = meter.stop()
        print(f"[bench] {number} done in {section.seconds:.0f} s", file=sys.stderr, flush=True)
        sections.append(section)

    text = render(sections, info, time.perf_counter() - started, argv)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"[bench] written to {args.out}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
