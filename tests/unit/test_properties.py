"""Property-based tests (hypothesis).

1. The broadcast check agrees with the rule its module docstring states, for random
   broadcastable shapes and random sets of deliberate size-1 dims: once called directly with
   metadata tuples, once end to end with real tensors whose size-1 dims are made by
   ``unsqueeze`` (deliberate) or by the factory / ``reshape`` (not deliberate).
2. In a random chain of ops with one injected nan/inf-producing op, the first anomaly is the
   injected op (its op name, line and record index).
3. Random programs (views, in-place ops, broadcasting, reductions, autograd) give bitwise the
   same results, errors and gradients watched and unwatched.
"""

from __future__ import annotations

import math
import os
import sys
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import opwatch
from opwatch.checks import broadcast
from opwatch.render.messages import explain

from support import equivalence as eq  # noqa: E402
from support.equivalence import opwatch_warnings  # noqa: E402
from support.helpers import StubContext  # noqa: E402

HERE = os.path.abspath(__file__)

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# The README's test command runs a third of each property's examples, to stay within its time on
# two cores; OPWATCH_THOROUGH_PROPERTIES=1 runs them all (CONTRIBUTING.md, "Tests").
THOROUGH = os.environ.get("OPWATCH_THOROUGH_PROPERTIES") == "1"


