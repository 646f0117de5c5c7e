"""`dptui view`: a recorded run's command line (cli.py), its UI (app.py) and the screen at a
chosen step (replay.py)."""
