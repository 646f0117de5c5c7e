"""Write a run's events as JSON Lines, flushed per event so a crash loses at most one step."""

from __future__ import annotations

import json
import threading
from typing import IO

from .events import Event, to_json_dict


class JsonLinesWriter:
    """A subscriber that writes each event as one JSON object per line."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._lock = threading.Lock()  # telemetry events arrive from their own thread

    def __call__(self, event: Event) -> None:
        line = json.dumps(to_json_dict(event), separators=(",", ":"))
        with self._lock:
            self._stream.write(line + "\n")
            self._stream.flush()