def examples(thorough: int) -> int:
    return thorough if THOROUGH else max(10, thorough // 3)


# ============================================================================================
# 1. the broadcast rule
# ============================================================================================
#
# The oracle, written from the docstring of opwatch/checks/broadcast.py alone:
#
#   For an op whose result has more elements than every operand:
#   - an operand is *implicitly* expanded when broadcasting prepends dims to it (read: leading
#     dims of the result that the operand lacks and that make it bigger, i.e. of size > 1);
#   - an operand is *explicitly* expanded along each of its own size-1 dims that the result
#     stretches; such a dim is *deliberate* when the program made it on purpose;
#   - flagged: some operand is implicitly expanded while *another* is explicitly expanded
#     along a dim that is not deliberate.
#
# Operands are at least 1-d here: the docstring says nothing about 0-dim (scalar) operands.


def oracle_flags(shapes, deliberate) -> bool:
    """``deliberate[i]``: the deliberate size-1 dims of operand ``i``, negative (from the right)."""
    if all(shape == shapes[0] for shape in shapes):
        return False
    result = tuple(np.broadcast_shapes(*shapes))
    if math.prod(result) <= max(math.prod(shape) for shape in shapes):
        return False  # no growth: not a candidate
    implicit = set()
    accidental = set()
    for i, shape in enumerate(shapes):
        prepended = result[: len(result) - len(shape)]
        if any(size > 1 for size in prepended):
            implicit.add(i)
        stretched = {d for d in range(-len(shape), 0) if shape[d] == 1 and result[d] > 1}
        if stretched - set(deliberate[i]):
            accidental.add(i)
    return any(i != j for i in implicit for j in accidental)


@st.composite
def shapes_and_deliberate_dims(draw):
    count = draw(st.integers(2, 3))
    min_side = draw(st.sampled_from([0, 1, 1, 1]))
    shapes = draw(hnp.mutually_broadcastable_shapes(num_shapes=count, min_dims=1, max_dims=4, min_side=min_side, max_side=4)).input_shapes
    deliberate = []
    for shape in shapes:
        size1 = [d for d in range(-len(shape), 0) if shape[d] == 1]
        how = draw(st.sampled_from(["none", "all", "some"]))
        if how == "none":
            chosen = frozenset()
        elif how == "all":
            chosen = frozenset(size1)
        else:
            chosen = frozenset(d for d in size1 if draw(st.booleans()))
        deliberate.append(chosen)
    return [tuple(shape) for shape in shapes], deliberate


@settings(max_examples=examples(300), **SETTINGS)
@given(shapes_and_deliberate_dims())
def test_broadcast_check_agrees_with_the_documented_rule(case):
    shapes, deliberate = case
    metas = [(torch.Size(shape), torch.float32, torch.device("cpu"), 1000 + i) for i, shape in enumerate(shapes)]
    context = StubContext({1000 + i: dims for i, dims in enumerate(deliberate)})
    func = torch.ops.aten.add.Tensor if len(shapes) == 2 else torch.ops.aten.addcmul.default
    finding = broadcast.check(func, tuple(metas), context)
    expected = oracle_flags(shapes, deliberate)
    assert (finding is not None) == expected, (shapes, deliberate, finding and explain(finding)[0])
    if finding is not None:
        assert finding.kind == "broadcast"
        assert "x more elements" in explain(finding)[0]


@settings(max_examples=examples(300), **SETTINGS)
@given(shapes_and_deliberate_dims())
def test_broadcast_check_with_no_or_all_deliberate_dims(case):
    """The brief's literal version: the context says "none" or "all dims" for every operand."""
    shapes, _ = case
    for everything in (False, True):
        deliberate = [frozenset(range(-len(s), 0)) if everything else frozenset() for s in shapes]
        metas = tuple((torch.Size(s), torch.float32, torch.device("cpu"), 2000 + i) for i, s in enumerate(shapes))
        context = StubContext({2000 + i: dims for i, dims in enumerate(deliberate)})
        finding = broadcast.check(torch.ops.aten.sub.Tensor, metas, context)
        assert (finding is not None) == oracle_flags(shapes, deliberate), (shapes, everything)
        if everything:
            assert finding is None  # every stretched dim deliberate: never flagged


def make_operand(shape, deliberate):
    """A tensor of ``shape`` whose size-1 dims in ``deliberate`` come from ``unsqueeze`` and whose
    other size-1 dims come from ``randn`` or ``reshape`` (not deliberate)."""
    positions = sorted(len(shape) + d for d in deliberate)
    base_shape = [size for position, size in enumerate(shape) if position not in positions]
    tensor = torch.randn(max(1, math.prod(base_shape)))
    tensor = tensor[: math.prod(base_shape)].reshape(base_shape)
    for position in positions:  # increasing: each lands at its final position
        tensor = tensor.unsqueeze(position)
    assert tuple(tensor.shape) == tuple(shape)
    return tensor


@settings(max_examples=examples(150), **SETTINGS)
@given(shapes_and_deliberate_dims())
def test_broadcast_end_to_end_with_unsqueeze_and_reshape(case):
    shapes, deliberate = case
    with opwatch.watch(checks=["broadcast"], warn=False) as w:
        # Made inside the watch: provenance of size-1 dims is what opwatch saw.
        operands = [make_operand(shape, dims) for shape, dims in zip(shapes, deliberate)]
        if len(operands) == 2:
            out = torch.add(operands[0], operands[1])
        else:
            out = torch.addcmul(*operands)
    expected = oracle_flags(shapes, deliberate)
    flagged = [a for a in w.anomalies if a.kind == "broadcast"]
    assert bool(flagged) == expected, (shapes, deliberate, [a.message for a in flagged])
    if flagged:
        assert [a.op for a in flagged] == ["aten.add.Tensor" if len(operands) == 2 else "aten.addcmul.default"]
    assert tuple(out.shape) == tuple(np.broadcast_shapes(*shapes))


@st.composite
def shapes_with_every_size1_dim_deliberate(draw):
    count = draw(st.sampled_from([2, 3, 3]))
    shapes = draw(hnp.mutually_broadcastable_shapes(num_shapes=count, min_dims=1, max_dims=4, min_side=2, max_side=4)).input_shapes
    # Many size-1 dims: each one is made by its own unsqueeze, so chains of unsqueeze are common.
    shapes = [tuple(1 if draw(st.booleans()) else size for size in shape) for shape in shapes]
    try:
        np.broadcast_shapes(*shapes)
    except ValueError:
        shapes = [tuple(shapes[0])] * count
    return shapes


@settings(max_examples=examples(250), **SETTINGS)
@given(shapes_with_every_size1_dim_deliberate())
def test_broadcast_never_flags_size1_dims_all_made_by_unsqueeze(shapes):
    """The rule flags only dims that are not deliberate: when every size-1 dim of every operand
    comes from ``unsqueeze`` (in any number, in any order of creation), nothing is flagged."""
    deliberate = [frozenset(d for d in range(-len(shape), 0) if shape[d] == 1) for shape in shapes]
    assert not oracle_flags(shapes, deliberate)
    with opwatch.watch(checks=["broadcast"], warn=False) as w:
        operands = [make_operand(shape, dims) for shape, dims in zip(shapes, deliberate)]
        if len(operands) == 2:
            torch.add(operands[0], operands[1])
        else:
            torch.addcmul(*operands)
    assert w.anomalies == [], (shapes, [a.message for a in w.anomalies])


@pytest.mark.parametrize(
    "make",
    [lambda x: x.unsqueeze(0).unsqueeze(2), lambda x: x[None, :, None], lambda x: x[:, None][None], lambda x: x.unsqueeze(-1).unsqueeze(0)],
    ids=["unsqueeze(0).unsqueeze(2)", "x[None, :, None]", "x[:, None][None]", "unsqueeze(-1).unsqueeze(0)"],
)
def test_chained_unsqueeze_keeps_every_deliberate_dim(make):
    """``(1, 3, 1)`` made from ``(3,)`` on purpose, stretched along both size-1 dims next to an
    implicitly expanded ``(5,)``: every stretched dim is deliberate, so no anomaly."""
    with opwatch.watch(checks=["broadcast"], warn=False) as w:
        a = make(torch.randn(3))
        b = torch.randn(5)
        c = torch.randn(2)[:, None, None]
        out = torch.addcmul(a, b, c)
    assert tuple(out.shape) == (2, 3, 5)
    assert w.anomalies == [], [x.message for x in w.anomalies]


def test_the_documented_examples():
    n = 5
    with opwatch.watch(checks=["broadcast"], warn=False) as w:
        pred = torch.nn.Linear(3, 1)(torch.randn(n, 3))
        y = torch.randn(n)
        y - pred  # flagged
    assert [a.op for a in w.anomalies] == ["aten.sub.Tensor"]
    with opwatch.watch(checks=["broadcast"], warn=False) as w:
        x = torch.randn(4, 6)
        x - x.mean(-1, keepdim=True)
        torch.randn(2, 1, 1, 6) + torch.randn(2, 3, 6, 6)
        a, b = torch.randn(4), torch.randn(6)
        a[:, None] - b[None]
        a.view(-1, 1) * b.view(1, -1)
        pos = torch.arange(7)
        inv_freq = torch.randn(3)
        pos[..., None].float() * inv_freq
        torch.outer(a, b)
    assert w.anomalies == []


# ============================================================================================
# 2. the first nan/inf anomaly is the injected op
# ============================================================================================
#
# Every op below sits on its own line, so a record's line names the menu entry that issued it.

SAFE = [  # finite in -> finite out, values stay small
    lambda x: x.sin(),
    lambda x: x.cos(),
    lambda x: x.tanh(),
    lambda x: x.sigmoid(),
    lambda x: x * 0.5,
    lambda x: x + 1.0,
    lambda x: x.abs(),
    lambda x: -x,
    lambda x: x.clamp(-2.0, 2.0),
    lambda x: x.relu(),
    lambda x: x - x.mean(),
    lambda x: x.cumsum(-1) if x.dim() else x,
    lambda x: x.softmax(-1) if x.dim() else x,
    lambda x: x.clamp(-5.0, 5.0).exp(),
    lambda x: x.sum(),
    lambda x: x.mean(-1, keepdim=True) * x if x.dim() else x,
]

INJECT = [  # (op that makes the first nan/inf, function) -- for any finite input
    ("aten.log.default", lambda x: (x * 0).log()),
    ("aten.div.Tensor", lambda x: x / 0.0),
    ("aten.sqrt.default", lambda x: (-(x.abs() + 1)).sqrt()),
    ("aten.exp.default", lambda x: (x.abs() + 1000.0).exp()),
    ("aten.div.Tensor", lambda x: (x * 0) / (x * 0)),
    ("aten.acos.default", lambda x: (x.abs() + 2.0).acos()),
    ("aten.reciprocal.default", lambda x: (x * 0).reciprocal()),
    ("aten.pow.Tensor_Scalar", lambda x: (x * 0).pow(-1.0)),
]
NAN_INJECT = [2, 4, 5]  # indexes into INJECT of the ops that always make nan

AFTER = SAFE + [  # what may follow: anything, including ops that turn inf into nan
    lambda x: x * 0,
    lambda x: x - x,
    lambda x: x.exp(),
    # Moderate replacements: the defaults (the dtype's max) make a genuine overflow later likely.
    lambda x: torch.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0),
]


