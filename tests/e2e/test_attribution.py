"""Where an op is attributed: library wrapper frames are nobody's line; ops run by a module's
hooks (its own and the global ones) carry that module's path."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import sys
import warnings

import pytest
import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

import opwatch
from support import SCENARIOS, needs
from support.helpers import line_of as _line_of
from opwatch.checks.finding import Attribute, BeforeWatch, DefaultDtype, MadeBy, Owned, Place
from opwatch.storage.codec import decode, encode
from opwatch.render.messages import explain
from opwatch.core.sites import INTERNAL, USER, classify_code, display_path

import hooks_wrappers as hw  # noqa: E402

SCENARIO = str(SCENARIOS / "hooks_wrappers.py")


def line_of(text: str) -> int:
    return _line_of(text, SCENARIO)


def records_at(w, text, phase="forward"):
    line = line_of(text)
    return [r for r in w.records if r.lineno == line and r.phase == phase and r.filename == SCENARIO]


# == wrapper frames (opwatch.core.sites.classify_code) ==================================================


def code_at(*parts):
    return compile("def f():\n    pass\n", os.sep + os.path.join("env", *parts), "exec")


@pytest.mark.parametrize(
    "parts",
    [
        ("site-packages", "typing_extensions.py"),
        ("site-packages", "wrapt", "wrappers.py"),
        ("site-packages", "decorator.py"),
        ("site-packages", "deprecated", "classic.py"),
        ("dist-packages", "deprecation.py"),
    ],
    ids=lambda parts: "/".join(parts),
)
def test_wrapper_only_packages_are_not_the_users_line(parts):
    assert classify_code(code_at("lib", "python3.11", *parts)) == INTERNAL


@pytest.mark.parametrize(
    "parts",
    [
        ("site-packages", "transformers", "models", "gpt2", "modeling_gpt2.py"),
        ("site-packages", "mylib", "decorator.py"),  # a module of that name inside a package
        ("project", "decorator.py"),  # the user's own file of that name
        ("project", "train.py"),
    ],
    ids=lambda parts: "/".join(parts),
)
def test_model_code_in_other_packages_stays_the_users(parts):
    assert classify_code(code_at(*parts)) == USER


def test_standard_library_wrappers_are_internal():
    assert classify_code(functools.wraps.__code__) == INTERNAL
    assert classify_code(contextlib.contextmanager.__code__) == INTERNAL


def test_quantize_dynamic_is_attributed_to_the_callers_line_not_typing_extensions():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantize_dynamic is deprecated: that is the wrapper
        with opwatch.watch(warn=False) as w:
            hw.quantize_and_run()
    wheres = {(os.path.basename(r.filename or ""), r.lineno) for r in w.records}
    assert not any(name == "typing_extensions.py" for name, _ in wheres), wheres
    quantize_line = line_of("quantized = torch.ao.quantization.quantize_dynamic(")
    assert len(records_at(w, "quantized = torch.ao.quantization.quantize_dynamic(")) > 10
    assert {r.lineno for r in w.records if r.filename == SCENARIO} >= {quantize_line, line_of("return quantized(torch.randn(3, 4))")}


def test_a_torch_function_behind_a_deprecation_wrapper_points_at_the_call():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with opwatch.watch(warn=False) as w:
            hw.call_legacy_silu()
    silu = [r for r in w.records if r.op == "aten.silu.default"]
    assert [(r.filename, r.lineno) for r in silu] == [(SCENARIO, line_of("return legacy_silu(x) * 2"))]
    if sys.version_info >= (3, 11):  # column positions, hence the expression, are 3.11+
        assert silu[0].position.expression() == "legacy_silu(x)"


def test_hugging_face_modeling_code_stays_attributed_to_its_file():
    needs("transformers")
    from support import hf_models as hf

    model, inputs = hf.build("gpt2", "eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with opwatch.watch(warn=False) as w:
            model(**inputs).loss.backward()
    files = {os.path.basename(r.filename) for r in w.records if r.filename}
    assert "modeling_gpt2.py" in files


# == module hooks (opwatch.modes.modules) ==========================================================


def test_ops_in_a_modules_own_hooks_get_its_path_in_a_training_loop():
    with opwatch.watch(warn=False) as w:
        model, features = hw.train_with_hooks(steps=2)
    assert len(features) == 2
    pre = records_at(w, "return (args[0] * 0.5,)")
    post = records_at(w, "return output * 1.0") + records_at(w, "store.append(output.detach().mean())")
    assert pre and post
    assert {r.module for r in pre} == {"block"}
    assert {r.module for r in post} == {"block"}
    # Their backward ops carry the path too; the ops after the block are the parent's again.
    backward = records_at(w, "return output * 1.0", phase="backward")
    assert backward and {r.module for r in backward} == {"block"}
    assert {r.module for r in records_at(w, "return self.head(h.mean((2, 3)))") if r.op == "aten.mean.dim"} == {"Net"}
    assert {r.module for r in w.records if r.op == "aten.addmm.default" and r.phase == "forward"} == {"head"}
    # The watch leaves the module's hooks as they were.
    assert len(model.block._forward_hooks) == 0 and len(model.block._forward_pre_hooks) == 0


def test_hooks_change_no_result():
    _, reference = hw.train_with_hooks(steps=2)
    with opwatch.watch(warn=False):
        _, watched = hw.train_with_hooks(steps=2)
    assert torch.equal(torch.stack(reference), torch.stack(watched))


def test_global_hooks_registered_before_and_during_the_watch_get_the_modules_path():
    pre = register_module_forward_pre_hook(hw.global_pre_hook)  # before the watch
    try:
        with opwatch.watch(warn=False) as w:
            post = register_module_forward_hook(hw.global_hook)  # during the watch
            try:
                hw.train_with_hooks(steps=1, hooks=False)
            finally:
                post.remove()
    finally:
        pre.remove()
    pre_paths = {r.module for r in records_at(w, "return (args[0] - 0.0,)")}
    assert pre_paths == {"stem", "block.conv"}
    assert {r.module for r in records_at(w, "return output + 0.0")} == {"head"}


def test_a_forward_that_raises_leaves_the_paths_and_hooks_sound():
    model = hw.Failing()
    model.inner.register_forward_hook(lambda module, args, output: output * 2)
    x = torch.randn(2, 4)
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        with pytest.raises(RuntimeError):
            model(x)
        torch.relu(x)  # outside any module again
        model.inner(x)  # the next forward: paths as before
    assert [r.module for r in w.records if r.op == "aten.relu.default"] == [None]
    assert [r.module for r in w.records if r.op == "aten.mul.Tensor"] == ["inner", "Linear"]
    assert len(model.inner._forward_hooks) == 1


def test_a_module_called_inside_itself_with_a_hook():
    cell = hw.Recursive()
    cell.register_forward_hook(lambda module, args, output: output + 1)
    with opwatch.watch(warn=False) as w:
        cell(torch.randn(2, 4), 2)
        torch.relu(torch.ones(1))
    adds = [r.module for r in w.records if r.op == "aten.add.Tensor"]
    assert len(adds) == 3 and adds[-1] == "Recursive"
    assert [r.module for r in w.records if r.op == "aten.relu.default"] == [None]
    assert len(cell._forward_hooks) == 1


def test_on_call_sees_the_module_path_before_its_own_pre_hooks():
    from opwatch.modes.modules import ModuleStack

    seen = []
    stack = ModuleStack(on_call=lambda module, args: seen.append((stack.path, type(module).__name__)))
    model = hw.Net()
    model.block.register_forward_pre_hook(lambda module, args: seen.append(("pre-hook", stack.path)))
    stack.install()
    try:
        model(torch.randn(1, 3, 6, 6))
    finally:
        stack.uninstall()
    assert seen[:4] == [("Net", "Net"), ("stem", "Conv2d"), ("block", "Block"), ("pre-hook", "block")]


def test_nested_watches_both_give_hook_ops_the_modules_path():
    with opwatch.watch(warn=False) as outer:
        with opwatch.watch(warn=False) as inner:
            model, _ = hw.train_with_hooks(steps=1)
        hw.train_with_hooks(steps=1)
    for w in (outer, inner):
        assert {r.module for r in records_at(w, "return output * 1.0")} == {"block"}
        assert {r.module for r in w.records if r.op == "aten.addmm.default" and r.phase == "forward"} == {"head"}
    assert len(model.block._forward_hooks) == 0


# == where an odd operand was made: provenance as facts (Finding.made) =============================


def only_anomaly(body):
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        with contextlib.suppress(RuntimeError):  # torch's own error may follow the report
            body()
    (anomaly,) = w.anomalies
    return anomaly.finding


def test_a_factory_without_dtype_is_named_with_the_dtype_it_was_given():
    def body():
        x = torch.randn(4, 3)
        noise = torch.zeros(4, 3, dtype=torch.float64)  # made with dtype=float64 on purpose
        return x + noise

    finding = only_anomaly(body)
    line = _line_of("# made with dtype=float64 on purpose", __file__)
    assert finding.rule == "dtype.silent_upcast"
    assert finding.made == (("made_by", Place("aten.zeros.default", __file__, line, "forward"), ("default_dtype", torch.float64, torch.float32)),)
    problem = explain(finding)[0]
    assert problem.endswith(f"Where the odd one came from: f64[4, 3] cpu: made by aten.zeros at {display_path(__file__)}:{line} with dtype=torch.float64.")
    # A saved log holds the facts after a JSON round trip, each named tuple of its class again.
    saved = decode(json.loads(json.dumps(encode(finding.made))))
    assert saved == finding.made and type(saved[0]) is MadeBy and type(saved[0].detail) is DefaultDtype and type(saved[0].place) is Place
    assert explain(dataclasses.replace(finding, made=saved)) == explain(finding)


def test_a_parameter_a_buffer_less_attribute_and_an_outsider_are_named_as_facts():
    model = torch.nn.Linear(3, 2)
    model.bias.data = model.bias.data.double()
    made = only_anomaly(lambda: model(torch.randn(4, 3))).made
    assert made == (("parameter", "Linear", "bias", "Linear"),) and type(made[0]) is Owned and made[0].path == "Linear"

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.ones(3, dtype=torch.float64)  # a plain attribute, not a buffer

        def forward(self, x):
            return x * self.scale

    made = only_anomaly(lambda: Scaled()(torch.randn(2, 3))).made
    assert made == (("attribute", "Scaled", "scale", "Scaled"),) and type(made[0]) is Attribute
    stray = torch.zeros(3, dtype=torch.float64)
    made = only_anomaly(lambda: torch.ones(3) + stray).made
    assert made == (("before_watch",),) and type(made[0]) is BeforeWatch
    assert decode(json.loads(json.dumps(encode(made)))) == made and type(decode(encode(made))[0]) is BeforeWatch


def test_findings_without_an_odd_operand_carry_no_provenance():
    def body():
        pred = torch.nn.Linear(4, 1)(torch.randn(8, 4))
        return torch.randn(8) - pred  # a broadcast: no operand is the odd one

    finding = only_anomaly(body)
    assert finding.rule == "broadcast.implicit" and finding.odd == () and finding.made == ()
    assert "Where the odd one came from" not in explain(finding)[0]
