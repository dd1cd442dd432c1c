"""Public names stay what they are whatever was imported first: no submodule of the package
shares a name with a public function, so importing one cannot replace ``opwatch.guard`` (or any
other public name) by a module in the package's namespace."""

from __future__ import annotations

import subprocess
import sys

import pytest

import opwatch

_CHECK = r"""
import importlib, pkgutil, sys, types
import opwatch

order = sys.argv[1]
# every module but the command line's entry and the demo's scripts (programs that run on import)
names = sorted(
    m.name for m in pkgutil.walk_packages(opwatch.__path__, "opwatch.")
    if m.name != "opwatch.__main__" and not m.name.startswith("opwatch.examples.")
)
if order == "reversed":
    names.reverse()
for name in names:
    try:
        importlib.import_module(name)
    except ImportError as error:  # an optional framework that is not installed
        print("skipped", name, error, file=sys.stderr)
wrong = [name for name in opwatch.__all__ if isinstance(getattr(opwatch, name), types.ModuleType)]
assert not wrong, f"public names that are modules after importing every submodule: {wrong}"
import torch
model = torch.nn.Linear(3, 1)
def train_step(x):
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss
step = opwatch.guard(train_step, model)
step(torch.randn(4, 3))
with opwatch.watch(fingerprints=True) as w:
    model(torch.randn(2, 3)).sum()
with opwatch.strict():
    model(torch.randn(2, 3)).sum()
assert opwatch.diff(w, w).first is None
assert isinstance(opwatch.Allow(op="aten.add*"), opwatch.Allow)
assert issubclass(opwatch.AnomalyError, Exception) and issubclass(opwatch.OpwatchWarning, Warning)
assert opwatch.format_meta(opwatch.TensorMeta((4, 1), torch.float32, torch.device("cpu"), 0)) == "f32[4, 1] cpu"
assert "broadcast" in opwatch.KINDS and callable(opwatch.load) and opwatch.Anomaly and opwatch.OpRecord
print("ok")
"""


@pytest.mark.parametrize("order", ["sorted", "reversed"])
def test_public_names_survive_importing_every_submodule(order):
    result = subprocess.run([sys.executable, "-c", _CHECK, order], capture_output=True, text=True, timeout=240)
    assert result.stdout.strip().endswith("ok"), result.stdout + result.stderr


def test_no_top_level_module_shares_a_public_name():
    import pkgutil

    children = {module.name for module in pkgutil.iter_modules(opwatch.__path__)}
    assert not children & set(opwatch.__all__), sorted(children & set(opwatch.__all__))
