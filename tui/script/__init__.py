"""`dptui run`: the user's script as a child process (script_run.py), its command line (cli.py),
its UI (app.py) and the events only it publishes (events.py)."""
