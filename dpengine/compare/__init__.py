"""After the run: two runs compared (diff), a run's summary file, and advice from its figures.

Pure logic over the event stream and numpy; importable without torch and Textual.
"""
