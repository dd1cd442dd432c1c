"""Functions that reject a device or a dtype before any op reaches the dispatch mode
(opwatch.checks.pre_dispatch, judged by the function mode of opwatch.modes.functions).

``meta`` stands in for a GPU. Every function of the table has a case that must flag (at the
user's line, saying where the odd tensor was made) and a healthy one that must not.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import opwatch
from opwatch.checks import DEFAULT_CHECK_NAMES
from opwatch.checks import pre_dispatch
from opwatch.render.messages import explain
from support.helpers import line_of

HERE = os.path.abspath(__file__)


def _unwatched_error(call):
    with pytest.raises(Exception) as caught:
        call()
    return caught.value


# The pre-dispatch check is opt-in (its function mode costs on every torch call).
WITH_PRE_DISPATCH = ["device_mismatch", "dtype_mismatch", "broadcast", "nonfinite", "pre_dispatch"]


def _watched(call, *, checks=WITH_PRE_DISPATCH):
    """Run ``call`` under watch(); return (watch, the exception it raised or None)."""
    error = None
    try:
        with opwatch.watch(warn=False, dump_on_error=False, checks=checks) as w:
            call()
    except Exception as raised:
        error = raised
    return w, error


def _only(w, rule):
    found = [a for a in w.anomalies if a.finding.rule.startswith("pre_dispatch")]
    assert len(found) == 1, [str(a) for a in w.anomalies]
    assert found[0].finding.rule == rule
    return found[0]


# -- the front end of an audio model: torch.stft's window -------------------------------------------


class SpectrogramFrontEnd(nn.Module):
    def __init__(self, n_fft=64, as_buffer=True):
        super().__init__()
        if as_buffer:
            self.register_buffer("window", torch.hann_window(n_fft))
        else:
            self.window = torch.hann_window(n_fft)  # a plain attribute: .to() does not move it
        self.n_fft = n_fft

    def forward(self, wave):
        spec = torch.stft(wave, self.n_fft, hop_length=16, window=self.window, return_complex=True)  # stft call
        return spec.abs().pow(2).log1p()


def test_stft_window_left_on_the_cpu_flags_at_the_users_line_with_where_it_came_from():
    front = SpectrogramFrontEnd(as_buffer=False).to("meta")
    wave = torch.randn(2, 400, device="meta")
    expected = _unwatched_error(lambda: front(wave))
    w, error = _watched(lambda: front(wave))
    assert type(error) is type(expected) and str(error) == str(expected)  # torch's error, unchanged
    anomaly = _only(w, "pre_dispatch.device")
    assert anomaly.kind == "device_mismatch"
    assert anomaly.record.lineno == line_of("# stft call", HERE)
    facts = anomaly.finding.facts
    assert (facts["function"], facts["argument"], facts["other"], facts["requires"]) == ("torch.stft", "window", "input", "same_device")
    problem, expected_text, fix = explain(anomaly.finding)
    assert "torch.stft's window f32[64] cpu is not on the device of its input f32[2, 400] meta" in problem
    assert "SpectrogramFrontEnd.window is a plain tensor attribute" in problem
    assert "register_buffer" in fix and "device=x.device" in fix


def test_stft_window_as_a_buffer_moves_with_the_model_and_does_not_flag():
    # The flagged case above with its window registered as a buffer: .to() moves it along.
    front = SpectrogramFrontEnd(as_buffer=True).to("meta")
    wave = torch.randn(2, 400, device="meta")
    with opwatch.strict(checks=WITH_PRE_DISPATCH) as w:
        power = front(wave).mean()
    assert front.window.device.type == "meta" and power.device.type == "meta"
    stft_ops = [record for record in w.records if record.lineno == line_of("# stft call", HERE)]
    assert any(record.op == "aten._fft_r2c.default" for record in stft_ops)  # the call ran watched
    assert not w.anomalies, [str(a) for a in w.anomalies]


def test_stft_window_made_on_another_device_names_the_factory_line():
    wave = torch.randn(400)

    def run():
        window = torch.hann_window(64, device="meta")  # window made
        torch.istft(torch.stft(wave, 64, window=torch.hann_window(64), return_complex=True), 64, window=window)  # istft call

    w, error = _watched(run)
    assert isinstance(error, RuntimeError)
    anomaly = _only(w, "pre_dispatch.device")
    assert anomaly.finding.facts["function"] == "torch.istft"
    assert anomaly.record.lineno == line_of("# istft call", HERE)
    assert f"test_pre_dispatch.py:{line_of('# window made', HERE)}" in anomaly.message


# -- convolutions: an integer image against a floating bias ------------------------------------------


class SmallConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, 10)

    def forward(self, images):
        return self.head(self.conv(images).relu().mean((2, 3)))  # conv net call


def test_uint8_images_into_a_conv_net_flag_at_the_call():
    model = SmallConvNet()

    def run():
        images = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
        model(images)

    expected = _unwatched_error(run)
    w, error = _watched(run)
    assert type(error) is type(expected) and str(error) == str(expected)
    anomaly = _only(w, "pre_dispatch.dtype")
    assert anomaly.record.lineno == line_of("# conv net call", HERE)
    assert anomaly.finding.facts["argument"] == "input" and anomaly.finding.facts["other"] == "bias"
    problem, _, fix = explain(anomaly.finding)
    assert "F.conv2d's input u8[2, 3, 8, 8] cpu is not in the dtype of its bias f32[8] cpu" in problem
    assert "made by aten.randint" in problem
    assert "floating point" in fix


def test_float64_images_into_nn_conv_are_reported_once_by_the_module_call_check():
    model = SmallConvNet()
    w, error = _watched(lambda: model(torch.randn(2, 3, 8, 8, dtype=torch.float64)))
    assert isinstance(error, RuntimeError)
    assert len(w.anomalies) == 1 and w.anomalies[0].finding.rule != "pre_dispatch.dtype"


def test_functional_conv_with_a_float64_input_flags_and_a_float32_one_does_not():
    weight, bias = torch.randn(4, 3, 3), torch.randn(4)
    w, error = _watched(lambda: F.conv1d(torch.randn(2, 3, 16, dtype=torch.float64), weight, bias))  # conv1d call
    assert isinstance(error, RuntimeError)
    assert _only(w, "pre_dispatch.dtype").record.lineno == line_of("# conv1d call", HERE)
    with opwatch.strict(checks=WITH_PRE_DISPATCH):
        F.conv1d(torch.randn(2, 3, 16), weight, bias)
        F.conv3d(torch.randn(1, 3, 4, 4, 4), torch.randn(2, 3, 3, 3, 3), torch.randn(2))


def test_conv_under_autocast_mixing_is_legal():
    model = SmallConvNet()
    with opwatch.strict(checks=WITH_PRE_DISPATCH) as w, torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(torch.randn(2, 3, 8, 8))  # float32 input and weights, cast by autocast
    assert logits.dtype == torch.bfloat16
    (conv,) = [record for record in w.records if record.op == "aten.convolution.default"]
    assert [meta.dtype for meta in conv.inputs] == [torch.bfloat16] * 3  # autocast's casts, not a mismatch
    assert conv.lineno == line_of("# conv net call", HERE)
    assert not w.anomalies, [str(a) for a in w.anomalies]


# -- packed sequences: the lengths stay on the CPU ---------------------------------------------------


class PackedEncoder(nn.Module):
    def __init__(self, enforce_sorted=False):
        super().__init__()
        self.enforce_sorted = enforce_sorted
        self.embed = nn.Embedding(20, 8)
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.out = nn.Linear(16, 2)

    def forward(self, tokens, lengths):
        packed = pack_padded_sequence(self.embed(tokens), lengths, batch_first=True, enforce_sorted=self.enforce_sorted)  # pack call
        output, (h, _) = self.lstm(packed)
        pad_packed_sequence(output, batch_first=True)
        return self.out(h[-1])


@pytest.mark.parametrize("enforce_sorted", [True, False])
def test_lengths_on_the_gpu_flag_at_the_pack_call(enforce_sorted):
    model = PackedEncoder(enforce_sorted).to("meta")

    def run():
        tokens = torch.randint(0, 20, (3, 6), device="meta")
        lengths = (tokens != 0).sum(1)  # lengths made
        model(tokens, lengths)

    expected = _unwatched_error(run)
    w, error = _watched(run)
    assert type(error) is type(expected) and str(error) == str(expected)
    anomaly = _only(w, "pre_dispatch.device")
    assert anomaly.record.lineno == line_of("# pack call", HERE)
    assert anomaly.finding.facts["requires"] == "cpu"
    problem, _, fix = explain(anomaly.finding)
    assert "pack_padded_sequence gets lengths i64[3] meta" in problem
    # Unsorted lengths reach torch's packing op as the sorted copy pack_padded_sequence makes.
    made = line_of("# lengths made", HERE) if enforce_sorted else line_of("# pack call", HERE)
    assert f"made by {'aten.sum' if enforce_sorted else 'aten.sort'}" in problem and f"at {HERE}:{made}." in problem
    assert "lengths.cpu()" in fix


def test_cpu_lengths_with_data_on_the_gpu_do_not_flag():
    model = PackedEncoder().to("meta")
    tokens = torch.randint(0, 20, (3, 6), device="meta")
    lengths = torch.tensor([6, 4, 2])
    with opwatch.watch(checks=WITH_PRE_DISPATCH) as w:
        try:
            model(tokens, lengths)
        except NotImplementedError:
            pass  # the LSTM has no meta kernel: the pack call itself was judged first
    # Neither the call nor the packing op (CPU lengths with data on the GPU is how it is used).
    assert not w.anomalies, [str(a) for a in w.anomalies]


def test_padding_a_packed_sequence_back_on_the_gpu_does_not_flag():
    data = torch.randn(3, 6, 8, device="meta")
    with opwatch.strict(checks=WITH_PRE_DISPATCH):
        packed = pack_padded_sequence(data, torch.tensor([6, 4, 2]), batch_first=True)
        padded, lengths = pad_packed_sequence(packed, batch_first=True)
    assert padded.device.type == "meta" and lengths.device.type == "cpu"


def test_packed_lstm_training_loop_is_healthy():
    torch.manual_seed(0)
    model = PackedEncoder()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    with opwatch.strict(checks=WITH_PRE_DISPATCH) as w:
        for _ in range(3):
            tokens = torch.randint(1, 20, (4, 7))
            lengths = torch.tensor([7, 5, 3, 2])
            loss = F.cross_entropy(model(tokens, lengths), torch.tensor([0, 1, 1, 0]))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    assert not w.anomalies


def test_conv_and_stft_training_loops_are_healthy():
    torch.manual_seed(0)
    conv, front = SmallConvNet(), SpectrogramFrontEnd()
    head = nn.Linear(33, 2)
    optimizer = torch.optim.SGD([*conv.parameters(), *head.parameters()], lr=0.1)
    with opwatch.strict(checks=WITH_PRE_DISPATCH) as w:
        for _ in range(3):
            images = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8).float() / 255
            features = front(torch.randn(2, 400)).mean(-1)
            loss = conv(images).logsumexp(-1).mean() + head(features).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    assert not w.anomalies


# -- the rest of the table: labels, comparisons, quantiles, grids ------------------------------------


@pytest.mark.parametrize(
    "call, rule, function",
    [
        (lambda: F.one_hot(torch.tensor([0, 2, 1], dtype=torch.int32), 3), "pre_dispatch.dtype", "F.one_hot"),
        (lambda: torch.isclose(torch.randn(4), torch.randn(4, dtype=torch.float64)), "pre_dispatch.dtype", "torch.isclose"),
        (lambda: torch.randn(4).isclose(torch.randn(4, dtype=torch.float64)), "pre_dispatch.dtype", "Tensor.isclose"),
        (lambda: torch.quantile(torch.randn(8), torch.tensor([0.1, 0.9], dtype=torch.float64)), "pre_dispatch.dtype", "torch.quantile"),
        (lambda: torch.randn(8).nanquantile(torch.tensor([0.5], device="meta")), "pre_dispatch.device", "Tensor.nanquantile"),
        (lambda: torch.meshgrid(torch.arange(3.0), torch.arange(2.0, dtype=torch.float64), indexing="ij"), "pre_dispatch.dtype", "torch.meshgrid"),
        (lambda: torch.cartesian_prod(torch.arange(3.0), torch.arange(2.0, device="meta")), "pre_dispatch.device", "torch.cartesian_prod"),
    ],
    ids=["one_hot", "isclose", "Tensor.isclose", "quantile", "nanquantile", "meshgrid", "cartesian_prod"],
)
def test_each_other_function_of_the_table_flags(call, rule, function):
    expected = _unwatched_error(call)
    w, error = _watched(call)
    assert type(error) is type(expected) and str(error) == str(expected)
    anomaly = _only(w, rule)
    assert anomaly.finding.facts["function"] == function
    assert anomaly.record.filename == HERE
    with pytest.raises(opwatch.AnomalyError):
        with opwatch.strict(checks=WITH_PRE_DISPATCH, dump_on_error=False):
            call()


def test_healthy_uses_of_the_table_do_not_flag():
    x = torch.randn(8)
    with opwatch.strict(checks=WITH_PRE_DISPATCH) as w:
        F.one_hot(torch.tensor([0, 2, 1]), 3)
        torch.isclose(x, x.clone())
        torch.quantile(x, torch.tensor([0.1, 0.9]))
        x.nanquantile(0.5)
        torch.meshgrid(torch.arange(3.0), torch.arange(2.0), indexing="xy")
        torch.cartesian_prod(torch.arange(3), torch.arange(2))
        torch.stft(x.repeat(50), 64, window=torch.hann_window(64), return_complex=True)
    assert not w.anomalies


# -- strict, watch, cost ------------------------------------------------------------------------------


def test_strict_raises_before_torch_runs_the_function():
    wave, window = torch.randn(400), torch.hann_window(64, device="meta")
    with pytest.raises(opwatch.AnomalyError) as caught:
        with opwatch.strict(checks=WITH_PRE_DISPATCH, dump_on_error=False) as w:
            torch.stft(wave, 64, window=window, return_complex=True)
    assert caught.value.anomaly.record.op == "torch.stft"
    assert [record.op for record in w.records] == ["torch.stft"]  # no op of stft ran


def test_a_healthy_call_adds_no_entry_and_no_op():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    wave, window = torch.randn(400), torch.hann_window(64)
    with Count() as plain:
        torch.stft(wave, 64, window=window, return_complex=True)
    with opwatch.watch(checks=WITH_PRE_DISPATCH) as w:
        torch.stft(wave, 64, window=window, return_complex=True)
    assert [record.op for record in w.records] == plain.ops


def test_the_function_mode_runs_only_when_on_and_leaves_on_exit():
    window = torch.hann_window(64, device="meta")
    without_it = [name for name in DEFAULT_CHECK_NAMES if name != "pre_dispatch"]
    for without in (["broadcast"], without_it):  # not asked for, or turned off
        w, error = _watched(lambda: torch.stft(torch.randn(400), 64, window=window, return_complex=True), checks=without)
        assert isinstance(error, RuntimeError) and not w.anomalies
    depth = torch._C._len_torch_function_stack()
    for checks in (None, WITH_PRE_DISPATCH):  # on by default, and when named
        with pytest.raises(RuntimeError):
            with opwatch.watch(warn=False, dump_on_error=False, checks=checks) as w:
                assert torch._C._len_torch_function_stack() == depth + 1
                torch.stft(torch.randn(400), 64, window=window, return_complex=True)
        assert [a.kind for a in w.anomalies] == ["device_mismatch"]
    assert torch._C._len_torch_function_stack() == depth
    with pytest.raises(RuntimeError):
        with opwatch.watch(warn=False, dump_on_error=False, checks=WITH_PRE_DISPATCH):
            assert torch._C._len_torch_function_stack() == depth + 1
            torch.stft(torch.randn(400), 64, window=window, return_complex=True)
    assert torch._C._len_torch_function_stack() == depth


def test_inert_in_a_forked_child():
    if not hasattr(os, "fork"):
        pytest.skip("no fork")
    window = torch.hann_window(64, device="meta")
    with opwatch.strict(checks=WITH_PRE_DISPATCH, dump_on_error=False):
        pid = os.fork()
        if pid == 0:  # the child: the watch is inert, torch's own error comes through
            # One thread: stft pads the signal in an OpenMP region, and libgomp's pool does not
            # survive a fork once an earlier test used it (the child would wait on it forever).
            torch.set_num_threads(1)
            try:
                torch.stft(torch.randn(400), 64, window=window, return_complex=True)
            except opwatch.AnomalyError:
                os._exit(3)
            except RuntimeError:
                os._exit(0)
            os._exit(4)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_judges_are_plain_functions_of_the_arguments():
    table = pre_dispatch.table()
    wave = torch.randn(400)
    assert pre_dispatch.judge(table[torch.stft], (wave, 64), {"window": torch.hann_window(64)}) is None
    finding = pre_dispatch.judge(table[torch.stft], (wave, 64, 16, 64, torch.hann_window(64, device="meta")), {})
    assert finding.rule == "pre_dispatch.device" and finding.facts["metas"][0][2] == torch.device("meta")
    conv = table[torch.conv2d]
    images = torch.zeros(1, 3, 4, 4)
    assert pre_dispatch.judge(conv, (images.double(), torch.randn(2, 3, 3, 3), torch.randn(2)), {}, "_conv_forward") is None
    assert pre_dispatch.judge(conv, (images.long(), torch.randn(2, 3, 3, 3), torch.randn(2)), {}, "_conv_forward") is not None
    bias_alone = pre_dispatch.judge(conv, (images, torch.randn(2, 3, 3, 3), torch.randn(2).double()), {})
    assert bias_alone.facts["argument"] == "bias" and "rather than the bias alone" in explain(bias_alone)[2]


def test_saved_findings_render_again_as_the_live_ones(tmp_path):
    front = SpectrogramFrontEnd(as_buffer=False).to("meta")
    model = PackedEncoder().to("meta")

    def run():
        for call in (
            lambda: front(torch.randn(2, 400, device="meta")),
            lambda: SmallConvNet()(torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)),
            lambda: model(torch.randint(0, 20, (3, 6), device="meta"), torch.tensor([6, 4, 2], device="meta")),
        ):
            try:
                call()
            except RuntimeError:
                pass  # torch's own error, as without the watch

    w, error = _watched(run)
    assert error is None
    rules = [a.finding.rule for a in w.anomalies]
    assert rules == ["pre_dispatch.device", "pre_dispatch.dtype", "pre_dispatch.device"], rules
    path = tmp_path / "run.jsonl"
    w.export_jsonl(path)
    saved = opwatch.load(path)
    assert [str(s) for s in saved.anomalies] == [str(a) for a in w.anomalies]
    assert "made by aten.randint" in str(saved.anomalies[1])


# -- one numbering for every op the watch logs ----------------------------------------------------


def test_the_log_numbers_ops_function_calls_and_module_calls_in_one_sequence_across_blocks():
    """The dispatch mode's ops, the function mode's calls and the module calls are numbered by
    the one log (OpLog.log_call): no index twice, none skipped, and a Watch's second block goes
    on counting where its first stopped."""
    model = SmallConvNet()
    w = opwatch.watch(warn=False, dump_on_error=False, checks=WITH_PRE_DISPATCH)
    with w:
        model(torch.randn(2, 3, 8, 8))
        with pytest.raises(RuntimeError):
            model(torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8))  # a function-mode finding (F.conv2d)
    first_block = [record.index for record in w.records]
    with w:
        with pytest.raises(RuntimeError):
            model(torch.randn(2, 3, 8, 8, dtype=torch.float64))  # a module-call finding (Conv2d.forward)
        model(torch.randn(2, 3, 8, 8))
    indices = [record.index for record in w.records]
    assert indices == list(range(len(indices))) and indices[: len(first_block)] == first_block
    calls = {str(record.func) for record in w.records if record.flags}
    assert calls == {"F.conv2d", "Conv2d.forward"}, calls


# -- the function mode stands aside while torch's own optimizer steps -------------------------------


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.LayerNorm(16), nn.Linear(16, 3))

    def forward(self, x):
        return self.body(x)


def _function_mode_calls(monkeypatch):
    """``(seen, inside)``: the names of the function mode's calls are appended to ``seen`` while
    ``inside[0]`` is true."""
    from opwatch.modes.functions import FunctionWatch

    seen, inside = [], [False]
    original = FunctionWatch.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        if inside[0]:
            seen.append(getattr(func, "__qualname__", repr(func)))
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(FunctionWatch, "__torch_function__", counting)
    return seen, inside


def _calls_seen_inside_steps(monkeypatch, make_optimizer, *, other_hook=None):
    """Train a few steps under watch(); return the names of the function mode's calls made
    while ``optimizer.step()`` ran (``other_hook``: with a global step hook of the program's,
    ``"pre"`` or ``"post"``)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    seen, inside = _function_mode_calls(monkeypatch)
    model = Classifier()
    optimizer = make_optimizer(model.parameters())
    x, labels = torch.randn(8, 6), torch.randint(0, 3, (8,))
    depth = torch._C._len_torch_function_stack()
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        register = {"pre": register_optimizer_step_pre_hook, "post": register_optimizer_step_post_hook}.get(other_hook)
        handle = register(lambda *args: None) if register else None
        for _ in range(3):
            optimizer.zero_grad()
            F.cross_entropy(model(x), labels).backward()
            inside[0] = True
            optimizer.step()
            inside[0] = False
            assert torch._C._len_torch_function_stack() == depth + 1  # back on the stack
        if handle is not None:
            handle.remove()
    assert torch._C._len_torch_function_stack() == depth and not w.anomalies
    return seen


