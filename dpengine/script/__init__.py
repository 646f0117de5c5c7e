"""`dptui run`: the child-process side. A bootstrap runs the user's program with
torch.nn.DataParallel swapped for a recording one, and talks to dptui over private pipes.

Imports nothing from Textual; the wire format is JSON Lines (see `wire.py`).
"""
