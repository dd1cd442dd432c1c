"""What users read: the tensor notation, the table, the failure dump, the summary, the CLI."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import opwatch
from support import SCENARIOS, assert_golden, needs_columns
from opwatch.core.notation import format_dtype, format_meta

import stories  # noqa: E402
import training  # noqa: E402

REPO = Path(__file__).resolve().parent.parent.parent


@pytest.mark.parametrize(
    "meta, text",
    [
        (((4, 1), torch.float32, torch.device("cpu")), "f32[4, 1] cpu"),
        (((), torch.float64, torch.device("meta")), "f64[] meta"),
        (((2, 0, 3), torch.bfloat16, torch.device("cpu")), "bf16[2, 0, 3] cpu"),
        (((6,), torch.bool, torch.device("cpu")), "b8[6] cpu"),
        (((1,), torch.complex64, torch.device("cpu")), "c64[1] cpu"),
        ((None, torch.float32, torch.device("cpu")), "f32[?] cpu"),
    ],
)
def test_notation(meta, text):
    assert format_meta(meta) == text
    assert str(opwatch.TensorMeta(*meta)) == text


def test_notation_of_rare_dtypes_keeps_torch_name():
    assert format_dtype(torch.quint8) == "quint8"
    assert format_dtype(torch.float8_e4m3fn) == "float8_e4m3fn"


@needs_columns
def test_table_golden():
    model, x, y = training.make()
    with opwatch.watch() as w:
        training.step(model, x, y)
    assert_golden("table_training_step.txt", w.table() + "\n")


def test_table_last_and_flags():
    with opwatch.watch(warn=False) as w:
        stories.broadcast_loss()
    table = w.table(last=5)
    rows = table.splitlines()[2:]
    assert len(rows) == 5
    full = w.table()
    flagged = [line for line in full.splitlines() if "broadcast" in line.split()[-1]]
    assert len(flagged) == 1 and "aten.sub.Tensor" in flagged[0] and "y - pred" in flagged[0]
    assert w.table(last=0).splitlines()[0].split()[:2] == ["#", "op"]


def test_table_refuses_an_unknown_format():
    with opwatch.watch(warn=False) as w:
        torch.ones(2)
    with pytest.raises(ValueError, match="tablefmt must be one of tabulate's formats .*github.*, got 'markdown'"):
        w.table(tablefmt="markdown")
    with pytest.raises(TypeError, match="tablefmt must be the name of one of tabulate's formats, got int"):
        w.table(tablefmt=1)
    assert w.table(tablefmt="github").startswith("| #")


def test_the_compact_table_folds_repeats_and_fits_its_width():
    from opwatch.render.table import render_table

    with opwatch.watch(warn=False) as w:
        x = torch.ones(4, 3)
        for _ in range(10):
            x = x * 2
        y = torch.ones(3, 2, dtype=torch.float64)
        z = torch.cat([x.double() @ y, x.double() @ y, torch.zeros(4, 2, dtype=torch.float64)])
    records = w.records
    full = render_table(records).splitlines()
    mark = records[-1].index
    for width in (200, 120):
        lines = render_table(records, mark=mark, width=width).splitlines()
        assert max(map(len, lines)) <= width, (width, lines)
        rows = lines[2:]
        assert len(rows) < len(full) - 2
        assert any("aten.mul.Tensor x10" in row for row in rows)  # one row, with its count
        assert rows[-1].startswith(f">> {mark}") and "aten.cat" in rows[-1]
        assert "module" not in lines[0]  # no op ran in a module: the empty column is left out
    # The two ops before the marked one are never folded, even alike.
    assert render_table(records, mark=mark, width=120).count("aten.mm") == 2
    # Without a width: the full table, unchanged.
    assert render_table(records, mark=mark).splitlines()[2:] and len(render_table(records).splitlines()) == len(full)


LONG_PATH_TRAINING = """\
import torch
from torch import nn

model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(32, 8), torch.randn(32)
for _ in range(3):
    optimizer.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    optimizer.step()
