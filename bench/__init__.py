"""opwatch benchmark suite.

Run it with ``python -m bench.run`` (or ``python bench/run.py``) from the
repository root; ``--quick`` gives a fast smoke run, ``--only NAME`` restricts
it to one workload.  See ``bench/run.py`` for what is measured and why.
``python -m bench.ablate`` shows where opwatch's own time goes, part by part.
"""
