"""What users run, each built on a watch: :mod:`.guarded` (``opwatch.guard``),
:mod:`.leave_on` (``--guard``), :mod:`.cli` and :mod:`.cli_diff` (``python -m opwatch``),
:mod:`.pytest_plugin`, the trainers (:mod:`.trainers`, :mod:`.lightning`,
:mod:`.transformers`, :mod:`.tensorboard`) and :mod:`.divergence` (``opwatch.diff``).

Importing this package imports nothing else: the pytest plugin must stay free for a test run
that does not ask for it.
"""
