"""Scripts with real bugs, run by ``python -m opwatch demo``: the three user stories of
TorchSnooper's README, on the ``meta`` device where they need a second device."""
