"""Several optimizers in one run (``python -m opwatch --guard``): a split of the parameters
between optimizers that all step after one backward (Muon with AdamW for the rest, a sparse
embedding's SparseAdam beside a dense one), and a GAN's two optimizers, each after its own
backward. A failed batch is one story, however many optimizers step on its gradients, and the
re-check of a failure waits for the next batch."""

from __future__ import annotations

import pytest

from support.helpers import guard_in_process, line_of

# Two optimizers after one backward: the trunk's AdamW, the head's SGD with momentum.
SPLIT = """
import torch
from torch import nn
torch.manual_seed(0)
trunk = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
head = nn.Linear(32, 1)
opt_trunk = torch.optim.AdamW(trunk.parameters(), lr=1e-3)
opt_head = torch.optim.SGD(head.parameters(), lr=1e-2, momentum=0.9)
for step in range(8):
    x = torch.randn(32, 16)
    y = x.sum(-1)
    if step == BAD_LABEL: y[3] = float("nan")  # a bad label in one batch
    features = trunk(x)
    if step == BAD_BACKWARD: features = features + (features * 0).sqrt()  # sqrt'(0): nan into the trunk's gradients only
    loss = ((head(features).squeeze(-1) - y) ** 2).mean()
    opt_trunk.zero_grad(); opt_head.zero_grad()
    loss.backward()
    opt_trunk.step(); opt_head.step()
print("weights finite:", all(bool(p.isfinite().all()) for p in [*trunk.parameters(), *head.parameters()]))
"""


def split(bad_label=-1, bad_backward=-1) -> str:
    return SPLIT.replace("BAD_LABEL", str(bad_label)).replace("BAD_BACKWARD", str(bad_backward))


def test_a_bad_batch_fails_every_optimizer_of_its_backward_in_one_story(tmp_path, capsys, monkeypatch):
    """The label of batch 3 holds nan: both optimizers' gradients do (steps 7 and 8). The
    second optimizer's step used to be taken for the re-check of the first's: "the failure of
    step 7 recurred at step 8, but no op of that step made the nan/inf: they came in with the
    weights, the batch or the optimizer's state", though no op ran between the two steps. It is
    the same failure now, and the re-check runs on the next batch."""
    monkeypatch.chdir(tmp_path)
    status, out, err = guard_in_process(tmp_path, capsys, split(bad_label=3))
    assert status == 0 and "weights finite: True" in out, err
    assert "optimizer step 7: the gradients about to be applied hold nan/inf: 0.weight (nan), 0.bias (nan)." in err
    assert ("optimizer step 8: its gradients hold nan/inf too: weight (nan), bias (nan); they came from the same backward as "
            "those of step 7 (no backward and no call of the model ran between the two steps)") in err
    assert "recurred" not in err
    assert "the failure of step 7 did not recur: step 9 ran under a full watch and its gradients were finite." in err
    assert "opwatch guard: 16 optimizer steps ran, 3 audited under a full watch, 2 failed (nan/inf in the gradients), 2 of them skipped." in err


def test_raise_waits_for_the_next_batch_when_the_other_optimizer_s_gradients_are_finite(tmp_path, capsys, monkeypatch):
    """sqrt at 0 makes nan in the trunk's gradients only: the head's optimizer steps on finite
    gradients from the same backward. ``--on-failure raise`` used to raise there, saying "step 8
    ran under a full watch and its gradients were finite": no op had run. It raises at the next
    batch's step, which the watch did see."""
    monkeypatch.chdir(tmp_path)
    status, out, err = guard_in_process(tmp_path, capsys, split(bad_backward=3), "--on-failure", "raise")
    assert status == 1, err
    assert "optimizer step 7: the gradients held nan/inf: 0.weight (nan), 0.bias (nan); in that step the loss backward() ran on was finite" in err
    assert "That step did not run" in err
    assert "did not recur: step 9 ran under a full watch" in err and "step 8 ran" not in err


