"""`dptui compare`: two runs side by side."""
