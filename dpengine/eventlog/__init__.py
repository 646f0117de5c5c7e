"""The event log: the events a run publishes (events.py), their JSON Lines writer (writer.py) and
reader (reader.py), and a whole run's per-device figures (summary.py).

It may import the engine's records and telemetry samples, never the run layer.
"""