@st.composite
def chain_strategy(draw, inject_choices, after_menu):
    """3 to 8 ops: ``before`` safe ops, the injected op, ``after`` ops from ``after_menu``."""
    length = draw(st.integers(3, 8))
    position = draw(st.integers(0, length - 1))
    return {
        "shape": draw(st.sampled_from([(), (3,), (2, 3)])),
        "dtype": draw(st.sampled_from([torch.float32, torch.float64])),
        "before": draw(st.lists(st.integers(0, len(SAFE) - 1), min_size=position, max_size=position)),
        "inject": draw(st.sampled_from(inject_choices)),
        "after": draw(st.lists(st.integers(0, len(after_menu) - 1), min_size=length - 1 - position, max_size=length - 1 - position)),
    }


def start_value(case):
    return torch.linspace(-1.0, 1.0, max(1, math.prod(case["shape"])), dtype=case["dtype"]).reshape(case["shape"])


def injected_kind(case) -> str:
    """What the injected op makes, worked out without a watch (reading values inside the
    watch would be a check point of its own)."""
    x = start_value(case)
    for index in case["before"]:
        x = SAFE[index](x)
    assert torch.isfinite(x).all()
    x = INJECT[case["inject"]][1](x)
    assert not torch.isfinite(x).all()
    return "nan" if torch.isnan(x).any() else "inf"


