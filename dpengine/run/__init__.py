"""The run layer: a training run around the engine (Trainer, its steering, checkpoints, workloads),
the `Run` protocol the UI drives, and a recorded run replayed like a live one.

The engine core (dpengine's top level) imports nothing from here.
"""