def test_a_failure_of_the_second_optimizer_alone_is_re_checked_at_the_next_batch(tmp_path, capsys, monkeypatch):
    """The head's optimizer steps first on finite gradients, the trunk's fails (sqrt at 0): a
    first failure, though on the same backward as the step before. It is told and re-checked at
    the next batch (the rule above must not keep its re-check from starting)."""
    monkeypatch.chdir(tmp_path)
    script = split(bad_backward=3).replace("opt_trunk.step(); opt_head.step()", "opt_head.step(); opt_trunk.step()")
    status, out, err = guard_in_process(tmp_path, capsys, script)
    assert status == 0 and "weights finite: True" in out, err
    assert "optimizer step 8: the gradients about to be applied hold nan/inf: 0.weight (nan), 0.bias (nan)." in err
    assert "same backward" not in err
    assert "the failure of step 8 did not recur: step 9 ran under a full watch and its gradients were finite." in err
    assert "opwatch guard: 16 optimizer steps ran, 2 audited under a full watch, 1 failed (nan/inf in the gradients), 1 of them skipped." in err


# A GAN, each optimizer after its own backward: the discriminator's, then the generator's.
GAN = """
import torch
from torch import nn
torch.manual_seed(0)
generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
discriminator = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
opt_g = torch.optim.Adam(generator.parameters(), lr=2e-4, betas=(0.5, 0.999))
opt_d = torch.optim.Adam(discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999))
bce = nn.BCEWithLogitsLoss()
for step in range(6):
    real = torch.randn(16, 8) + 2
    if step == 3: SAMPLE  # one corrupt sample
    fake = generator(torch.randn(16, 4))
    d_loss = bce(discriminator(real), torch.ones(16, 1)) + bce(discriminator(fake.detach()), torch.zeros(16, 1))
    opt_d.zero_grad(); d_loss.backward(); opt_d.step()
    g_loss = GENERATOR_LOSS
    opt_g.zero_grad(); g_loss.backward(); opt_g.step()
print("done")
"""


def gan_script(sample="pass", generator_loss="bce(discriminator(fake), torch.ones(16, 1))") -> str:
    return GAN.replace("SAMPLE", sample).replace("GENERATOR_LOSS", generator_loss)


@pytest.mark.parametrize("corrupt", ["", "nan", "huge"])
def test_a_gan_s_optimizers_each_judge_their_own_backward(tmp_path, capsys, monkeypatch, corrupt):
    """A GAN: the discriminator's step after its backward on real and fake batches, the
    generator's after its own. One corrupt real sample fails the discriminator's step (step 7),
    whose batch hook is the discriminator's (the module the first step trained): a nan sample is
    told as its batch; an unscaled one (3e38, finite) overflows inside it. The generator's step
    is another backward's, so it is the re-check; its backward runs through the discriminator and
    accumulates into the gradients the skipped step left holding nan, which the re-check used to
    name: "the failure of step 7 recurred at step 8: nan first made by aten.add_.Tensor at
    autograd (backward)", listed at the end as an anomaly at an unknown line. Healthy, the run
    is silent, with each optimizer's path audited: the discriminator's first step, then from the
    generator's first step (no watch saw its loss) to its next, 3 steps."""
    monkeypatch.chdir(tmp_path)
    sample = {"": "pass", "nan": 'real[5, 1] = float("nan")', "huge": "real[5] = 3e38"}[corrupt]
    gan = gan_script(sample=sample)
    status, out, err = guard_in_process(tmp_path, capsys, gan)
    assert status == 0 and "done" in out, err
    assert "same backward" not in err and "recurred" not in err and "aten.add_" not in out + err
    if not corrupt:
        assert "opwatch: no anomalies." in out + err
        assert "opwatch guard: 12 optimizer steps ran, 3 audited under a full watch, 0 failed." in err
        return
    assert "optimizer step 7: the gradients about to be applied hold nan/inf: " in err
    if corrupt == "nan":
        assert ("cause: input: the batch held nan before the model ran: Sequential's argument 0 (f32[16, 8] cpu) held nan when it "
                "entered the model at train.py:14 (call 1 of the 2 the model ran since the last optimizer step)") in err
        assert "1 failed (the batch held nan/inf)" in err
    else:
        assert "the failure of step 7 did not recur: step 8 ran under a full watch" in err
        assert "1 failed (nan/inf in the gradients)" in err