def run_chain(case, *, keep):
    expected_op, inject = INJECT[case["inject"]]
    kind = injected_kind(case)
    kept = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with opwatch.watch(warn=False) as w:
            x = start_value(case)
            for index in case["before"]:
                x = SAFE[index](x)
                if keep:
                    kept.append(x)
            x = inject(x)
            if keep:
                kept.append(x)
            for index in case["after"]:
                x = AFTER[index](x)
                if keep:
                    kept.append(x)
            final = x
            del x  # only ``final`` (and ``kept``) survive to the check point at the block's end
    assert opwatch_warnings(caught) == []  # warn=False: only an internal error would warn
    line = inject.__code__.co_firstlineno
    candidates = [r for r in w.records if r.op == expected_op and r.lineno == line and r.filename == HERE]
    assert len(candidates) == 1, [(r.op, r.where) for r in w.records]
    return w, candidates[0], kind, final, expected_op, line


@settings(max_examples=examples(40), **SETTINGS)
@given(chain_strategy(list(range(len(INJECT))), AFTER))
def test_first_anomaly_is_the_injected_op(case):
    """All intermediates stay alive, so the injected origin matters whatever follows it."""
    w, injected, kind, _, expected_op, line = run_chain(case, keep=True)
    assert w.anomalies, "no anomaly at all"
    first = w.anomalies[0]
    assert (first.op, first.lineno, first.index) == (expected_op, line, injected.index), [a.message for a in w.anomalies]
    assert first.kind == kind
    assert kind in injected.flags


@settings(max_examples=examples(40), **SETTINGS)
@given(chain_strategy(list(range(len(INJECT))), AFTER))
def test_first_anomaly_is_the_injected_op_when_intermediates_die(case):
    """The plain training-loop shape: ``x = op(x)``, only the result survives. Whatever the later
    ops do to the non-finite values (carry them, turn inf into nan with ``sin`` / ``x - x`` /
    ``x * 0``), when the result is not finite an anomaly is reported and the first one names
    the op that made the first nan/inf, not a later op that merely transformed it."""
    w, injected, kind, final, expected_op, line = run_chain(case, keep=False)
    if not torch.isfinite(final).all():
        assert w.anomalies, "a non-finite result but no anomaly"
    if w.anomalies:
        first = w.anomalies[0]
        contained = [(c.op, c.lineno, c.index) for c in w.contained]
        if (first.op, first.lineno) != (expected_op, line) and contained[:1] == [(expected_op, line, injected.index)]:
            # The injected values were absorbed (clamp(inf) = 5) and a later op made a nan/inf of
            # its own from the finite values that went on (exp(exp(5)) overflows float32): that
            # op is an origin of its own, the injected one is contained.
            assert first.index > injected.index and "from finite inputs" in first.message, first.message
            return
        assert (first.op, first.lineno, first.index) == (expected_op, line, injected.index), (
            [a.message for a in w.anomalies],
            contained,
        )


