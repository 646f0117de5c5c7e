"""9. Logs of long runs: `dptui view` of a 1 GB log, the UI's first screen and memory.

A day of training at 10 steps a second is about 900,000 step events, a gigabyte or two of
JSON Lines. The log is generated once, with the event log's own JSON form (3 virtual
devices, telemetry every 10 steps, an epoch every 1,000 steps), into a cache outside the
repository (`$DPTUI_BENCH_CACHE`, default ~/.cache/dptui-bench/), and reused.

- first screen: `dptui view LOG` in a pseudo-terminal of 120x40, from the command's start to
  the first frame with the recording's status bar (the last step's panels, from the tail);
  memory is the process's peak RSS (VmHWM) then, and again once the whole log is indexed;
- headless and trace: `dptui view --headless` (a streaming sum) and `dptui view --trace` of the
  log's first 100,000 steps, their time and peak RSS (both decode every line: minutes for
  the whole gigabyte on a 2-core machine, in the same memory).

Each is a fresh process with a warm page cache (a first untimed run reads the file in).
Skip the section with `python -m bench --skip view` (or 9); `--quick` uses a 50 MB log.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

from .common import Goal, Row, Section

GIB = 1 << 30
FULL_BYTES, QUICK_BYTES = GIB, 50 << 20
TRACE_STEPS = 100_000
FIRST_SCREEN_S, FIRST_SCREEN_MIB = 2.0, 300  # issue 22's goals
FORMAT_VERSION = 1  # of the generated log: bump when the generator changes
ROOT = Path(__file__).resolve().parent.parent
# The status bar names the run once its run_started and last steps are read (the same frame
# draws the panels); before that it says "… · …".
FIRST_FRAME = "seed · dp".encode()


def cache_dir() -> Path:
    folder = Path(os.environ.get("DPTUI_BENCH_CACHE", Path.home() / ".cache" / "dptui-bench"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


# -- the log --------------------------------------------------------------------------------------


def _templates() -> tuple[dict, dict, dict, dict]:
    """run_started, step, telemetry and epoch objects as the event log writes them."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from ui_fakes import demo_events
    finally:
        sys.path.pop(0)
    from dpengine.eventlog.events import EpochFinished, StepFinished, TelemetrySampled, to_json_dict

    events = demo_events(("cpu:0", "cpu:1", "cpu:2"), epochs=1)
    started = to_json_dict(events[0])
    started["config"]["epochs"] = None
    step = to_json_dict(next(e for e in events if isinstance(e, StepFinished)))
    telemetry = to_json_dict(next(e for e in events if isinstance(e, TelemetrySampled)))
    epoch = to_json_dict(next(e for e in events if isinstance(e, EpochFinished)))
    return started, step, telemetry, epoch


def generate(path: Path, size: int) -> int:
    """Write a log of about `size` bytes; the number of steps in it."""
    started, step, telemetry, epoch = _templates()
    dumps = json.JSONEncoder(separators=(",", ":")).encode
    partial = path.with_suffix(".partial")
    steps = 0
    written = 0
    with open(partial, "w", encoding="utf-8", buffering=1 << 20) as out:
        written += out.write(dumps(started) + "\n")
        while written < size:
            steps += 1
            step["step"] = step["engine"]["step"] = steps
            step["epoch"] = 1 + steps // 1000
            step["step_in_epoch"] = 1 + steps % 1000
            step["steps_in_epoch"] = 1000
            step["loss"] = 1.0 / (1 + 0.001 * steps) + 0.01 * (steps % 7)
            step["seconds"] = steps / 10
            step["samples_per_s"] = 3000.0 + steps % 50
            for i, replica in enumerate(step["replicas"]):
                replica["forward_ms"] = 20.0 + i + 0.01 * (steps % 97)
                replica["backward_ms"] = 30.0 + i + 0.01 * (steps % 89)
            written += out.write(dumps(step) + "\n")
            if steps % 10 == 0:
                written += out.write(dumps(telemetry) + "\n")
            if steps % 1000 == 0:
                epoch["epoch"] = steps // 1000
                written += out.write(dumps(epoch) + "\n")
    partial.rename(path)
    return steps


def cached_log(size: int, steps: int | None = None) -> Path:
    """The generated log of `size` bytes (or its first `steps` steps), made once."""
    name = f"log-v{FORMAT_VERSION}-{size >> 20}MiB" + (f"-{steps}steps" if steps else "") + ".jsonl"
    path = cache_dir() / name
    if path.exists():
        return path
    if steps is None:
        print(f"[bench] generating {path} once ...", file=sys.stderr, flush=True)
        generate(path, size)
        return path
    whole = cached_log(size)
    with open(whole, "rb") as src, open(path.with_suffix(".partial"), "wb") as out:
        seen = 0
        for line in src:
            out.write(line)
            seen += line.startswith(b'{"type":"step"')
            if seen >= steps:
                break
    path.with_suffix(".partial").rename(path)
    return path


# -- measuring a command ----------------------------------------------------------------------