"""


def test_the_compact_table_cuts_a_long_path_at_its_start_to_fit(tmp_path):
    # A script outside the working directory is shown by its absolute path: in a clone under a
    # long folder, that path alone is wider than the table may be.
    import runpy

    from opwatch.render.table import render_table

    folder = tmp_path / ("a_very_long_folder_name_" * 4) / "opwatch" / "examples"
    folder.mkdir(parents=True)
    (folder / "train.py").write_text(LONG_PATH_TRAINING)
    with opwatch.watch(warn=False) as w:
        runpy.run_path(str(folder / "train.py"))
    assert any(anomaly.kind == "broadcast" for anomaly in w.anomalies)
    records = w.records
    full = render_table(records)
    assert str(folder / "train.py") in full  # the full table keeps the whole path
    lines = render_table(records, mark=records[-1].index, width=120).splitlines()
    assert max(map(len, lines)) <= 120, lines
    # The end of the path is kept, from a folder's start: the file, its line, its folders.
    places = [word for line in lines[2:] for word in line.split() if "train.py:" in word]
    assert len(places) > 5 and all(place.startswith(".../") and "/examples/train.py:" in place for place in places), places
    # Where the table has room, the path is whole.
    assert str(folder / "train.py") in render_table(records, mark=records[-1].index, width=400)


def test_summary_names_a_raised_anomaly_in_one_line():
    w = opwatch.strict(warn=False, dump_on_error=False)
    with pytest.raises(opwatch.AnomalyError) as caught:
        with w:
            stories.broadcast_loss()
    full, short = w.summary(), w.summary(raised=caught.value)
    header = caught.value.anomaly.message.splitlines()[0]
    assert full.count("problem:") == 1 and short.count("problem:") == 0
    assert f"{header} (the AnomalyError above)" in short.splitlines()
    with pytest.raises(TypeError, match="raised must be an opwatch.AnomalyError or None, got RuntimeError"):
        w.summary(raised=RuntimeError("x"))


@needs_columns
def test_failure_dump_golden():
    stream = io.StringIO()
    with pytest.raises(RuntimeError):
        with opwatch.watch(file=stream, warn=False, last=6):
            stories.double_matmul()
    assert_golden("dump_double_matmul.txt", stream.getvalue())


@needs_columns
def test_summary_golden():
    with opwatch.watch(warn=False) as w:
        stories.broadcast_loss(steps=3)
        stories.t5_buckets()
        stories.numpy_upcast()
    assert_golden("summary.txt", w.summary() + "\n")


def _cli(*args, cwd=SCENARIOS):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "opwatch", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def test_cli_on_a_failing_script():
    result = _cli("--last", "4", "fails.py")
    assert result.returncode == 1
    err = result.stderr
    # The table of the last ops, the failing one marked, its line, then the traceback with the note.
    assert ">> 4" in err and "aten.mm" in err and "f64[5, 3] cpu, f32[3, 2] cpu" in err
    assert "fails.py:8" in err and "h.double() @ w" in err
    assert "Traceback" in err and "opwatch: raised in aten.mm.default" in err
    assert "dtype_mismatch in aten.mm.default at fails.py:8" in err
    # The traceback shows the user's frames, not opwatch's or runpy's.
    assert "interceptor.py" not in err and "runpy" not in err


def test_cli_strict_passes_arguments_and_exit_code():
    result = _cli("--strict", "fails.py", "extra-arg")
    assert result.returncode == 1
    assert "AnomalyError" in result.stderr


def test_cli_rejects_a_missing_script():
    result = _cli("no_such_script.py")
    assert result.returncode == 2
    assert "no such script" in result.stderr


def test_cli_demo_shows_the_diagnoses():
    result = _cli("demo", cwd=REPO)
    readme = (REPO / "README.md").read_text()
    pasted = readme.split("## The demo, as it prints", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    missing = [line for line in pasted.splitlines() if line not in result.stdout.splitlines()]
    if sys.version_info >= (3, 11):  # the README shows 3.11's column carets; 3.10 prints none
        assert missing == [], "the README's pasted demo output no longer matches a real run"
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "device_mismatch in aten.masked_scatter_.default at opwatch/examples/device_mix.py:12" in out
    assert "dtype_mismatch in aten.masked_scatter_.default at opwatch/examples/device_mix.py:18" in out
    assert "broadcast in aten.sub.Tensor at opwatch/examples/broadcast_loss.py:26 (forward) [x100]" in out
    assert "inf in aten.log.default at opwatch/examples/log_zero.py:21 (forward)" in out
    assert "inf in aten.div.Tensor at opwatch/examples/log_zero.py:21 (backward)" in out
    assert "it turned into nan at aten.mul.Tensor at opwatch/examples/log_zero.py:12 (backward)" in out


def test_a_bad_batch_is_told_with_the_rank_whose_batch_it_was():
    """leave-on's words for a failed step whose batch held nan/inf, alone and in a job (the
    first rank's batch is told; the others are counted; facts that did not arrive say so)."""
    from opwatch.render.leave_on import bad_input, batch_words
    from opwatch.runners.batches import FedInput

    fed = FedInput("Net", ("argument 0", torch.float32, (8, 16), "cpu"), "nan", "train.py:12", (2, 4))
    assert FedInput.from_facts(fed.facts()) == fed  # as another rank reads it from the store
    bad = [("fc.weight", "nan")]
    alone = bad_input(3, bad, "skip", fed)
    assert alone.startswith("opwatch: optimizer step 3: the gradients about to be applied hold nan/inf: fc.weight (nan). cause: input: "
                            "the batch held nan before the model ran: Net's argument 0 (f32[8, 16] cpu) held nan when it entered the model "
                            "at train.py:12 (call 2 of the 4 the model ran since the last optimizer step), so no op of the model made them"), alone
    assert "Every rank" not in alone
    own = bad_input(3, bad, "skip", fed, rank=1, ranks=(1, 2))
    assert own.startswith("opwatch (rank 1): optimizer step 3:") and "cause: input: this rank's batch held nan before the model ran (also the batch of rank 2): " in own
    assert own.endswith("the weights and the buffers its forward wrote are as they were. Every rank does the same.")
    other = bad_input(3, [], "raise", fed, rank=0, ranks=(1, 2), elsewhere=(1, 2), rerun="python -m opwatch --strict train.py")
    assert ("opwatch (rank 0): optimizer step 3: the gradients about to be applied hold nan/inf on ranks 1, 2 (this rank's were finite; "
            "the ranks decide each optimizer step together). cause: input: rank 1's batch held nan before the model ran (also the batch "
            "of rank 2): Net's argument 0") in other
    assert other.endswith("The optimizer did not run on them. Every rank does the same. To see the ops that made the batch, if torch made it: "
                          "python -m opwatch --strict train.py.")
    lost = bad_input(3, bad, "skip", None, rank=0, ranks=(1,))
    assert "cause: input: rank 1's batch held nan/inf before the model ran (what it held did not reach this rank), so no op" in lost
    assert batch_words({**fed.facts(), "rank": 1}) == ("the batch held nan when it entered the model: Net's argument 0 (f32[8, 16] cpu) at "
                                                        "train.py:12 (call 2 of the 4 the model ran since the last optimizer step), on rank 1")
    assert batch_words({"rank": 1}) == "the batch of rank 1 held nan/inf when it entered the model (what it held did not reach this rank)"
