"""The floors of the package, bottom to top: kept by ``tests/unit/test_rules.py`` (a module
imports only its own floor or lower ones) and by ``tests/e2e/test_finding_path.py`` (a finding's
calls go down a floor or stay)."""

from __future__ import annotations

# The floors, bottom to top, are the package's folders (and its few top-level files): a module
# may import its own floor or lower ones. They are in the order a finding travels: the
# interceptor (modes) hands it to the exit (findings), which asks the checks and render. A new
# folder must be placed here, so the tree and the rule cannot drift apart.
FLOORS = [
    {"opwatch._version"},  # a leaf: any floor may name the version
    {"opwatch.core"},  # facts about torch and the op log: no watch state
    {"opwatch.checks"},  # one check a module: facts in, findings out
    {"opwatch.render"},  # every sentence a user reads
    {"opwatch.findings"},  # the one exit of findings; anomalies, warnings, raises; across ranks
    {"opwatch.modes"},  # the private dispatch modes: the hot path, which hands findings down
    {"opwatch.storage"},  # saved runs: the fact codec, JSON Lines, Chrome traces
    {"opwatch.session"},  # watch(), strict(), Watch: the public object
    {"opwatch.runners", "opwatch.examples"},  # what users run: guard, leave-on, CLI, pytest, trainers, diff
    {"opwatch", "opwatch.__main__"},  # the package's face re-exports the public names
]


def floor_of(name: str) -> int:
    """The floor of the module ``name`` (``opwatch.checks.broadcast``): the longest prefix placed."""
    best, best_length = None, -1
    for number, layer in enumerate(FLOORS):
        for prefix in layer:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best_length:
                best, best_length = number, len(prefix)
    if best is None:
        raise AssertionError(f"{name} is in no layer of tests/support/floors.py: add it where it belongs")
    return best