@pytest.mark.parametrize(
    "make_optimizer",
    [lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), lambda p: torch.optim.Adam(p, lr=1e-3, foreach=False), lambda p: torch.optim.AdamW(p, foreach=True)],
    ids=["sgd", "adam", "adamw-foreach"],
)
def test_a_torch_optimizer_step_runs_without_the_function_mode(monkeypatch, make_optimizer):
    seen = _calls_seen_inside_steps(monkeypatch, make_optimizer)
    # Only the end of the step's profiler region passes by (the mode is back for it), and its start.
    assert seen and all("record_function" in name or "RecordFunction" in name for name in seen), seen
    # With a step hook of the program's (it may call anything), the mode stays on.
    for other_hook in ("pre", "post"):
        seen = _calls_seen_inside_steps(monkeypatch, make_optimizer, other_hook=other_hook)
        assert len([name for name in seen if "ecord" not in name]) >= 3 * 8, (other_hook, seen)


def test_a_torch_optimizer_step_still_runs_without_the_function_mode_after_a_guard(monkeypatch):
    # A guard adds opwatch's one global step post-hook for the process (who last wrote the
    # weights): opwatch's own, which calls nothing the mode judges, so the mode still stands aside.
    model = Classifier()
    step = opwatch.guard(lambda x: model(x).sum().backward(), model, repro=False)
    step(torch.randn(8, 6))
    from opwatch.session.optimizer_steps import steps_followed

    assert steps_followed.handle is not None
    seen = _calls_seen_inside_steps(monkeypatch, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    assert seen and all("record_function" in name or "RecordFunction" in name for name in seen), seen


def test_the_same_records_with_the_function_mode_aside_or_not(monkeypatch):
    """The function mode judges calls, the dispatch mode logs ops: standing aside changes no
    record (index, op, site, module, phase, arguments, tensors)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def records(keep_the_mode_on):
        torch.manual_seed(0)
        model = Classifier()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        handle = register_optimizer_step_pre_hook(lambda *args: None) if keep_the_mode_on else None  # another hook: no standing aside
        try:
            x, labels = torch.randn(8, 6), torch.randint(0, 3, (8,))
            with opwatch.watch(warn=False) as w:
                for _ in range(2):
                    optimizer.zero_grad()
                    F.cross_entropy(model(x), labels).backward()
                    optimizer.step()
        finally:
            if handle is not None:
                handle.remove()
        return [(r.index, r.op, r.where, r.module, r.phase, r.args, [m[:3] for m in r.inputs], [m[:3] for m in r.outputs or ()]) for r in w.records]

    aside, on = records(False), records(True)
    assert aside == on and len(aside) > 50


def test_a_table_function_in_a_closure_step_still_flags(monkeypatch):
    model = Classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, labels = torch.randn(8, 6), torch.randint(0, 3, (8,))

    def closure():
        loss = F.cross_entropy(model(x), labels)
        torch.isclose(loss, loss.double())  # raises in torch before any op: float32 against float64
        loss.backward()
        return loss

    def train_step():
        optimizer.zero_grad()
        optimizer.step(closure)

    w, error = _watched(train_step)
    assert isinstance(error, RuntimeError)
    assert _only(w, "pre_dispatch.dtype").finding.facts["function"] == "torch.isclose"


def test_a_table_function_in_the_programs_own_step_hook_still_flags():
    model = Classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checked = []

    def compare_with_the_reference(opt, args, kwargs):
        checked.append(torch.isclose(model.body[0].weight, model.body[0].weight.double()))

    optimizer.register_step_pre_hook(compare_with_the_reference)

    def train_step():
        F.cross_entropy(model(torch.randn(8, 6)), torch.randint(0, 3, (8,))).backward()
        optimizer.step()

    w, error = _watched(train_step)
    assert isinstance(error, RuntimeError) and not checked
    assert _only(w, "pre_dispatch.dtype").finding.facts["function"] == "torch.isclose"


def test_after_a_step_that_raised_the_function_mode_is_back_and_flags():
    """A step raising with the mode aside (an optimizer state loaded for another model): the
    mode comes back at the end of the step's profiler region, which ends on the way out."""
    model = Classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer.state[model.body[0].bias]["momentum_buffer"] = torch.zeros(5)  # the bias has 16
    depth = torch._C._len_torch_function_stack()

    def train_on():
        F.cross_entropy(model(torch.randn(8, 6)), torch.randint(0, 3, (8,))).backward()
        with pytest.raises(RuntimeError):
            optimizer.step()
        assert torch._C._len_torch_function_stack() == depth + 1
        F.one_hot(torch.tensor([0, 2, 1], dtype=torch.int32), 3)  # a dtype F.one_hot rejects

    w, error = _watched(train_on)
    assert isinstance(error, RuntimeError), error
    assert _only(w, "pre_dispatch.dtype").finding.facts["function"] == "F.one_hot"
    assert torch._C._len_torch_function_stack() == depth


# -- and while torch's own zero_grad resets the gradients ------------------------------------------


def _calls_seen_inside_zero_grad(monkeypatch, reset):
    """Train a few steps under watch(), resetting the gradients with ``reset(model, optimizer)``;
    return the names of the function mode's calls made during the resets."""
    seen, inside = _function_mode_calls(monkeypatch)
    model = Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, labels = torch.randn(8, 6), torch.randint(0, 3, (8,))
    depth = torch._C._len_torch_function_stack()
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        for _ in range(3):
            F.cross_entropy(model(x), labels).backward()
            optimizer.step()
            inside[0] = True
            reset(model, optimizer)
            inside[0] = False
            assert torch._C._len_torch_function_stack() == depth + 1  # back on the stack
            assert all(p.grad is None for p in model.parameters())
    assert torch._C._len_torch_function_stack() == depth and not w.anomalies
    return seen


@pytest.mark.parametrize("reset", [lambda model, optimizer: optimizer.zero_grad(), lambda model, optimizer: model.zero_grad()],
                         ids=["optimizer", "module"])
def test_torchs_zero_grad_runs_without_the_function_mode_and_is_torchs_own_again_after(monkeypatch, reset):
    optimizer_reset, module_reset = torch.optim.Optimizer.zero_grad, nn.Module.zero_grad
    seen = _calls_seen_inside_zero_grad(monkeypatch, reset)
    assert seen == [], seen  # 8 parameters: 16 reads and writes of .grad passed the mode before
    assert (torch.optim.Optimizer.zero_grad, nn.Module.zero_grad) == (optimizer_reset, module_reset)


def test_a_zero_grad_of_the_programs_own_runs_with_the_function_mode_and_a_table_function_in_it_flags():
    class CheckedSGD(torch.optim.SGD):
        def zero_grad(self, set_to_none=True):
            first = self.param_groups[0]["params"][0]
            torch.isclose(first, first.double())  # raises in torch before any op: float32 against float64
            super().zero_grad(set_to_none)

    model = Classifier()
    optimizer = CheckedSGD(model.parameters(), lr=0.1)

    def train_step():
        F.cross_entropy(model(torch.randn(8, 6)), torch.randint(0, 3, (8,))).backward()
        optimizer.step()
        optimizer.zero_grad()

    w, error = _watched(train_step)
    assert isinstance(error, RuntimeError)
    assert _only(w, "pre_dispatch.dtype").finding.facts["function"] == "torch.isclose"


def test_zero_grad_inside_nested_watches_and_after_a_raise_leaves_torchs_methods_and_the_stack_as_they_were():
    optimizer_reset, module_reset = torch.optim.Optimizer.zero_grad, nn.Module.zero_grad
    model = Classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    depth = torch._C._len_torch_function_stack()
    with opwatch.watch(warn=False) as w:
        with opwatch.watch(warn=False):
            F.cross_entropy(model(torch.randn(8, 6)), torch.randint(0, 3, (8,))).backward()
        assert torch.optim.Optimizer.zero_grad is not optimizer_reset  # the outer watch still has it
        optimizer.zero_grad(set_to_none=False)  # zeroed by ATen ops, which the watch logs
        assert w.records[-1].op == "aten.zero_.default" and all((p.grad == 0).all() for p in model.parameters())
        with pytest.raises(TypeError):
            optimizer.zero_grad(set_to_none=False, unknown=True)
        assert torch._C._len_torch_function_stack() == depth + 1
    assert (torch.optim.Optimizer.zero_grad, nn.Module.zero_grad) == (optimizer_reset, module_reset)
    assert torch._C._len_torch_function_stack() == depth