def _peak_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def first_screen(log: Path, timeout: float = 120.0) -> dict[str, float]:
    """`dptui view LOG` in a pty: seconds to the first frame that shows the run (its status bar
    and panels), and to the whole log indexed ("step N of N"), with the peak RSS at each."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "120", "LINES": "40"}
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "tui.cli", "view", str(log)], stdin=slave, stdout=slave,
                            stderr=slave, env=env, cwd=ROOT, start_new_session=True)
    os.close(slave)
    out: dict[str, float] = {}
    seen = b""
    shown = False
    try:
        while time.perf_counter() - started < timeout and "indexed_s" not in out:
            ready, _, _ = select.select([master], [], [], 0.02)
            if ready:
                try:
                    chunk = os.read(master, 1 << 16)
                except OSError:
                    break
                seen = (seen + chunk)[-4096:]
                shown = shown or FIRST_FRAME in seen
            if "first_s" not in out and shown:
                out["first_s"] = time.perf_counter() - started
                out["first_mib"] = _peak_mib(proc.pid)
            if "first_s" in out and re.search(rb"step \d+ of \d+", seen):
                out["indexed_s"] = time.perf_counter() - started
                out["indexed_mib"] = _peak_mib(proc.pid)
    finally:
        os.write(master, b"q")
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        os.close(master)
    return out


def command(args: list[str], timeout: float = 1200.0) -> tuple[float, float]:
    """Seconds and peak RSS (MiB) of `dptui view ARGS`, a process of its own.

    The peak is the process's VmHWM, read until it exits: its rusage would count the memory
    of this process (torch) that the fork held until the exec.
    """
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "tui.cli", "view", *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak = 0.0
    while proc.poll() is None and time.perf_counter() - started < timeout:
        try:
            peak = max(peak, _peak_mib(proc.pid))
        except (OSError, ValueError):
            pass  # exiting
        time.sleep(0.02)
    seconds = time.perf_counter() - started
    if proc.wait() != 0:
        raise RuntimeError(f"dptui view {' '.join(args)} exited {proc.returncode}")
    return seconds, peak


def _warm(path: Path) -> None:
    with open(path, "rb") as file:
        while file.read(1 << 24):
            pass


# -- the section ----------------------------------------------------------------------------------


def run(quick: bool = False) -> Section:
    section = Section(9, "dptui view of a long run's log")
    size = QUICK_BYTES if quick else FULL_BYTES
    log = cached_log(size)
    trace_log = cached_log(size, steps=None if quick else TRACE_STEPS)
    _warm(log)
    mib = log.stat().st_size / (1 << 20)
    case = f"{mib:,.0f} MiB log"
    screens = [first_screen(log) for _ in range(1 if quick else 3)]
    screens.sort(key=lambda s: s.get("first_s", float("inf")))
    screen = screens[len(screens) // 2]  # the median run
    bench = "9 view"
    section.rows += [
        Row(bench, case, "UI: first screen (s)", screen.get("first_s"), "s", n=len(screens)),
        Row(bench, case, "UI: peak RSS at the first screen", screen.get("first_mib"), "MiB"),
        Row(bench, case, "UI: whole log indexed (s)", screen.get("indexed_s"), "s"),
        Row(bench, case, "UI: peak RSS once indexed", screen.get("indexed_mib"), "MiB"),
    ]
    print(f"[bench] 9 first screens: {screens}", file=sys.stderr, flush=True)
    # Streaming, each step decoded: measured on the first 100,000 steps (minutes for the whole GB).
    _warm(trace_log)
    steps = sum(1 for line in open(trace_log, "rb") if line.startswith(b'{"type":"step"'))
    tcase = f"{steps:,} steps ({trace_log.stat().st_size / (1 << 20):,.0f} MiB)"
    headless_s, headless_mib = command(["--headless", str(trace_log)])
    section.rows += [Row(bench, tcase, "--headless summary (s)", headless_s, "s"),
                     Row(bench, tcase, "--headless peak RSS", headless_mib, "MiB")]
    out = cache_dir() / "trace.json"
    trace_s, trace_mib = command(["--trace", str(out), str(trace_log)])
    out.unlink()
    section.rows += [Row(bench, tcase, "--trace export (s)", trace_s, "s"),
                     Row(bench, tcase, "--trace peak RSS", trace_mib, "MiB")]
    first_s, first_mib = screen.get("first_s"), screen.get("first_mib")
    met = first_s is not None and first_s < FIRST_SCREEN_S and first_mib < FIRST_SCREEN_MIB
    section.goals.append(Goal(
        9, f"dptui view of a {mib:,.0f} MiB log: first screen < {FIRST_SCREEN_S:g} s and < {FIRST_SCREEN_MIB} MB",
        (f"{first_s:.2f} s, {first_mib:.0f} MiB peak (median of {len(screens)}); indexed in "
         f"{screen.get('indexed_s', float('nan')):.1f} s, {screen.get('indexed_mib', float('nan')):.0f} MiB; "
         f"{steps:,} steps: --headless {headless_s:.0f} s, {headless_mib:.0f} MiB; --trace {trace_s:.1f} s, "
         f"{trace_mib:.0f} MiB") if first_s is not None else "no first screen within the timeout",
        ("met" if met else "MISSED") if not quick else "measured",
    ))
    return section
