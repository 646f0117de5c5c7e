"""Samples a telemetry source on its own daemon thread, so neither the UI nor training waits on NVML."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from types import TracebackType

from .base import TelemetrySource
from .sample import DeviceSample

# NVML's utilisation and power are 1/6..1 s averages: polling faster only costs.
MIN_INTERVAL = 0.2

log = logging.getLogger(__name__)


class TelemetryPoller:
    """Calls `callback(source.sample())` every `interval` seconds from thread "dptui-telemetry".

    The callback runs on that thread. Errors from the source or the callback are logged, kept in
    `last_error`, and polling goes on. The poller does not close the source: its owner does.
    """

    def __init__(
        self,
        source: TelemetrySource,
        callback: Callable[[tuple[DeviceSample, ...]], None],
        interval: float = 1.0,
    ) -> None:
        if interval < MIN_INTERVAL:
            raise ValueError(f"telemetry interval must be at least {MIN_INTERVAL} s, got {interval} s")
        self.source = source
        self.interval = interval
        self.last_error: str | None = None
        self._callback = callback
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dptui-telemetry", daemon=True)

    def start(self) -> TelemetryPoller:
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        """Ask the thread to end and wait for it (at most `timeout` s); safe to call twice."""
        self._stopping.set()
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self) -> TelemetryPoller:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stopping.is_set():
            started = time.monotonic()
            self._poll_once()
            self._stopping.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def _poll_once(self) -> None:
        try:
            self._callback(self.source.sample())
        except Exception as err:  # noqa: BLE001 - one bad sample must not end telemetry
            text = f"{type(err).__name__}: {err}"
            if text != self.last_error:  # log a repeating failure once, not every tick
                log.warning("telemetry poll failed", exc_info=err)
            self.last_error = text