def test_a_shape_bug_in_the_generator_s_loss_alone_is_seen_by_the_audit_its_first_step_arms(tmp_path, capsys, monkeypatch):
    """A least-squares generator loss whose target is ``(16,)`` beside the discriminator's
    ``(16, 1)``: a ``(16, 16)`` loss, in the generator's path only. The run's audit ended at the
    discriminator's first step, and the run used to end "opwatch: no anomalies." with 1 step
    audited; the generator's first step arms an audit until its next step, which names it."""
    monkeypatch.chdir(tmp_path)
    script = gan_script(generator_loss="((discriminator(fake) - torch.ones(16)) ** 2).mean()")
    status, out, err = guard_in_process(tmp_path, capsys, script)
    assert status == 0 and "done" in out, err
    assert "broadcast in aten.sub.Tensor at train.py:16 (forward)" in out + err
    assert "sub returns [16, 16], 16x more elements than its largest input" in out + err
    assert "opwatch guard: 12 optimizer steps ran, 3 audited under a full watch, 0 failed." in err


def test_an_optimizer_that_steps_once_arms_an_audit_of_at_most_16_steps(tmp_path, capsys, monkeypatch):
    """A loop that calibrates a temperature once with its own optimizer, after step 5 of 40: its
    step arms an audit until its next step, which never comes; the audit ends after 16 optimizer
    steps (the model's steps 6 to 21), and the rest run unwatched."""
    monkeypatch.chdir(tmp_path)
    script = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
temperature = nn.Parameter(torch.ones(1))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
calibration = torch.optim.Adam([temperature], lr=0.1)
for step in range(40):
    x, y = torch.randn(32, 8), torch.randn(32)
    loss = nn.functional.mse_loss(model(x).squeeze(1), y)
    optimizer.zero_grad(); loss.backward(); optimizer.step()
    if step == 4:
        scaled = nn.functional.mse_loss(model(x).detach().squeeze(1) / temperature, y)
        scaled.backward(); calibration.step()
print("done")
"""
    status, out, err = guard_in_process(tmp_path, capsys, script)
    assert status == 0 and "done" in out, err
    assert "opwatch: no anomalies." in out + err
    assert "opwatch guard: 41 optimizer steps ran, 17 audited under a full watch, 0 failed." in err


def test_a_loop_that_makes_its_optimizer_anew_each_step_arms_at_most_8_audits(tmp_path, capsys, monkeypatch):
    """Each step's optimizer is new, so each unwatched one would arm an audit: every other step
    of the run would run watched. At most 8 audits are armed in a run."""
    monkeypatch.chdir(tmp_path)
    script = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
for step in range(60):
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)  # made anew each step
    x, y = torch.randn(32, 8), torch.randn(32)
    loss = nn.functional.mse_loss(model(x).squeeze(1), y)
    optimizer.zero_grad(); loss.backward(); optimizer.step()
print("done")
"""
    status, out, err = guard_in_process(tmp_path, capsys, script)
    assert status == 0 and "done" in out, err
    assert "opwatch guard: 60 optimizer steps ran, 9 audited under a full watch, 0 failed." in err


def test_a_running_total_of_the_loss_is_the_failed_step_s_leftover_not_a_recurrence(tmp_path, capsys, monkeypatch):
    """The loop sums its losses for the log in place (``total += loss.detach()``), a tensor the
    first audit made. After the bad batch it holds nan, and the re-check used to name its ``+=``:
    "the failure of step 3 recurred at step 4: nan first made by aten.add_.Tensor", and list it
    at the end as made from finite inputs. The steps between two audits wrote it unwatched: what
    it holds is the told failure's."""
    monkeypatch.chdir(tmp_path)
    script = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