@settings(max_examples=examples(25), **SETTINGS)
@given(chain_strategy(NAN_INJECT, SAFE))
def test_nan_carried_to_the_result_is_one_anomaly_at_its_origin(case):
    """Intermediates die; the nan reaches the final value through nan-propagating ops: exactly
    one anomaly, at the injected op, and no contained origins."""
    w, injected, kind, final, expected_op, line = run_chain(case, keep=False)
    assert torch.isnan(final).any()
    assert kind == "nan"
    assert [(a.kind, a.op, a.lineno, a.index) for a in w.anomalies] == [("nan", expected_op, line, injected.index)]
    assert w.contained == []


ABSORB = [  # -inf in -> finite out
    lambda x: x.relu(),
    lambda x: x.clamp(-2.0, 2.0),
    lambda x: x.sigmoid(),
    lambda x: x.exp(),
    lambda x: x.tanh(),
    lambda x: torch.nan_to_num(x, neginf=-1.0),
    lambda x: torch.where(x > -1.0, x, torch.zeros_like(x)),
]


def first_log(x):
    return (x * 0).log()  # an early -inf, absorbed later on purpose


@settings(max_examples=examples(40), **SETTINGS)
@given(
    shape=st.sampled_from([(), (3,), (2, 3)]),
    absorb=st.integers(0, len(ABSORB) - 1),
    middle=st.lists(st.integers(0, len(SAFE) - 1), max_size=3),
    inject=st.integers(0, len(INJECT) - 1),
)
@example(shape=(3,), absorb=1, middle=[], inject=1)  # clamp(-inf) = -2, then -2 / 0 = -inf
@example(shape=(2, 3), absorb=4, middle=[6], inject=1)  # tanh, abs, then 1 / 0
def test_an_absorbed_origin_does_not_take_the_blame_for_a_later_one(shape, absorb, middle, inject):
    """``log(0)`` made -inf that a later op absorbed (T5 style); afterwards a second op makes a
    fresh nan/inf that reaches the result. The anomaly is that second op; the log is contained."""
    expected_op, make_bad = INJECT[inject]
    with opwatch.watch(warn=False) as w:
        x = start_value({"shape": shape, "dtype": torch.float32})
        x = first_log(x)
        x = ABSORB[absorb](x)
        for index in middle:
            x = SAFE[index](x)
        final = make_bad(x)
        del x
    assert torch.isfinite(ABSORB[absorb](torch.tensor(-math.inf))).all()
    assert not torch.isfinite(final).all()
    line = make_bad.__code__.co_firstlineno
    log_line = first_log.__code__.co_firstlineno + 1
    assert [(a.op, a.lineno) for a in w.anomalies] == [(expected_op, line)], [a.message for a in w.anomalies]
    assert [(c.op, c.lineno) for c in w.contained] == [("aten.log.default", log_line)]


# ============================================================================================
# 3. random programs: watched == unwatched, bitwise
# ============================================================================================

