"""Check a dptui JSON Lines event file from a GPU run: steps timed, telemetry named by NVML.

    python3 scripts/gpu_events_check.py EVENTS.jsonl [--steps N] [--nvml] [--starts]

- every `step` event's replicas have forward_ms > 0 (CUDA events were read);
- with --steps N: exactly N `step` events (a script's every step published, the last one too);
- with --starts (a DataParallel's steps): each step has its phases' starts, measured with CUDA
  events against the step's reference event (issue 22.2): the engine's four and, per replica,
  forward_start_ms, and backward_start_ms where it has a backward_ms;
- with --nvml: `telemetry` events came, and each sample names its GPU (not torch's stand-in
  "GPU") and misses no device ("NVML unavailable", "no NVML device matches" ...).
Prints one line per check; exit status 1 when one fails.
"""

from __future__ import annotations

import argparse
import json
import sys


def _has_starts(step: dict) -> bool:
    def number(value) -> bool:
        return isinstance(value, (int, float)) and value >= 0

    engine = step.get("engine") or {}
    return (all(number(engine.get(f"{phase}_start_ms")) for phase in ("scatter", "replicate", "apply", "gather"))
            and all(number(r.get("forward_start_ms")) for r in step["replicas"])
            and all(number(r.get("backward_start_ms")) for r in step["replicas"] if r.get("backward_ms") is not None))


def check(events: list[dict], steps: int | None, nvml: bool, starts: bool = False) -> list[tuple[bool, str]]:
    step_events = [e for e in events if e["type"] == "step"]
    results = []
    untimed = [e["step"] for e in step_events if not all((r["forward_ms"] or 0) > 0 for r in e["replicas"])]
    results.append((bool(step_events) and not untimed,
                    f"{len(step_events)} steps, forward_ms > 0 on all but {len(untimed)} (steps {untimed[:5]})"))
    if steps is not None:
        results.append((len(step_events) == steps, f"{len(step_events)} steps published, {steps} expected"))
    if starts:
        missing = [e["step"] for e in step_events if not _has_starts(e)]
        results.append((bool(step_events) and not missing,
                        f"phase starts on all but {len(missing)} steps (steps {missing[:5]})"))
    if nvml:
        samples = [s for e in events if e["type"] == "telemetry" for s in e["samples"]]
        names = sorted({s["name"] for s in samples})
        bad = sorted({f"{s['device']}: {s['missing']['device']}" for s in samples if "device" in s["missing"]})
        named = bool(samples) and not bad and "GPU" not in names
        results.append((named, f"{len(samples)} telemetry samples, names {names}, missing {bad[:3]}"))
    failed = [e for e in events if e["type"] in ("run_failed", "script_exited") and e.get("code", 1) != 0]
    results.append((not failed, f"run failed: {failed[0]}" if failed else "the run ended well"))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("events", help="a JSON Lines file written by dptui --headless --json (or --log)")
    parser.add_argument("--steps", type=int, help="the number of step events expected")
    parser.add_argument("--nvml", action="store_true", help="require telemetry named by NVML")
    parser.add_argument("--starts", action="store_true", help="require the phases' start times (DataParallel)")
    args = parser.parse_args(argv)
    with open(args.events, encoding="utf-8") as file:
        events = [json.loads(line) for line in file if line.strip()]
    results = check(events, args.steps, args.nvml, args.starts)
    for ok, line in results:
        print(f"{'ok' if ok else 'FAIL'}: {line}")
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
