"""Run-ahead on a GPU: does the host queue work ahead of the device under dpengine as under torch?

For torch.nn.DataParallel and dpengine.DataParallel around one large Linear (every visible GPU),
STEPS forwards under no_grad, then STEPS training steps (forward and backward), are launched back
to back without a sync. host: seconds until the last launch returns; device: seconds that CUDA
events measure from before the first launch to the end of the last kernel. host/device near 0:
the host ran ahead, waiting for nothing (what torch's DataParallel keeps); near 1: it waited for
the GPU at every step. The check passes when dpengine's ratio is within MARGIN of torch's.

    python3 scripts/gpu_runahead.py OUT.json
    python3 scripts/gpu_runahead.py --cpu-dry-run OUT.json   # the same code on virtual CPU devices

A dry run measures nothing (no events: device time is taken as host time); it only runs the code.
Exit status 1 when the check fails on a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, without installing

from dpengine import DataParallel  # noqa: E402

STEPS = 20
MARGIN = 0.2  # dpengine's host/device may exceed torch's by this much


def _time(dp: nn.Module, x: torch.Tensor, grad: bool, cuda: bool) -> tuple[float, float]:
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    began = time.perf_counter()
    with torch.set_grad_enabled(grad):
        for _ in range(STEPS):
            out = dp(x)
            if grad:
                out.sum().backward()
    host = time.perf_counter() - began
    if not cuda:
        return host, host
    end.record()
    end.synchronize()
    return host, start.elapsed_time(end) / 1000.0


def measure(dry_run: bool) -> list[dict]:
    cuda = not dry_run
    if cuda:
        devices: list = list(range(torch.cuda.device_count()))
        features, rows, where = 8192, 8192, torch.device("cuda", 0)
    else:
        devices, features, rows, where = ["cpu:0", "cpu:1"], 256, 64, torch.device("cpu")
    torch.manual_seed(0)
    model = nn.Linear(features, features).to(where)
    x = torch.randn(rows, features, device=where)
    candidates = {
        "torch": torch.nn.DataParallel(model, device_ids=devices if cuda else None),
        "dpengine": DataParallel(model, device_ids=devices),
    }
    results = []
    for grad in (False, True):
        for name, dp in candidates.items():
            _time(dp, x, grad, cuda)  # warm-up: workers, allocator, cuBLAS
            host, device = _time(dp, x, grad, cuda)
            results.append({"candidate": name, "grad": grad, "steps": STEPS, "host_s": host,
                            "device_s": device, "host_over_device": host / device})
    candidates["dpengine"].close()
    return results


def verdicts(results: list[dict]) -> list[tuple[bool, str]]:
    lines = []
    for grad in (False, True):
        ratio = {r["candidate"]: r["host_over_device"] for r in results if r["grad"] == grad}
        ok = ratio["dpengine"] <= ratio["torch"] + MARGIN
        lines.append((ok, f"{'training steps' if grad else 'no_grad forwards'}: host/device "
                          f"torch {ratio['torch']:.3f}, dpengine {ratio['dpengine']:.3f}"))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="where to write the measurements (JSON)")
    parser.add_argument("--cpu-dry-run", action="store_true", help="run the code on virtual CPU devices")
    args = parser.parse_args(argv)
    if not args.cpu_dry_run and not torch.cuda.is_available():
        print("gpu_runahead: no CUDA device (use --cpu-dry-run to run the code on the CPU)", file=sys.stderr)
        return 2
    results = measure(args.cpu_dry_run)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    failed = False
    for ok, line in verdicts(results):
        verdict = "dry run" if args.cpu_dry_run else ("ok" if ok else "FAIL: dpengine waits for the GPU")
        print(f"run-ahead, {line}: {verdict}")
        failed |= not ok and not args.cpu_dry_run
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
