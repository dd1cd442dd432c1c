"""torch's "one of the variables needed for gradient computation has been modified by an inplace
operation" names a shape and a version, no line. Under a watch the error carries a note naming
the op whose backward needed the tensor (its line) and the op that wrote into it since (its
line: a residual added in place, an index assignment, the discriminator's optimizer step of a
GAN), with the fix. Each loop has a healthy twin, which trains under the watch with no anomaly
and no note; a backward error of another kind gets no note; a backward that no watch saw
(``--guard`` after its audit) says how to name them."""

from __future__ import annotations

import pytest
import torch

import opwatch
from support import SCENARIOS, assert_golden, needs_columns
from support.helpers import guard_in_process
from support.helpers import line_of as _line_of

import overwritten_saves as scenarios  # noqa: E402

SCRIPT = str(SCENARIOS / "overwritten_saves.py")


def line_of(marker: str) -> int:
    return _line_of(marker, SCRIPT)


def notes_of(error: BaseException) -> list[str]:
    return [note for note in getattr(error, "__notes__", []) if note.startswith("opwatch")]


def raised_under(watch, program):
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as raised:
        with watch(warn=False, dump_on_error=False):
            program()
    return raised.value


@pytest.mark.parametrize("watch", [opwatch.watch, opwatch.strict])
def test_a_residual_added_in_place_names_the_linear_that_saved_it_and_the_add(watch):
    (note,) = notes_of(raised_under(watch, scenarios.train_residual))
    lines = note.splitlines()
    assert lines[0] == ("opwatch: the backward of aten.addmm needed its argument mat1 (f32[8, 32] cpu) as its forward op "
                        "saved it, but it was written in place since:")
    assert lines[1].startswith("  saved by:   aten.addmm (op #") and ", module fc2) at " in lines[1]
    assert f"overwritten_saves.py:{line_of('# the Linear that saves h')}: " in lines[1] and "self.fc2(h)" in lines[1]
    assert lines[2].startswith("  written by: aten.add_.Tensor (op #")
    assert f"overwritten_saves.py:{line_of('# the residual written in place')}: " in lines[2] and "h += y" in lines[2]
    assert lines[3] == "  fix:        write it out of place (x = x + y, not x += y; nn.ReLU(inplace=False)), or clone it first (h = h.clone(); h[:, 0] = 0)"


@needs_columns
def test_the_note_as_the_user_reads_it():
    (note,) = notes_of(raised_under(opwatch.watch, scenarios.train_residual))
    assert_golden("note_overwritten_save.txt", note.replace(SCRIPT, "overwritten_saves.py") + "\n")


def test_an_index_assignment_names_the_tanh_whose_result_it_wrote():
    (note,) = notes_of(raised_under(opwatch.watch, scenarios.train_dropped_feature))
    lines = note.splitlines()
    assert lines[0].startswith("opwatch: the backward of aten.tanh needed its result (f32[4, 20] cpu)")
    assert lines[1].startswith("  saved by:   aten.tanh (op #") and ", module body.1 (Tanh)) at " in lines[1]
    assert f"overwritten_saves.py:{line_of('h = self.body(x)')}: " in lines[1] and lines[1].endswith("self.body(x)")
    assert lines[2].startswith("  written by: aten.fill_") and f"overwritten_saves.py:{line_of('# the first feature dropped')}: " in lines[2]


def test_a_gan_that_reuses_the_discriminator_s_output_after_its_step_names_the_step():
    (note,) = notes_of(raised_under(opwatch.watch, scenarios.train_gan))
    lines = note.splitlines()
    assert lines[0].startswith("opwatch: the backward of aten.addmm needed its argument mat2 (f32[32, 1] cpu)")
    output, step = line_of("# the discriminator's output on the fake batch"), line_of("# the discriminator's step")
    assert f"overwritten_saves.py:{output}: " in lines[1] and "discriminator(fake)" in lines[1]
    assert ", an optimizer step) at " in lines[2] and f"overwritten_saves.py:{step}: " in lines[2] and "opt_d.step()" in lines[2]
    assert lines[3].startswith("  fix:        run this backward before the optimizer step that updates the weights its graph saved")


@pytest.mark.parametrize("program", [scenarios.train_residual, scenarios.train_dropped_feature, scenarios.train_gan])
def test_the_fixed_loops_train_under_the_watch_with_no_anomaly_and_the_same_loss(program):
    plain = program(fixed=True)
    with opwatch.watch(warn=False) as w:
        watched = program(fixed=True)
    assert w.anomalies == [] and torch.equal(plain, watched)


def test_a_backward_error_of_another_kind_gets_no_note():
    model = torch.nn.Linear(4, 1)
    with pytest.raises(RuntimeError, match="does not require grad") as raised:
        with opwatch.watch(warn=False, dump_on_error=False):
            model(torch.randn(2, 4)).detach().sum().backward()
    assert notes_of(raised.value) == []


def test_guard_names_the_command_that_names_them_for_a_backward_no_watch_saw(tmp_path, capsys, monkeypatch):
    """Under ``--guard`` the audit ends at the first optimizer step (the discriminator's): the
    generator's backward that raises runs unwatched."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(SCENARIOS))
    status, out, err = guard_in_process(tmp_path, capsys, "import overwritten_saves\noverwritten_saves.train_gan()\n")
    assert status == 1
    assert "modified by an inplace operation" in err
    assert ("opwatch: no watch saw this backward's forward, so no op is named. To name the op whose backward needed the "
            "tensor and the op that wrote into it in place: python -m opwatch train.py.") in err
