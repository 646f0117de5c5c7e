"""A script's output as dptui shows it: lines as a terminal would, progress bars, escape sequences."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from rich.text import Text

from tui.script.output_lines import OutputLines, read_lines
from tui.script.safe_text import safe_text


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def collect(clock: Clock) -> tuple[OutputLines, list[tuple[str, bool]]]:
    out: list[tuple[str, bool]] = []
    return OutputLines(lambda line, cr: out.append((line, cr)), interval=0.25, clock=clock), out


class BrokenCopy(io.BytesIO):
    def write(self, data) -> int:
        raise OSError("the terminal went away")


def test_read_lines_feeds_a_pipe_to_the_end_copying_each_chunk_until_the_copy_fails():
    for copy in (io.BytesIO(), BrokenCopy()):
        read_fd, write_fd = os.pipe()
        out: list[tuple[str, bool]] = []
        reader = threading.Thread(target=read_lines, args=(os.fdopen(read_fd, "rb"),
                                                            OutputLines(lambda line, cr: out.append((line, cr))), copy))
        reader.start()
        os.write(write_fd, b"first\nsec")
        os.write(write_fd, b"ond\nleft open")
        os.close(write_fd)
        reader.join(timeout=10)
        assert not reader.is_alive()
        assert out == [("first", False), ("second", False), ("left open", False)]  # a failed copy loses no line
        assert copy.getvalue() == (b"" if isinstance(copy, BrokenCopy) else b"first\nsecond\nleft open")


def test_lines_pass_as_written_and_a_line_left_open_ends_with_the_stream():
    clock = Clock()
    lines, out = collect(clock)
    lines.feed(b"one  \ntw")
    lines.feed(b"o\r\nthr\xc3")  # \r\n is a newline; a character cut between two reads is whole
    lines.feed(b"\xa9e")
    lines.close()
    assert out == [("one  ", False), ("two", False), ("thr\u00e9e", False)]


def test_a_redrawn_line_is_handed_on_as_it_stands_at_most_every_interval_then_as_a_line():
    clock = Clock()
    lines, out = collect(clock)
    lines.feed(b"\r  0%|")  # its first state at once
    lines.feed(b"\r 10%|#")  # too soon: held
    clock.now = 0.1
    lines.feed(b"\r 20%|##")
    assert out == [("  0%|", True)]
    assert lines.due() == 0.25  # the reader wakes up for it, though nothing more is written
    clock.now = 0.25
    lines.tick()
    lines.tick()  # nothing new: nothing again
    lines.feed(b"\r100%|####|\n")
    assert out == [("  0%|", True), (" 20%|##", True), ("100%|####|", False)]


def test_a_redraw_overwrites_from_the_lines_start_as_a_terminal_does():
    clock = Clock()
    lines, out = collect(clock)
    lines.feed(b"epoch 1: 100 batches\rEPOCH")
    lines.feed(b"\r")  # held: the start of a \r\n, it turns out
    lines.feed(b"\nnext\n")
    assert out == [("EPOCH 1: 100 batches", True), ("EPOCH 1: 100 batches", False), ("next", False)]


def test_backspaces_move_back_and_overwrite_as_on_a_terminal():
    # kuangliu/pytorch-cifar utils.progress_bar: bar, message, padding to the terminal's width,
    # backspaces to the bar's middle, ' 2/3 ', then \r (a newline after the last batch).
    clock = Clock()
    lines, out = collect(clock)
    bar = " [==>....] | Loss: 1.5" + " " * 10
    lines.feed((bar + "\b" * 26 + " 2/3 " + "\r").encode())
    lines.feed(b"\b\b\bno\n")  # never further back than the line's start
    expected = " [==>. 2/3 | Loss: 1.5"  # back to column 6 of 32, five characters written over
    assert out == [(expected, True), ("no" + expected[2:], False)]


def test_a_line_without_end_is_handed_on_in_pieces():
    clock = Clock()
    lines, out = collect(clock)
    lines.feed(b"x" * (1 << 16) + b"tail")
    lines.close()
    assert [(len(line), cr) for line, cr in out] == [(1 << 16, False), (4, False)]


def test_escape_sequences_show_as_text_and_sgr_colours_stay_colours():
    text = safe_text("\x1b]0;title\x07 \x1b[2J\x1b[1;31mred\x1b[0m \x9b tab\t\x7f", style="bold")
    assert text.plain == "^[]0;title^G ^[[2Jred <U+009B> tab\t^?"
    assert isinstance(text, Text) and text.style == "bold"
    [span] = text.spans
    assert text.plain[span.start:span.end] == "red" and span.style.color.number == 1 and span.style.bold
    assert safe_text("plain \x08").plain == "plain ^H"


def test_processes_sharing_the_scripts_stdout_under_dptui_run_print_whole_lines():
    # Unbuffered, print writes the text and its newline apart: ranks sharing the pipe interleaved
    # mid-line (`rank 1 done: 6 stepsrank 0 done: 6 steps`, then an empty line).
    script = Path(__file__).parent / "fixtures" / "scripts" / "shared_pipe_printers.py"
    done = subprocess.run([sys.executable, "-m", "tui.cli", "run", "--headless", "--json", "--no-telemetry",
                           str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [e["line"] for e in map(json.loads, done.stdout.splitlines())
             if e["type"] == "output" and e["stream"] == "stdout"]
    assert sorted(lines) == sorted(f"process {p} line {i}" for p in range(3) for i in range(300))