total = torch.zeros(())
for step in range(6):
    x = torch.randn(32, 16)
    y = x.sum(-1)
    if step == 2: y[3] = float("nan")  # a bad label in one batch
    loss = ((model(x).squeeze(-1) - y) ** 2).mean()
    optimizer.zero_grad()
    loss.backward()
    total += loss.detach()  # the running total for the log
    optimizer.step()
print("total finite:", bool(total.isfinite()))
"""
    status, out, err = guard_in_process(tmp_path, capsys, script)
    assert status == 0 and "total finite: False" in out, err
    assert "optimizer step 3: the gradients about to be applied hold nan/inf" in err
    assert "the failure of step 3 did not recur: step 4 ran under a full watch and its gradients were finite." in err
    assert "recurred" not in err and "aten.add_" not in out + err
    assert "opwatch guard: 6 optimizer steps ran, 2 audited under a full watch, 1 failed (nan/inf in the gradients), 1 of them skipped." in err


@pytest.mark.parametrize("bad_label", [-1, 3])
def test_grad_scaler_s_skip_of_two_optimizers_counts_two_optimizer_steps(tmp_path, capsys, monkeypatch, bad_label):
    """float16 autocast, one GradScaler, ``scaler.step`` for each of the two optimizers: the bad
    batch's nan loss skips both. The summary counted one skip beside the 2 steps that did not
    run (14 ran, "skipped 1 more" of 16); it counts each optimizer step, and tells the nan loss
    once (it was counted as "overflows of its scaled gradients"). Healthy, nothing is skipped."""
    monkeypatch.chdir(tmp_path)
    script = split(bad_label=bad_label).replace(
        "opt_head = torch.optim.SGD(head.parameters(), lr=1e-2, momentum=0.9)",
        'opt_head = torch.optim.SGD(head.parameters(), lr=1e-2, momentum=0.9)\nscaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)',
    ).replace(
        "    features = trunk(x)\n", '    with torch.autocast("cpu", dtype=torch.float16):\n        features = trunk(x)\n',
    ).replace(
        "loss = ((head(features).squeeze(-1) - y) ** 2).mean()",
        'with torch.autocast("cpu", dtype=torch.float16):\n        out = head(features).squeeze(-1)\n    loss = ((out.float() - y) ** 2).mean()',
    ).replace("    loss.backward()\n    opt_trunk.step(); opt_head.step()",
              "    scaler.scale(loss).backward()\n    scaler.step(opt_trunk); scaler.step(opt_head)\n    scaler.update()")
    assert "scaler.step(opt_head)" in script and "dtype=torch.float16" in script
    status, out, err = guard_in_process(tmp_path, capsys, script)
    assert status == 0 and "weights finite: True" in out, err
    if bad_label < 0:
        assert "opwatch guard: 16 optimizer steps ran, 1 audited under a full watch, 0 failed." in err
    else:
        assert ("opwatch guard: 14 optimizer steps ran, 1 audited under a full watch, 0 failed; GradScaler skipped 2 more "
                "(each on a loss not finite before it was scaled)") in err
        assert err.count("the loss backward() ran on held nan before GradScaler scaled it") == 1


def fit_lightning_gan(tmp_path, data, generator_target=(1,)):
    """The GAN as a LightningModule with manual optimization, fit on ``data`` in batches of 16
    under the callback's guard mode; the generator's least-squares target has shape
    ``generator_target`` beside the discriminator's ``(16, 1)``. Returns the callback and the
    OpwatchWarnings told."""
    import io
    import warnings

    import torch
    from torch import nn

    from support import needs

    lightning = needs("lightning")
    from torch.utils.data import DataLoader, TensorDataset

    import opwatch
    from opwatch.runners.lightning import OpwatchCallback

    class GAN(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
            self.discriminator = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            (real,) = batch
            opt_g, opt_d = self.optimizers()
            fake = self.generator(torch.randn(len(real), 4))
            bce = nn.functional.binary_cross_entropy_with_logits
            ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
            d_loss = bce(self.discriminator(real), ones) + bce(self.discriminator(fake.detach()), zeros)  # DISCRIMINATOR ON REAL
            opt_d.zero_grad()
            self.manual_backward(d_loss)
            opt_d.step()
            g_loss = ((self.discriminator(fake) - torch.ones(len(real), *generator_target[1:])) ** 2).mean()  # GENERATOR'S LOSS
            opt_g.zero_grad()
            self.manual_backward(g_loss)
            opt_g.step()

        def configure_optimizers(self):
            return torch.optim.Adam(self.generator.parameters(), 2e-4), torch.optim.Adam(self.discriminator.parameters(), 2e-4)

    callback = OpwatchCallback(mode="guard", file=io.StringIO())
    trainer = lightning.Trainer(max_epochs=1, accelerator="cpu", logger=False, default_root_dir=tmp_path, callbacks=[callback],
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", opwatch.OpwatchWarning)
        trainer.fit(GAN(), DataLoader(TensorDataset(data), batch_size=16))
    return callback, [str(warning.message) for warning in caught if issubclass(warning.category, opwatch.OpwatchWarning)]


def test_a_lightning_gan_with_manual_optimization_judges_each_optimizer_s_own_backward(tmp_path):
    """The GAN in Lightning, in the callback's guard mode: a corrupt real batch fails the
    discriminator's step, told as the batch that entered the discriminator (the module the
    first step's optimizer trains; the generator, called first, was hooked before and named a
    finite call)."""
    import torch

    torch.manual_seed(0)
    data = torch.randn(16 * 6, 8) + 2
    data[16 * 3 + 5, 1] = float("nan")  # batch 3: steps 7 (discriminator) and 8 (generator)
    callback, told = fit_lightning_gan(tmp_path, data, generator_target=(16, 1))
    assert len(told) == 1, told  # a bad batch told as such: its re-check at the generator's step is quiet
    assert told[0].startswith("opwatch: optimizer step 7: the gradients about to be applied hold nan/inf: discriminator.0.weight (nan)")
    assert ("cause: input: the batch held nan before the model ran: Sequential's argument 0 (f32[16, 8] cpu) held nan when it "
            "entered the model at ") in told[0]
    assert f"test_leave_on_optimizers.py:{line_of('DISCRIMINATOR ON REAL', __file__)} (call 1 of the 2" in told[0]
    assert (callback.runner.steps, callback.runner.failed) == (12, 1)


@pytest.mark.parametrize("generator_target", [(16,), (16, 1)])
def test_a_lightning_gan_s_generator_path_is_audited_from_its_first_step(tmp_path, generator_target):
    """A ``(16,)`` target beside the discriminator's ``(16, 1)`` makes the generator's loss
    ``(16, 16)``. The callback's audit of the first batch ended at the discriminator's step; the
    generator's step arms an audit over the next batch's, which names it. With the target's
    shape right the run is silent, 3 of its 12 steps audited."""
    import torch

    torch.manual_seed(0)
    callback, told = fit_lightning_gan(tmp_path, torch.randn(16 * 6, 8) + 2, generator_target=generator_target)
    assert (callback.runner.steps, callback.runner.audited, callback.runner.failed) == (12, 3, 0)
    assert not [text for text in told if text.startswith("opwatch:")]  # no step failed
    if generator_target == (16, 1):
        assert callback.anomalies == [] and told == []
        return
    line = line_of("GENERATOR'S LOSS", __file__)
    assert [(anomaly.kind, anomaly.op, anomaly.where) for anomaly in callback.anomalies] == [("broadcast", "aten.sub.Tensor", f"{__file__}:{line}")]
    assert [text.splitlines()[0] for text in told] == [f"broadcast in aten.sub.Tensor at {__file__}:{line} (forward)"]
