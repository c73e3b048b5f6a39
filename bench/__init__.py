"""zerokv benchmarks: ``python -m bench --help`` (see bench/__main__.py)."""
