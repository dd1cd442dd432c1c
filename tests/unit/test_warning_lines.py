"""opwatch's warnings are shown at the program's line, as Python shows its own: not at
``torch/optim/optimizer.py`` (a hook run by ``optimizer.step()``) nor in a trainer's own files
(Lightning's ``call.py``), which Python's ``stacklevel`` would name."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import opwatch
from opwatch.core.sites import warn_at_user
from support.helpers import line_of

OPWATCH_DIR = os.path.dirname(opwatch.__file__)
SITE_PACKAGES = os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), "trainer_lib", "call.py")


def _compiled(source: str, filename: str) -> dict:
    """Functions whose frames run from ``filename`` (opwatch's folder, an installed package)."""
    space = {"warn_at_user": warn_at_user, "OpwatchWarning": opwatch.OpwatchWarning}
    exec(compile(textwrap.dedent(source), filename, "exec"), space)
    return space


def _caught(run):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [(found.filename, found.lineno) for found in caught if issubclass(found.category, opwatch.OpwatchWarning)]


def test_a_warning_from_an_optimizer_hook_is_at_the_step_line():
    """opwatch's hook (its frame in opwatch's folder), run by torch's optimizer.step() from a
    trainer's own file (an installed package): the program's line is the call into the trainer."""
    hook = _compiled("def hook(optimizer, args, kwargs):\n    warn_at_user(OpwatchWarning('gradients hold nan'))\n", os.path.join(OPWATCH_DIR, "hook.py"))["hook"]
    trainer = _compiled("def run(optimizer):\n    optimizer.step()\n", SITE_PACKAGES)["run"]
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = optimizer.register_step_pre_hook(hook)
    try:
        model(torch.randn(4, 2)).sum().backward()
        direct = _caught(lambda: optimizer.step())  # @direct
        through_trainer = _caught(lambda: trainer(optimizer))  # @trainer
    finally:
        handle.remove()
    assert direct == [(__file__, line_of("# @direct", __file__))]
    assert through_trainer == [(__file__, line_of("# @trainer", __file__))]


def test_guard_cli_warns_at_the_scripts_step_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""\
        import torch
        from torch import nn

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            out = model(torch.randn(5, 4))
            loss = torch.log(out - out if step == 1 else out.abs() + 1).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()  # @step
        """))
    env = dict(os.environ, PYTHONPATH=os.path.dirname(OPWATCH_DIR))
    env.pop("OPWATCH_DISABLE", None)
    done = subprocess.run([sys.executable, "-m", "opwatch", "--guard", str(script)], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    warned = [line for line in done.stderr.splitlines() if "OpwatchWarning: opwatch: optimizer step 2: the gradients" in line]
    assert warned and warned[0].startswith(f"{script}:{line_of('# @step', str(script))}: "), done.stderr


def test_a_program_run_as_a_module_gets_its_warnings_and_finishes(tmp_path):
    """``python -m package.train``: the script is ``__main__`` while its loader knows it as
    ``package.train`` and refuses to give the source by the other name. Python's own warnings
    never ask; opwatch's (at the user's line, with the module's globals) used to raise that
    ImportError out of the user's ``with`` block (the warning that compiled code ran eagerly)."""
    package = tmp_path / "trainpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text(textwrap.dedent("""\
        import torch
        from torch import nn

        import opwatch

        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        compiled = torch.compile(model, backend="eager")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with opwatch.watch():  # @watch
            for step in range(2):
                loss = (compiled(torch.randn(5, 4)) - torch.randn(5)).pow(2).mean()  # @broadcast
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        print("trained")
        """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.path.dirname(OPWATCH_DIR)]))
    env.pop("OPWATCH_DISABLE", None)
    done = subprocess.run([sys.executable, "-m", "trainpkg.train"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "trained", done.stderr
    script = str(package / "train.py")
    warned = [line for line in done.stderr.splitlines() if "OpwatchWarning: broadcast in" in line]
    assert warned and warned[0].startswith(f"{script}:{line_of('# @broadcast', script)}: "), done.stderr
    assert "loss = (compiled(torch.randn(5, 4)) - torch.randn(5)).pow(2).mean()" in done.stderr  # the source line, read from the file
    told = [line for line in done.stderr.splitlines() if "OpwatchWarning: opwatch ran compiled code uncompiled" in line]
    assert told and told[0].startswith(f"{script}:{line_of('# @watch', script)}: "), done.stderr


def test_a_loop_run_by_exec_in_a_one_line_script_is_told_not_crashed(tmp_path, capsys, monkeypatch):
    """``exec(open("loop.py").read())`` (a launcher's idiom, nanoGPT's configurator's) runs the
    loop as ``<string>`` in the script's globals, whose loader holds the one-line script: Python's
    warnings asked it for line 10 and raised IndexError out of the optimizer's hook, ending the run
    at its first failed step. The warning is told at ``<string>:10`` and the run goes on."""
    from support.helpers import guard_in_process

    monkeypatch.chdir(tmp_path)
    (tmp_path / "loop.py").write_text(textwrap.dedent("""\
        import torch
        from torch import nn
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        for step in range(6):
            x, y = torch.randn(16, 8), torch.randn(16)
            if step == 3: x[0, 0] = float("nan")  # a bad sample
            loss = nn.functional.mse_loss(model(x).squeeze(1), y)
            optimizer.zero_grad(); loss.backward(); optimizer.step()
        print("done")
        """))
    status, out, err = guard_in_process(tmp_path, capsys, 'exec(open("loop.py").read())\n')
    assert status == 0 and "done" in out, err
    assert "IndexError" not in err
    assert "optimizer step 4: the gradients about to be applied hold nan/inf" in err
    assert "1 failed (the batch held nan/inf), 1 of them skipped" in err
