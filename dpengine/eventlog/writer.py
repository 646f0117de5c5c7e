"""Write a run's events as JSON Lines, flushed per event so a crash loses at most one step."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import IO, Any

from .events import to_json_dict


class JsonLinesWriter:
    """A subscriber that writes each event as one JSON object per line.

    `encode` turns an event into its JSON dict: dpengine's events by default; `dptui run`
    passes one that also knows the events only it publishes.
    """

    def __init__(self, stream: IO[str], encode: Callable[[Any], dict[str, Any]] = to_json_dict) -> None:
        self._stream = stream
        self._encode = encode
        self._lock = threading.Lock()  # events arrive from several threads (training, telemetry, pipes)

    def __call__(self, event: Any) -> None:
        line = json.dumps(self._encode(event), separators=(",", ":"))
        with self._lock:
            self._stream.write(line + "\n")
            self._stream.flush()