UNARY = {
    "sin": lambda a: a.sin(),
    "tanh": lambda a: a.tanh(),
    "exp": lambda a: a.clamp(-3, 3).exp(),
    "abs": lambda a: a.abs(),
    "scale": lambda a: a * 1.5,
    "shift": lambda a: a + 0.25,
    "relu": lambda a: a.relu(),
    "softmax": lambda a: a.softmax(-1),
    "cumsum": lambda a: a.cumsum(-1),
    "sum0": lambda a: a.sum(0),
    "mean_keep": lambda a: a.mean(-1, keepdim=True),
    "amax": lambda a: a.amax(-1),
    "float64": lambda a: a.double(),
}
VIEWS = {
    "t": lambda a: a.t(),
    "transpose": lambda a: a.transpose(0, -1),
    "step": lambda a: a[::2],
    "tail": lambda a: a[..., 1:],
    "unsqueeze": lambda a: a.unsqueeze(0),
    "none_index": lambda a: a[:, None],
    "view_flat": lambda a: a.view(-1),
    "reshape_col": lambda a: a.reshape(-1, 1),
    "expand": lambda a: a.expand(2, *a.shape),
    "diagonal": lambda a: a.diagonal(),
    "select": lambda a: a[0],
}
INPLACE = {
    "add_": lambda a: a.add_(1),
    "mul_": lambda a: a.mul_(0.5),
    "clamp_": lambda a: a.clamp_(-1, 1),
    "zero_": lambda a: a.zero_(),
    "sin_": lambda a: a.sin_(),
    "setitem": lambda a: a.__setitem__(0, 3.0),
}
BINARY = {
    "add": lambda a, b: a + b,
    "mul": lambda a, b: a * b,
    "sub": lambda a, b: a - b,
    "maximum": lambda a, b: torch.maximum(a, b),
    "where": lambda a, b: torch.where(a > 0, a, b),
    "matmul": lambda a, b: a @ b,
    "cat": lambda a, b: torch.cat([a, b]),
}
BINARY_INPLACE = {
    "iadd": lambda a, b: a.add_(b),
    "imul": lambda a, b: a.mul_(b),
    "copy_": lambda a, b: a.copy_(b),
}
ALL_OPS = [("unary", name) for name in UNARY] + [("view", name) for name in VIEWS] + [("inplace", name) for name in INPLACE] + [
    ("binary", name) for name in BINARY
] + [("binary_inplace", name) for name in BINARY_INPLACE]


def run_program(program, grad):
    """Run ``program``; return everything observable (values, errors, grads)."""
    torch.manual_seed(1234)
    leaves = [torch.randn(3, 4, requires_grad=grad), torch.randn(4, requires_grad=grad), torch.randn(3, 1, requires_grad=grad)]
    registers = [leaf.clone() if grad else leaf for leaf in leaves]
    trace = []
    for (kind, name), i, j in program:
        a = registers[i % len(registers)]
        b = registers[j % len(registers)]
        try:
            if kind == "unary":
                registers.append(UNARY[name](a))
            elif kind == "view":
                registers.append(VIEWS[name](a))
            elif kind == "inplace":
                INPLACE[name](a)
            elif kind == "binary":
                registers.append(BINARY[name](a, b))
            else:
                BINARY_INPLACE[name](a, b)
            trace.append("ok")
        except Exception as error:  # noqa: BLE001 -- errors are part of the behaviour
            trace.append(f"{type(error).__name__}: {error}")
    backward = None
    if grad:
        try:
            total = sum(r.double().sum() for r in registers if r.requires_grad)
            total.backward()
            backward = "ok"
        except Exception as error:  # noqa: BLE001
            backward = f"{type(error).__name__}: {error}"
    grads = [leaf.grad for leaf in leaves]
    return {"registers": registers, "trace": trace, "backward": backward, "grads": grads}


@settings(max_examples=examples(50), **SETTINGS)
@given(
    program=st.lists(st.tuples(st.sampled_from(ALL_OPS), st.integers(0, 63), st.integers(0, 63)), min_size=1, max_size=12),
    grad=st.booleans(),
)
def test_random_programs_are_bitwise_identical_watched_and_unwatched(program, grad):
    # The reference runs under a bare passthrough mode: any Python dispatch mode changes some
    # autograd details (reshape of a non-contiguous view records ReshapeAliasBackward0, not
    # ViewBackward0), which is not opwatch's doing.
    with eq.PassthroughMode():
        unwatched = run_program(program, grad)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with opwatch.watch(warn=False, dump_on_error=False) as w:
            watched = run_program(program, grad)
    assert opwatch_warnings(caught) == []  # warn=False: only an internal error would warn
    assert watched["trace"] == unwatched["trace"]
    assert watched["backward"] == unwatched["backward"]
    difference = eq.diff(unwatched["registers"], watched["registers"], "registers")
    assert difference is None, difference
    difference = eq.diff(unwatched["grads"], watched["grads"], "grads")
    assert difference is None, difference
    assert w.records


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
