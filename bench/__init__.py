"""Benchmarks of hp-dcp-hf: ``python -m bench`` (see ``bench/README.md``).

Not tests: nothing here asserts; everything is measured and written to ``bench/results/``.
"""
