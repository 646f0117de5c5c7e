"""dptui's benchmark suite: `python -m bench` (or `make bench`); see BENCHMARKS.md."""
