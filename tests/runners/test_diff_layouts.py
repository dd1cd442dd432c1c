"""``opwatch.diff`` of a sharded run (its ranks' logs) against a single-process run.

For real: a 2-rank tensor-parallel training step (``ColwiseParallel`` / ``RowwiseParallel``
DTensors, an SGD step on the sharded parameters) on gloo over 127.0.0.1, started with
``torch.multiprocessing`` in a subprocess (process-group timeout 30 s, the subprocess 240 s),
each rank writing its log; the single-process run of the same model and data writes its own.
Clean, the runs agree; with one rank's shard of one weight perturbed, the diff names the first
op whose combined values differ, at its line.
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import opwatch
from opwatch.runners.cli_diff import run_diff
from support import fsdp2_on_cpu
from support.distributed import run_ranks
from support.helpers import line_of

REPO = Path(__file__).resolve().parent.parent.parent
ENV = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(), reason="needs torch.distributed with gloo")

SCRIPT = textwrap.dedent(
    """\
    import datetime
    import os
    import sys

    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from torch import nn

    import opwatch


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(8, 16)
            self.fc2 = nn.Linear(16, 4)

        def forward(self, x):
            h = torch.relu(self.fc1(x))  # fc1 line
            return self.fc2(h)  # fc2 line


    def train_step(model, optimizer, x, y):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)  # loss line
        loss.backward()
        optimizer.step()


    def data():
        torch.manual_seed(0)
        return Net(), torch.randn(6, 8), torch.randn(6, 4)


    def rank_main(rank, port, out, plant, layout):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        timeout = datetime.timedelta(seconds=30)
        store = dist.TCPStore("127.0.0.1", port, 2, False, timeout)  # served by the parent
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
        try:
            model, x, y = data()
            mesh = init_device_mesh("cpu", (2,))
            if layout == "tp":
                parallelize_module(model, mesh, {"fc1": ColwiseParallel(use_local_output=False), "fc2": RowwiseParallel(input_layouts=Shard(-1))})
            else:  # FSDP2: each parameter sharded on dim 0; the compute runs on all-gathered ones
                fully_shard(model.fc1, mesh=mesh)
                fully_shard(model.fc2, mesh=mesh)
                fully_shard(model, mesh=mesh)
            if plant and rank == 1:
                with torch.no_grad():
                    model.fc1.weight.to_local()[0, 0] += 0.01  # this rank's shard of fc1.weight
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            with opwatch.watch(fingerprints=True) as w:
                for _ in range(2):
                    train_step(model, optimizer, x, y)
            w.export_jsonl(os.path.join(out, f"rank{rank}.jsonl"))
        finally:
            dist.destroy_process_group()


    if __name__ == "__main__":
        out, plant, layout = sys.argv[1], sys.argv[2] == "plant", sys.argv[3]
        os.makedirs(os.path.join(out, "ranks"))
        # The ranks meet at a store this process serves, on a port the system picks as it binds.
        store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=60), wait_for_workers=False)
        mp.spawn(rank_main, args=(store.port, os.path.join(out, "ranks"), plant, layout), nprocs=2, join=True)
        model, x, y = data()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with opwatch.watch(fingerprints=True) as w:
            for _ in range(2):
                train_step(model, optimizer, x, y)
        w.export_jsonl(os.path.join(out, "single.jsonl"))
    """
)


def _record(tmp_path, plant: bool, layout: str) -> tuple[Path, Path]:
    script = tmp_path / "tp_train.py"
    script.write_text(SCRIPT)
    done = run_ranks(
        [sys.executable, str(script), str(tmp_path), "plant" if plant else "clean", layout],
        env=ENV, cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp_path / "ranks", tmp_path / "single.jsonl"


LAYOUTS = pytest.mark.parametrize("layout", [pytest.param("tp", marks=pytest.mark.thorough), pytest.param("fsdp2", marks=fsdp2_on_cpu)])


@LAYOUTS
def test_a_clean_sharded_run_agrees_with_the_single_process_one(tmp_path, capsys, layout):
    ranks, single = _record(tmp_path, plant=False, layout=layout)
    result = opwatch.diff(ranks, single)
    assert result.agree, str(result)
    assert result.ranks == (2, 1) and result.tolerance.reason == "layouts"
    # Compared: the forward and backward compute (tensor parallel: fc1's addmm as Shard(1)
    # DTensor shards; FSDP2: plain tensors on the all-gathered parameters), the SGD updates of
    # the sharded parameters (Shard(0) shards), both steps.
    compared = [(record, other) for record, other in result.pairs if record is not None and other is not None and result._prints[0].get(record.index)]
    assert {"aten.addmm.default", "aten.mm.default", "aten.add_.Tensor"} <= {record.op for record, _ in compared}
    assert sum(record.op == "aten.add_.Tensor" for record, _ in compared) == 8  # 4 parameters, 2 steps
    assert result.compared >= 30
    # The collectives exist in the sharded run only.
    collective = "all_reduce" if layout == "tp" else "_allgather_base_"
    assert any(collective in record.op for record in result.only_in_a)
    assert "Run a is 2 ranks' logs, combined" in str(result)
    # The ranks' logs as a list, the other way round: the same verdict.
    assert opwatch.diff(str(single), sorted(str(path) for path in ranks.iterdir())).agree
    assert run_diff([str(ranks), str(single)]) == 0
    capsys.readouterr()


@LAYOUTS
def test_one_ranks_perturbed_shard_is_named_at_its_op_and_line(tmp_path, capsys, layout):
    ranks, single = _record(tmp_path, plant=True, layout=layout)
    result = opwatch.diff(ranks, single)
    assert not result.agree
    first = result.first
    script = str(tmp_path / "tp_train.py")
    assert first.a.op == "aten.addmm.default" and first.a.lineno == line_of("# fc1 line", script)
    assert first.a.phase == "forward" and first.reason == "values"
    # Tensor parallel: fc1's output, Shard(1), combined over both ranks' shards; FSDP2: computed on
    # the all-gathered weight, which holds rank 1's perturbed shard.
    assert any(gap.relative > 1e-4 for gap in first.gaps())
    assert run_diff([str(ranks), str(single), "--context", "1"]) == 1
    out = capsys.readouterr().out
    assert "The runs first differ at aten.addmm" in out and "h = torch.relu(self.fc1(x))" in out


def test_a_directory_without_logs_is_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no .jsonl log in it"):
        opwatch.diff(tmp_path / "empty", tmp_path / "empty")


def test_shards_combine_by_their_placement():
    from opwatch.checks.fingerprints import Fingerprint, ShardPrint
    from opwatch.runners.divergence_layouts import combine

    whole = torch.tensor([[1.0, -2.0, 3.0, 4.0], [0.5, 6.0, -7.0, 8.0]])

    def stats(tensor):
        return (float(tensor.sum()), float(tensor.norm()), float(tensor.min()), float(tensor.max()))

    for dim in (0, 1):
        shards = [ShardPrint(i, *stats(part), f"S{dim}", (2, 4), 2) for i, part in enumerate(whole.chunk(2, dim))]
        combined = combine(shards)
        assert combined.sum == pytest.approx(float(whole.sum())) and combined.norm == pytest.approx(float(whole.norm()))
        assert (combined.min, combined.max) == (-7.0, 8.0) and combined.hash == -1
    replicated = [ShardPrint(7, *stats(whole), "R", (2, 4), 2)] * 2
    assert combine(replicated) == Fingerprint(7, *stats(whole))
    plain = Fingerprint(3, *stats(whole))
    assert combine([plain, plain]) is plain
    # Not known from the shards: partial sums' norm, placements that differ, a rank missing.
    assert combine([ShardPrint(1, *stats(whole), "P", (2, 4), 2)] * 2) is None
    assert combine([ShardPrint(1, *stats(whole), "S0", (2, 4), 2), ShardPrint(1, *stats(whole), "S1", (2, 4), 2)]) is None
    assert combine([ShardPrint(1, *stats(whole), "S0", (2, 4), 2), None]) is None
    assert combine([ShardPrint(1, *stats(whole), "S0", (2, 4), 2)]) is None  # one rank of two


def test_a_shards_fingerprint_survives_the_saved_log():
    from opwatch.checks.fingerprints import Fingerprint, ShardPrint, decode, encode

    prints = (ShardPrint(5, 1.5, 2.0, -1.0, float("inf"), "S1", (4, 8), 2), Fingerprint(6, 0.0, 0.0, 0.0, 0.0), None)
    assert decode(encode(prints)) == prints
