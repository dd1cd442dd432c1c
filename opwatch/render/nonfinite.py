"""The sentences of the nan/inf check, made from the facts of its findings (see
:mod:`opwatch.checks.nonfinite.origin` for what each rule's facts hold): the origin's story
(spread, masking, sinks), its inputs' health (``log(0) = -inf``), the per-op fixes, received
values and fp16 headroom."""

from __future__ import annotations

import math

import torch

from ..checks.finding import Place
from ..checks.nonfinite.cause import (
    ATTENTION_SCORES, DATA, DELIBERATE, EMPTY_MEAN, ENTERED_INF, INPUT, MATH, NORM_VARIANCE, PRECISION, TOO_FEW_FOR_SPREAD, UNKNOWN, WEIGHTS, WRITTEN,
)
from ..checks.nonfinite.rules import HEADROOM_FACTOR, attention_scores
from ..core.finite import FLOAT8_DTYPES
from ..core.notation import format_dtype, format_meta
from ..core.ops import named_new_data
from ..core.records import BACKWARD
from ..core.sites import display_path
from .phrases import place_location, where_made
from .rules import causes, explains

__all__ = ["explain_origin", "explain_received", "explain_overflow_risk", "explain_cause"]

_DEFAULT_FIX = "guard the inputs of this op (clamp, add an epsilon, or mask before rather than after), or lower the learning rate if values grew over steps"
# What made a non-finite value, by what the inputs' ranges show (a cause's ``detail``, decided
# by the check: :mod:`opwatch.checks.nonfinite.cause`), else by the op and the kind
# (:data:`_CAUSE_OF`): log of a negative number is nan, log(0) is -inf; each its own fix.
_CAUSE_FIXES = {
    "log_negative": "{name} of a negative number is nan: its input must be positive; find where it goes below 0 (a difference, a noisy estimate), or make it positive by construction (softplus, exp, x.abs() + eps) rather than clamping a wrong value",
    "log_zero": "{name}(0) = -inf: clamp the input (x.clamp_min(eps).{name}()) or use log_softmax/logsigmoid",
    "log1p_low": "log1p(x) needs x > -1: clamp the input (x.clamp_min(-1 + eps)) or find why it reaches -1",
    "sqrt_negative": "sqrt of a negative number is nan: clamp the input at 0 (x.clamp_min(0).sqrt()), or find why it goes negative (a variance computed as E[x^2] - E[x]^2 can round below 0)",
    "rsqrt_zero": "rsqrt(0) = inf: add an epsilon ((x + eps).rsqrt())",
    "rsqrt_negative": "rsqrt of a negative number is nan: clamp the input to a small positive value first ((x.clamp_min(0) + eps).rsqrt())",
    "div_zero": "division by zero: add an epsilon to the denominator (a / (b + eps)) or mask zero entries before dividing",
    "div_zero_zero": "0 / 0 = nan: add an epsilon to the denominator (a / (b + eps)), or divide only where it is nonzero (torch.where(b != 0, a / torch.where(b != 0, b, 1), 0))",
    "pow_negative_base": "a negative base to a fractional power is nan: clamp the base at 0 (x.clamp_min(0) ** p), or use x.abs() ** p * x.sign() if the sign should stay",
    "pow_zero_base": "0 to a negative power is inf: clamp the base away from 0 (x.clamp_min(eps) ** p)",
    "pow_overflow": "pow overflowed (or took 0 to a negative power): clamp the base (away from 0 for a negative exponent, below a bound for a large one), or compute it in float32",
    "domain_unit": "{name} is nan outside [-1, 1]: clamp the input (x.clamp(-1, 1)); a cosine or normalised dot product can round just past 1",
    "atanh_unit": "atanh(+-1) = +-inf, and outside [-1, 1] it is nan: clamp the input to (-1 + eps, 1 - eps)",
    "exp_overflow": "{name} overflowed: subtract the max first (x - x.amax(-1, keepdim=True)) or use logsumexp/softmax; in float16, run it in float32",
    "ctc_no_alignment": (
        "pass zero_infinity=True to ctc_loss (nn.CTCLoss(zero_infinity=True)): those samples' loss and gradients become 0; "
        "or leave out the samples whose input is shorter than their target (an audio clip shorter than its transcript)"
    ),
    "div_count_zero": (
        "0 / 0 = nan: the divisor is a count (an integer tensor) that is 0, a batch with nothing to count (every label ignored, "
        "an empty mask): skip such batches, or divide by count.clamp_min(1) (the loss is then 0, with no gradient)"
    ),
    "all_ignored": (
        "every target of this batch was ignore_index, so the mean has nothing to average: skip the loss of such a batch "
        "(if (target != ignore_index).any(): loss.backward()), or take the sum and divide by the count clamped "
        "(F.cross_entropy(..., reduction='sum') / (target != ignore_index).sum().clamp_min(1))"
    ),
    EMPTY_MEAN: (
        "the input is empty at this step (a mask or an index that selected nothing, an empty batch): skip this term when "
        "it has no values (if mask.any(): ...), or take the sum and divide by the count clamped (x.sum() / mask.sum().clamp_min(1))"
    ),
    TOO_FEW_FOR_SPREAD: (
        "reduce over more values than the correction (a last batch of one: DataLoader(..., drop_last=True)), or take the "
        "biased estimate (correction=0, unbiased=False), which is 0 for one value"
    ),
    "zero_weight": (
        "no target of this batch weighs anything (each is ignore_index or of a class whose weight is 0), so the mean divides "
        "by a total weight of 0: give every class a target can take a positive weight, or skip such batches"
    ),
    "overflow": "the values outgrew the dtype: compute this op in a wider dtype (float32), scale its inputs down (normalise before it), or lower the learning rate if values grew over steps",
}
# The cause when the inputs' ranges do not tell, from the op and the kind it made.
_CAUSE_OF = {
    **{(name, kind): cause for name in ("log", "log2", "log10") for kind, cause in (("nan", "log_negative"), ("inf", "log_zero"))},
    ("log1p", "nan"): "log1p_low", ("log1p", "inf"): "log1p_low",
    ("sqrt", "nan"): "sqrt_negative",
    ("rsqrt", "inf"): "rsqrt_zero", ("rsqrt", "nan"): "rsqrt_negative",
    ("div", "inf"): "div_zero", ("div", "nan"): "div_zero_zero",
    ("pow", "nan"): "pow_negative_base", ("pow", "inf"): "pow_overflow",
    ("acos", "nan"): "domain_unit", ("asin", "nan"): "domain_unit",
    ("atanh", "nan"): "atanh_unit", ("atanh", "inf"): "atanh_unit",
    ("exp", "inf"): "exp_overflow", ("exp2", "inf"): "exp_overflow", ("expm1", "inf"): "exp_overflow",
    **{(name, "inf"): "overflow" for name in ("mul", "add", "sub", "sum", "mm", "bmm", "addmm", "matmul", "baddbmm", "square", "cumsum", "prod", "mean")},
}
_REDUCED_DELIBERATE_FIX = (
    "leave the masked entries out of the {name} (x.masked_fill(~mask, 0) before it): no mask value works inside a sum "
    "(-inf gives inf, torch.finfo(dtype).min overflows to inf, -1e9 gives a huge loss); with "
    "cross_entropy(..., label_smoothing=...) over masked classes, which averages the log-probabilities of every class, "
    "smooth over the allowed classes only: logp = logits.masked_fill(~allowed, float('-inf')).log_softmax(-1); "
    "loss = -(soft_targets * logp.masked_fill(~allowed, 0)).sum(-1).mean(), soft_targets 0 on the masked classes"
)
# nll_loss picks the log-probability of each target: inf where a target class was masked.
_NLL = frozenset(("nll_loss_forward", "nll_loss2d_forward", "nll_loss", "nll_loss_nd"))
_MASKED_TARGET_FIX = (
    "a target class was masked for its sample, so its log-probability is -inf and the loss inf: keep each "
    "sample's target among its allowed classes (assert allowed[torch.arange(len(target)), target].all()), "
    "or drop such samples from the loss (target = target.masked_fill(~allowed[torch.arange(len(target)), target], ignore_index))"
)
_FROM_DELIBERATE_FIX = "the masking constant met another one or a zero (-inf - -inf, 0 * inf): mask with a large finite value (torch.finfo(dtype).min) instead of -inf, or clean up with torch.where right after"
_MASK_INTO_MATMUL_FIX = (
    "a masking -inf reached {name}, which multiplies it by the weights and sums (-inf * w of both signs, then "
    "-inf + inf = nan): zero the masked entries (x.masked_fill(~mask, 0)) before a matmul or Linear; mask with -inf "
    "only right before a softmax (torch.finfo(dtype).min overflows in a matmul too)"
)
_FROM_DELIBERATE_FIXES = {
    **{name: _MASK_INTO_MATMUL_FIX for name in ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addmv", "mv", "einsum", "_scaled_mm")},
    "_softmax": "every entry of a row was masked with -inf, and softmax of all -inf is nan: keep one entry unmasked, mask with torch.finfo(dtype).min instead of -inf, or zero fully masked rows with torch.where",
    "_log_softmax": "every entry of a row was masked with -inf, and log_softmax of all -inf is nan: keep one entry unmasked, mask with torch.finfo(dtype).min instead of -inf, or zero fully masked rows with torch.where",
}
# Keyed by the forward op, for origins in backward.
_BACKWARD_FIXES = {
    "sqrt": "the gradient of sqrt at 0 is inf: clamp the input (x.clamp_min(eps).sqrt()) or add eps inside",
    "log": "the gradient of log at 0 is inf: clamp the input (x.clamp_min(eps).log())",
    "pow": "the gradient of x ** p with p < 1 is inf at 0 (and nan for a negative base): clamp the base away from 0",
    "norm": "the gradient of a norm is nan at 0: add eps (e.g. (x.pow(2).sum(-1) + eps).sqrt())",
    "linalg_vector_norm": "the gradient of a norm is nan at 0: add eps (e.g. (x.pow(2).sum(-1) + eps).sqrt())",
    "rsqrt": "the gradient of rsqrt at 0 is inf: add an epsilon ((x + eps).rsqrt())",
    "atanh": "the gradient of atanh is inf at +-1: clamp the input to (-1 + eps, 1 - eps)",
    "div": "the gradient of a / b is inf where b is 0: add an epsilon to the denominator",
    "acos": "the gradient of acos/asin is inf at +-1: clamp the input to (-1 + eps, 1 - eps)",
    "asin": "the gradient of acos/asin is inf at +-1: clamp the input to (-1 + eps, 1 - eps)",
}
_FLOAT8_FIX = (
    "scale the values into the {dtype} range before the cast and back after it "
    "(scale = x.abs().amax().clamp_min(eps) / torch.finfo(torch.{dtype}).max; q = (x / scale).to(torch.{dtype}); "
    "q.float() * scale), as float8 training recipes do"
)
_GRAD_SCALER_FIX = "nothing to fix when it happens now and then: GradScaler lowers its scale; if every step is skipped, the gradients overflow even at a small scale: look at this op"
_RECEIVED_FIX = (
    "find the rank that made it: w.all_anomalies() (or the combined summary of python -m opwatch under torchrun) "
    "names its op and line; if no rank made it, the collective's reduction overflowed: reduce in float32 or scale the values down first"
)
_RISK_FIX = (
    "run this op in bfloat16 or float32 (torch.autocast(dtype=torch.bfloat16), or keep the module in float32), "
    "normalise before it (LayerNorm/RMSNorm), or scale its inputs down (attention scores by 1/sqrt(d))"
)


def _signature(facts) -> str:
    """``aten.mm(f64[5, 3] cpu, f32[3, 2] cpu) -> f64[5, 2] cpu``."""
    inputs = ", ".join(format_meta(meta) for meta in facts.inputs)
    text = f"{facts.op.removesuffix('.default')}({inputs})"
    if facts.outputs:
        text += " -> " + ", ".join(format_meta(meta) for meta in facts.outputs)
    return text


def _place(where):
    """A :class:`Place` fact, also when a JSON round trip made it a list; ``None`` stays."""
    return where if where is None or isinstance(where, Place) else Place(*where)


def _at(where) -> str:
    """``aten.neg.default at train.py:23``: a Place with its full op name, in the one location
    format (``autograd`` / ``?`` / a label where it has no source line)."""
    if where.filename is None:
        at = where.label or ("autograd" if where.phase == BACKWARD else "?")
    else:
        at = f"{display_path(where.filename)}:{where.lineno}"
    return f"{where.op} at {at}"


def _story(finding) -> str:
    """How far the values went and where they ended: spread, masking, sinks, containment."""
    facts = finding.facts
    what = finding.kind
    story = ""
    if facts.spread:
        last = _place(facts.last)
        story = f"; by the check point it had spread to {facts.spread} later op(s), the last {_at(last)} ({last.phase})"
    turned = _place(facts.became_nan)
    if turned is not None:
        story += f"; it turned into nan at {_at(turned)} ({turned.phase})"
    masked, back = _place(facts.masked_by), _place(facts.back_in_backward)
    if masked is not None and back is not None:
        name = facts.masked_by_name
        story += (
            f"; it was masked in forward by {_at(masked)}, yet came back in backward at "
            f"{back.op}: the gradient of the entries {name} did not select is 0 * {what} = nan, "
            f"and {name} passes it on (the torch.where gradient trap)"
        )
    if facts.reached_parameter:
        story += "; it reached a parameter"
    elif facts.reached_gradient:
        story += "; it reached a .grad"
    elif facts.reached_backward:
        story += "; backward() ran on it (the loss)"
    picked = _place(facts.picked_by)
    if picked is not None:
        story += (
            f"; {_at(picked)} ({picked.phase}) picked indices by comparing its nan values: "
            "the indices it chose are wrong, though no nan is left to see"
        )
    below_one = facts.grad_scaler_scale
    if facts.contained and facts.skipped_by_grad_scaler:
        story += "; GradScaler found it in the scaled gradients and skipped the step (how the scaler finds its scale)"
    elif below_one is not None:
        story += (
            f"; GradScaler found it with its scale down to {below_one:.3g} and skipped the step: below 1 the gradients are "
            "not finite unscaled either, so it skips every such step and its scale falls for ever"
        )
    elif facts.contained:
        story += "; it was absorbed before it mattered (no live tensor, parameter or host read held it)"
    elif facts.absorbed:
        by = _place(facts.absorbed_by)
        which = f"a later op ({_at(by)})" if by is not None else "a later op"
        story += (
            f"; {which} absorbed the {what} (rsqrt(inf) = 0, 1 / inf = 0, exp(-inf) = 0): "
            "what it fed is finite but wrong, so it is reported"
        )
    return story


def _inputs(finding) -> str:
    """``finite inputs (input f32[6] cpu: min 0, max 0.67 -> log(0) = -inf)``."""
    facts = finding.facts
    cause = _cause(finding)
    if facts.from_deliberate and getattr(cause, "detail", None) == ENTERED_INF:
        came = "Python or NumPy data" if _lifted(cause.made) else "a tensor made before the watch"
        inputs = f"inputs whose only non-finite values were infs that came in with {came} (a mask, or data holding inf)"
    elif facts.from_deliberate:
        inputs = "inputs whose only non-finite values were deliberate infs (masking constants such as masked_fill(mask, -inf))"
    else:
        if cause is not None and cause.kind in (INPUT, WEIGHTS):
            inputs = f"an input that already held {cause.held}"
        elif _not_known_finite(facts):
            inputs = "inputs not all known to be finite"
        else:
            inputs = "finite inputs" if facts.inputs else "no tensor inputs"
    health = _input_health(finding)
    return f"{inputs} ({health})" if health else inputs


def _not_known_finite(facts) -> bool:
    """Whether an input's range is unknown and nothing shows it was finite: one made by an op in
    the watch was checked there (its values were finite, or that op would be the origin); one
    made before the watch, by an op that left the bounded log (it may be older than the watch),
    where a log of an older opwatch does not say, or alive and unreadable at the check point,
    is not known to be."""
    input_ranges = _input_ranges(facts)
    made = facts.input_made or (None,) * len(input_ranges)
    alive = facts.input_alive or (False,) * len(input_ranges)
    unread = _unread(facts, input_ranges)
    return any(
        value_range is None and meta.ident != unread and (where is None or isinstance(where, str) or living not in (False, WRITTEN) or named_new_data(_place(where).op))
        for (meta, value_range), where, living in zip(input_ranges, made, alive)
    )


def _unread(facts, input_ranges):
    """The ident of ``copy_``'s destination, overwritten without being read, else ``None``."""
    if facts.op_name != "copy" or len(input_ranges) < 2:
        return None
    (meta, _), *_ = input_ranges
    return meta.ident if meta.ident in facts.written else None


def _input_health(finding) -> str:
    """``input f32[6, 4] cpu: min 0, max 0.9 -> log(0) = -inf``: each floating input's range,
    and what in it explains the result."""
    input_ranges = _input_ranges(finding.facts)
    if not input_ranges:
        return ""
    parts = []
    cause = _cause(finding)
    held = _held_input(cause)
    facts = finding.facts
    made = facts.input_made or (None,) * len(input_ranges)  # a log of an older opwatch has none
    alive = facts.input_alive or (False,) * len(input_ranges)
    # An op that writes in place: the input it wrote holds the result now; its range is the
    # one it had before the write, when known.
    written = facts.written
    unread = _unread(facts, input_ranges)
    name = facts.op_name
    for (meta, value_range), where, living in zip(input_ranges, made, alive):
        if meta.ident == unread:
            parts.append(f"input {format_meta(meta)}: the destination, overwritten: {name} does not read it")
        elif meta.ident in written:
            before = "range before the write unknown" if value_range is None else _range_text(value_range)
            parts.append(f"input {format_meta(meta)}, which {name} wrote its result into: {before} ({_written_why(where)})" if value_range is None else f"input {format_meta(meta)}, before {name} wrote its result into it: {before}")
        elif value_range is None and meta.ident == held:
            parts.append(f"input {format_meta(meta)}: already held {cause.held}")
        elif meta.shape is not None and 0 in meta.shape:
            parts.append(f"input {format_meta(meta)}: empty")  # no values: any range it carries says nothing
        elif value_range is None:
            parts.append(f"input {format_meta(meta)}: range unknown ({_unknown_why(where, living)})")
        else:
            parts.append(f"input {format_meta(meta)}: {_range_text(value_range)}")
    text = "; ".join(parts)
    reason = _reason(finding)
    return f"{text} -> {reason}" if reason else text


def _range_text(value_range) -> str:
    if value_range.within:  # carried through an op that kept some of its source's values
        return f"values taken from a range of min {value_range.low:.4g}, max {value_range.high:.4g}"
    return f"min {value_range.low:.4g}, max {value_range.high:.4g}"


def _written_why(made) -> str:
    """Why the range an in-place op's input had before the write is unknown: the tensor holds
    the result now, and the range of what it held was not kept (``input_made``: where that was
    made)."""
    if made == "before_watch":
        return "made before the watch"
    if made == "left_log":
        return "made by an op that has left the bounded log (max_records)"
    if made is None:
        return "made before the watch or the last check point"
    if named_new_data(_place(made).op):
        return f"made by {_at(_place(made))}, whose values opwatch does not read (uninitialised, or filled with no op)"
    return f"it held what {_at(_place(made))} left there, whose range was not kept"


def _held_input(cause):
    """The ident of the op's input that carried a nan/inf it already held, else ``None``."""
    if cause is None or cause.kind not in (INPUT, WEIGHTS):
        return None
    carried = cause.through if cause.through is not None else cause.tensor
    return carried.ident


def _unknown_why(made, alive: bool | str | None = False) -> str:
    """Why an input's range is unknown, from where it was made (``input_made``) and whether it
    was alive at the check point (``input_alive``: its values could not be read then; ``None``
    when it was not looked for, at a step GradScaler skipped; ``"written"`` when it was written
    in place after the op read it, so that what it holds now is not what the op read)."""
    if alive == WRITTEN:
        written = "it (or a tensor sharing its storage) was written in place after this op read it"
        if made is None:
            return f"made before the watch or the last check point; {written}"
        if made == "before_watch":
            return f"made before the watch; {written}"
        if made == "left_log":
            return f"made by an op that has left the bounded log (max_records); {written}"
        if named_new_data(_place(made).op):
            return f"made by {_at(_place(made))}, whose values opwatch does not read; {written}"
        return f"made by {_at(_place(made))}; its range was not kept, and {written}"
    if alive is None:
        now = "not looked for at a step GradScaler skipped"
    else:
        now = "alive, but it held nan/inf or could not be read at the check point" if alive else "no longer alive"
    if made == "before_watch":
        return f"made before the watch; {now}"
    if made == "left_log":
        return f"made by an op that has left the bounded log (max_records); {now}"
    if made is None:
        return "made before the watch or the last check point, and no longer alive"
    if named_new_data(_place(made).op):  # empty*, set_: values the watch does not read
        return f"made by {_at(_place(made))}, whose values opwatch does not read (uninitialised, or filled with no op); {now}"
    # Made in the watch, in a window of ops whose values the check point found finite: opwatch
    # reads their ranges only where a nan/inf is to be explained.
    if alive is None:
        return f"made by {_at(_place(made))}; its range was not kept, and it was {now}"
    if alive:
        return f"made by {_at(_place(made))}; its range was not kept, and it held nan/inf or could not be read at the check point"
    return f"made by {_at(_place(made))}; its range was not kept, and it was no longer alive at the check point"


def _input_ranges(facts) -> list:
    """``(meta, ValueRange or None)`` per floating input."""
    return list(facts.input_ranges)


def _reason(finding) -> str | None:
    """What in the inputs' ranges explains a non-finite result (the cause's ``detail``)."""
    detail = _detail(finding)
    if detail is None:
        return None
    facts = finding.facts
    name = facts.op_name
    if detail in ("exp_overflow", "overflow"):
        return _overflow_reason(detail, name, facts)
    return _REASONS.get(detail, "").format(name=name, ignore_index=_cause(finding).constant) or None


_REASONS = {
    "div_zero_zero": "the divisor holds 0, and so does the dividend: 0 / 0 = nan",
    "div_zero": "the divisor holds 0: x / 0 = inf",
    "log_negative": "{name} of a negative number is nan",
    "log_zero": "{name}(0) = -inf",
    "log1p_low": "log1p(-1) = -inf, and below -1 it is nan",
    "sqrt_negative": "sqrt of a negative number is nan",
    "rsqrt_negative": "rsqrt of a negative number is nan",
    "rsqrt_zero": "rsqrt(0) = inf",
    "pow_negative_base": "a negative base to a fractional power is nan",
    "pow_zero_base": "the base holds 0, and 0 to a negative power is inf",
    "domain_unit": "{name} of a value outside [-1, 1] is nan",
    "atanh_unit": "atanh(+-1) = +-inf, and outside [-1, 1] it is nan",
    "all_ignored": "every target was ignore_index ({ignore_index}): the mean divided a sum of 0 by a count of 0, 0 / 0 = nan",
    "zero_weight": "every target was ignore_index or of a class of weight 0: the mean divided a sum of 0 by a total weight of 0, 0 / 0 = nan",
    EMPTY_MEAN: "{name} averages its input, which holds no values: a sum of 0 divided by a count of 0, 0 / 0 = nan",
    TOO_FEW_FOR_SPREAD: (
        "{name} divides by the number of values less its correction (1 unless given), and it reduced no more values than "
        "that (a batch of one): a division by 0, nan"
    ),
    "ctc_no_alignment": (
        "CTC's loss is inf for a sample no alignment fits: its input is shorter than its target "
        "(plus one step between each pair of repeated labels)"
    ),
}


# Details of a mean over no counted target: a 0 / 0 in any dtype.
_COUNTS = frozenset(("all_ignored", "zero_weight", EMPTY_MEAN, TOO_FEW_FOR_SPREAD))


def _overflow_reason(detail, name, facts) -> str | None:
    dtype = next((meta.dtype for meta in facts.outputs), None)
    if dtype is None or not dtype.is_floating_point:
        return None
    limit = torch.finfo(dtype).max
    if detail == "exp_overflow":
        bound = math.log2(limit) if name == "exp2" else math.log(limit)
        return f"{name} overflows {format_dtype(dtype)} above {bound:.4g}"
    largest = facts.largest_read
    if largest is None:
        return None
    return f"inputs reach {largest:.4g}, beyond the largest {format_dtype(dtype)} ({limit:.4g})"


def _cause(finding):
    """The finding's :class:`~opwatch.checks.nonfinite.cause.Cause`, or ``None`` (a log saved
    before causes were facts gets the one its inputs' ranges show when it is read)."""
    return finding.facts.cause


def _detail(finding) -> str | None:
    cause = _cause(finding)
    return cause.detail if cause is not None and cause.kind in (MATH, PRECISION) else None


_CONVOLUTIONS = frozenset(("convolution", "_convolution", "conv1d", "conv2d", "conv3d"))


def _wider_fix(cause, name, largest=None) -> str:
    if cause.wider == torch.float32 and name in _CONVOLUTIONS:
        return (
            "run this convolution in float32 (autocast keeps convolutions in float16): upcast the module that holds it "
            "(a VAE decoder: vae.to(torch.float32) before decoding, as diffusers' force_upcast does), or run the model in "
            "bfloat16 (the range of float32); or scale the weights and activations down (a normalisation before it)"
        )
    if cause.wider == torch.float32:
        return (
            "compute this op in float32, as LlamaRMSNorm does (x.to(torch.float32) before it, the result "
            ".to(x.dtype) after); or run the model in bfloat16 (the range of float32) or in float32"
        )
    # Past float32's range (3.4e38; bfloat16's is the same): no training keeps values there.
    reach = f" (its inputs reach {largest:.4g})" if largest is not None else ""
    dtype = format_dtype(cause.dtype)
    return (
        f"values past {dtype}'s range ({torch.finfo(cause.dtype).max:.2g}) do not come from healthy training: values this large{reach} "
        "mean the run diverged, weights or activations that grew over the steps (a learning rate too high, a missing "
        "normalisation): lower the learning rate or clip the gradients, and look at the steps before this one; only where such "
        "values are real (not a model's), compute this op in float64 or scale its inputs down"
    )


@causes("nonfinite.origin")
def explain_cause(finding) -> str | None:
    """The ``cause:`` line of a nan/inf origin: what kind of cause, and the facts that show it."""
    cause = _cause(finding)
    what = finding.kind
    name = finding.facts.op_name
    if cause is None:
        return _undecided(finding, name, what)
    kind = cause.kind
    if kind == PRECISION and _place(getattr(cause, "went", None)) is not None:
        went = _place(cause.went)
        info = torch.finfo(cause.dtype)
        dtype, wider = format_dtype(cause.dtype), format_dtype(cause.wider)
        short, _, _ = went.op.removeprefix("aten.").partition(".")
        if cause.went_to == "0":
            how = f"its exact values there, at most {cause.largest:.4g} in {wider}, are below the smallest normal {dtype}, {info.tiny:.4g}"
        else:
            how = f"its exact values there reach {cause.largest:.4g} in {wider}, beyond the largest {dtype}, {info.max:.4g}"
        at = _at(went).removeprefix(f"{went.op} ")
        return (
            f"precision: {short} {'underflowed to 0' if cause.went_to == '0' else 'overflowed to inf'} in {dtype} {at} "
            f"({how}), and {name} made {what} of it; run again in {wider} from the same finite inputs, the chain is finite"
        )
    if kind == PRECISION and cause.detail == ATTENTION_SCORES:
        return _attention_cause(finding, cause)
    if kind == PRECISION and cause.detail == NORM_VARIANCE:
        return _norm_cause(finding, cause)
    if kind == PRECISION:
        limit = torch.finfo(cause.dtype).max
        dtype, wider = format_dtype(cause.dtype), format_dtype(cause.wider)
        if cause.bound:
            return (
                f"precision: {name} made {what} in {dtype}; its inputs' ranges bound its result by {cause.largest:.4g} "
                f"in magnitude, finite in {wider}: it outgrew the largest {dtype} ({limit:.4g})"
            )
        return (
            f"precision: {name} made {what} in {dtype}, but not in {wider}: "
            f"its result reaches {cause.largest:.4g} in magnitude, beyond the largest {dtype} ({limit:.4g})"
        )
    if kind == MATH:
        if cause.detail == ENTERED_INF:
            return f"undefined math: an inf that came in with {format_meta(cause.tensor)}, {_came_in(cause.made)}, met another inf or a 0 in {name} (inf - inf, 0 * inf)"
        reason = _reason(finding) if cause.detail != "masked" else "a masking -inf met another one or a 0"
        if cause.detail == "masked":
            return f"undefined math: {reason} (-inf - -inf, 0 * inf, softmax of a fully masked row)"
        if reason and cause.detail in _COUNTS:
            return f"undefined math: {reason}"
        if reason:
            return f"undefined math: {reason}, in float64 too"
        return f"undefined math: {name} is {what} in float64 too"
    if kind == INPUT and cause.detail == DATA:
        return (
            f"input: the data {format_meta(cause.tensor)} already held {cause.held} when it came into torch here "
            f"({name}: torch.from_numpy, torch.tensor or torch.as_tensor of an array, as a dataset or a DataLoader's "
            "collate makes a batch); no op made it"
        )
    if kind in (INPUT, WEIGHTS):
        which = "parameter" if kind == WEIGHTS else "input"
        text = f"{kind}: {which} {format_meta(cause.tensor)} already held {cause.held} when {name} ran"
        if cause.through is not None and cause.through.ident != cause.tensor.ident:
            text += f" (its input {format_meta(cause.through)} was taken from it)"
        if cause.made is not None:
            text += f"; {where_made(cause.made)}"
        loaded = _place(getattr(cause, "loaded", None))
        if loaded is not None:
            text += f"; it came from the loaded state: {_at(loaded)} copied it from the checkpoint's tensors (load_state_dict of torch.load)"
        return text + f"; {name} did not make it"
    if kind == UNKNOWN:
        made = "was made before the watch"
        if getattr(cause.made, "how", None) == "made_by":
            made = f"was made by {_at(_place(cause.made.place))}, whose values opwatch does not read (uninitialised, or filled with no op, as torch.load does),"
        if cause.detail == WRITTEN:
            return (
                f"unknown: input {format_meta(cause.tensor)} {made.rstrip(',')}, and {name} wrote its result into it "
                f"in place: its values before the write were never read, so whether it already held {what} cannot be told"
            )
        return (
            f"unknown: input {format_meta(cause.tensor)} {made} and is gone by the check point, "
            f"so whether it already held {what} cannot be told"
        )
    if kind == DELIBERATE and cause.detail == "nan_constant":
        reached = "the loss" if finding.facts.loss is not None else "the gradients"
        return f"deliberate: the program wrote this nan itself ({name} of a nan constant): no op made it; it reached {reached}"
    if kind == DELIBERATE and name in _NLL:
        return (
            f"deliberate: the masked entries hold a masking constant (-inf, or torch.finfo(dtype).min), and {name} "
            f"picked one of them: a target is a masked class; the loss holds the {what}"
        )
    if kind == DELIBERATE:
        return (
            f"deliberate: the masked entries hold a masking constant (-inf, or torch.finfo(dtype).min), harmless in "
            f"softmax, max and logsumexp, which leave them out, but {name} adds them into its result; the loss holds the {what}"
        )
    return None


def _undecided(finding, name, what) -> str:
    """Why no cause could be decided, in one clause."""
    facts = finding.facts
    if facts.skipped_by_grad_scaler:
        return (
            f"transient: {name} overflowed in the gradients GradScaler scaled up, by design now and then: it skipped "
            "this step and lowers its scale (how it finds one); only a run of skipped steps is a fault"
        )
    if _not_known_finite(facts):
        return (
            f"not decided: an input's values were not known (made before the watch or by an op whose values opwatch does "
            f"not read, and gone by the check point), so whether {name} made the {what} or was given it cannot be told"
        )
    return (
        f"not decided: {name} could not be run again in a wider dtype (an input was gone by the check point, or its call "
        f"cannot be rebuilt from the log), and its inputs' ranges do not show what made the {what}"
    )


def _attention_cause(finding, cause) -> str:
    facts = finding.facts
    scores = attention_scores(facts.op_name, facts.input_ranges)
    of = "" if scores is None else f" (query values up to {scores.query:.4g}, key values up to {scores.key:.4g}, head dim {scores.head_dim})"
    info = torch.finfo(cause.dtype)
    mask = ", with or without the mask" if facts.from_deliberate else ""
    return (
        f"precision: the attention scores (query @ key.T * scale) {facts.op_name} computes in {format_dtype(cause.dtype)} can "
        f"reach {cause.largest:.4g} in magnitude{of}; past about {math.log(info.max) / info.eps:.2g} one rounding step of a "
        f"score is more than exp takes, so its exp(score - logsumexp) overflows where the exact value is at most 1, and "
        f"inf * 0 or inf - inf is {finding.kind}{mask}"
    )


def _norm_cause(finding, cause) -> str:
    facts = finding.facts
    spread = next((value_range for _, value_range in facts.input_ranges if value_range is not None), None)
    spans = ""
    if spread is not None:
        width = spread.high - spread.low
        spans = (f" its input spans {spread.low:.4g} to {spread.high:.4g}, so the squared deviations from the mean that its "
                 f"variance adds up can reach {width * width:.4g},")
    limit = torch.finfo(torch.float32).max
    return (
        f"precision: {facts.op_name} made {finding.kind} in {format_dtype(cause.dtype)}:{spans} past the largest f32 ({limit:.4g}), "
        f"the dtype it computes them in: the variance is inf, and the normalised values nan; finite in {format_dtype(cause.wider)}"
    )


_ATTENTION_SCORES_FIX = (
    "scores this large mean the activations feeding the attention grew far past their usual scale, most often weights "
    "diverging under too high a learning rate: lower it (or warm it up), and check the steps before this one; normalising "
    "each head's query and key (QK-norm: a LayerNorm or RMSNorm on q and k before the attention) keeps the scores bounded "
    "whatever the weights; a finite mask value does not help"
)


def _lifted(made) -> bool:
    """Whether an ``entered_inf`` cause's tensor came into torch as Python or NumPy data in the
    watch (its ``made`` names that op), not made before the watch."""
    return getattr(made, "how", None) == "made_by"


def _came_in(made) -> str:
    """Where the inf of an ``entered_inf`` cause came into the watch, and what it may be."""
    if _lifted(made):
        return (
            f"Python or NumPy data that came into torch at {place_location(made.place)} (a mask built in NumPy, or data "
            "holding inf: a feature divided by a zero scale, a value read from a file)"
        )
    return "made before the watch (a mask made before it, or data holding inf: the batch, a feature read from a file)"


def _cause_fix(finding, cause) -> str | None:
    what = cause.held or finding.kind  # what the input held (inf, where the op made nan of it)
    if cause.kind == PRECISION and cause.detail == ATTENTION_SCORES:
        return _ATTENTION_SCORES_FIX
    if cause.kind == INPUT and cause.detail == DATA:
        return (
            f"the data held {what} before torch saw it (a missing value in a table, a nodata pixel of a raster, a corrupt "
            "record): check it where it is read (torch.isfinite(x).all() in the dataset's __getitem__ or the collate_fn, or "
            "np.isfinite(array).all() after loading), then fill the missing values (np.nan_to_num, an imputed value) or leave "
            "those samples out; nothing in the model is wrong"
        )
    if cause.kind == INPUT and cause.made is not None and cause.made.how == "buffer":
        return (
            f"the buffer was {what} before this op: a running statistic updated from a batch that held {what} "
            "(check the training batches and the forward passes that updated it), or it was loaded so (check the checkpoint)"
        )
    if cause.kind == INPUT:
        before = cause.made is not None and cause.made.how == "before_watch"
        return (
            f"find where it became {what} before this op: check the data where it is made "
            "(torch.isfinite(batch).all() in the dataset or collate_fn)"
            + (", or start the watch before it is made (a DataLoader's batches are made outside the watch)" if before else "")
            + "; nothing in this op is wrong"
        )
    if cause.kind in (WEIGHTS, INPUT) and _place(getattr(cause, "loaded", None)) is not None:
        return (
            f"the checkpoint holds {what}: load a checkpoint saved before the values went bad, and check what is "
            "loaded (assert all(t.isfinite().all() for t in state_dict.values() if t.is_floating_point()) before "
            "load_state_dict); then find the step that wrote the bad values before it was saved"
        )
    if cause.kind == WEIGHTS:
        return (
            f"the parameter was {what} before this step: an earlier optimizer step wrote it (a {what} gradient, "
            "a too-high learning rate: watch the step that updated it), or it was loaded so (check the checkpoint: "
            "all(p.isfinite().all() for p in model.parameters()))"
        )
    if cause.kind == MATH and cause.detail == ENTERED_INF and _lifted(cause.made):
        return (
            f"if {format_meta(cause.tensor)} is data, it held inf when it came into torch at {place_location(cause.made.place)}: check "
            "it where it is computed or read (np.isfinite(array).all(), torch.isfinite(x).all() in the dataset's __getitem__) "
            "and fix or leave out those samples (a zero scale, a log of 0); if it is a mask, mask with "
            "torch.finfo(dtype).min instead of inf, or zero the masked entries before a matmul or Linear"
        )
    if cause.kind == MATH and cause.detail == ENTERED_INF:
        return (
            f"if {format_meta(cause.tensor)} is data (the batch, a feature read from a file), it held inf before torch saw it: "
            "check it where it is made (torch.isfinite(batch).all() in the dataset or collate_fn) and fix or leave out those "
            "samples; if it is a mask, mask with torch.finfo(dtype).min instead of inf, or zero the masked entries before a "
            "matmul or Linear"
        )
    if cause.kind == UNKNOWN:
        if getattr(cause.made, "how", None) == "made_by":
            return "check it once it is filled (torch.isfinite(x).all() after torch.load, or after the code that writes it)"
        return "start the watch before that input is made, or check it (torch.isfinite(x).all()) where it is made"
    return None


def _fix(finding) -> str:
    facts = finding.facts
    name = facts.op_name
    if facts.masked_by is not None and facts.back_in_backward is not None and not facts.contained:
        return (
            f"make the unselected entries safe before {name}, not only after it: "
            f"torch.where(cond, torch.{name}(torch.where(cond, x, 1.0)), 0.0) (the double-where trick), "
            f"so that neither branch, nor its gradient, is ever {finding.kind}"
        )
    if facts.contained and facts.skipped_by_grad_scaler:
        return _GRAD_SCALER_FIX
    cause = _cause(finding)
    told = _cause_fix(finding, cause) if cause is not None else None
    if told is not None:
        return told
    if cause is not None and cause.detail in _COUNTS:  # forward or backward: the batch is the matter
        return _CAUSE_FIXES[cause.detail]
    if facts.from_deliberate:
        return _FROM_DELIBERATE_FIXES.get(name, _FROM_DELIBERATE_FIX).format(name=name)
    forward = facts.forward_op_name
    if forward is not None:
        fix = _BACKWARD_FIXES.get(forward)
        if fix is not None:
            return fix
        return f"the gradient of {forward} is not finite for these inputs: " + _DEFAULT_FIX
    if cause is not None and cause.kind == PRECISION and _place(getattr(cause, "went", None)) is not None:
        return _chain_fix(cause)
    if cause is not None and cause.kind == PRECISION and cause.dtype in FLOAT8_DTYPES:
        return _FLOAT8_FIX.format(dtype=format_dtype(cause.dtype))
    if cause is not None and cause.kind == PRECISION and cause.detail not in _CAUSE_FIXES:
        return _wider_fix(cause, name, facts.largest_read)
    detail = _detail(finding) or _CAUSE_OF.get((name, finding.kind))
    if detail == "div_zero_zero" and _divides_by_a_count(facts):
        detail = "div_count_zero"
    return _CAUSE_FIXES[detail].format(name=name) if detail in _CAUSE_FIXES else _DEFAULT_FIX


def _chain_fix(cause) -> str:
    went = _place(cause.went)
    short, _, _ = went.op.removeprefix("aten.").partition(".")
    if cause.went_to == "0":
        return (
            f"the values went below what {format_dtype(cause.dtype)} holds at {short} ({_at(went)}): keep them in the log domain "
            "instead of taking exp and multiplying (torch.logsumexp for log(sum(exp(x))): a log-domain Sinkhorn updates "
            "log u = log a - logsumexp(log K + log v); the sum of log-densities instead of the product of densities), "
            "or compute that part in float64; an epsilon only hides it"
        )
    return (
        f"the values outgrew {format_dtype(cause.dtype)} at {short} ({_at(went)}): compute that part in a wider dtype "
        "(float32, or float64), or keep it in the log domain (logsumexp), or scale its inputs down (normalise before it)"
    )


def _divides_by_a_count(facts) -> bool:
    """A division whose divisor is an integer or bool tensor: a count (``mask.sum()``)."""
    inputs = facts.inputs
    if len(inputs) < 2:
        return False
    _, divisor, *_ = inputs
    dtype = divisor.dtype
    return isinstance(dtype, torch.dtype) and not dtype.is_floating_point and not dtype.is_complex


def _explain_reached_loss(finding) -> tuple[str, str, str]:
    """A forward reduction that took masking constants into a loss (see the ``loss`` fact)."""
    facts = finding.facts
    loss = _place(facts.loss)
    held = facts.loss_kind or finding.kind
    health = _input_health(finding)
    problem = (
        f"a masking constant reached the loss: {_signature(facts)} took the masked entries of its input into its result, "
        f"{finding.kind}{f' ({health})' if health else ''}, and the loss, {_at(loss)}, is {held}{_story(finding)}"
    )
    name = facts.op_name
    fix = _MASKED_TARGET_FIX if name in _NLL else _REDUCED_DELIBERATE_FIX.format(name=name)
    return problem, "masked entries left out of the loss: a finite loss", fix


def _explain_nan_written(finding) -> tuple[str, str, str]:
    """A nan the program wrote itself (a placeholder) that became the loss or reached the
    gradients."""
    facts = finding.facts
    loss = _place(facts.loss)
    reached = f"the loss, {_at(loss)}, which is nan" if loss is not None else "the gradients (the loss itself is finite: the nan was left out of it, not out of its backward)"
    problem = f"the program wrote nan here ({_signature(facts)}: a nan constant, not a value any op computed), and it reached {reached}{_story(finding)}"
    fix = (
        "a nan kept as a placeholder (a missing value, a padded position) must stay out of every op the loss is computed "
        "with: select the valid entries first (pred[valid], target[valid]), or write a finite value there instead; masking "
        "the result (nanmean, torch.where on the loss) still sends nan into the gradients (0 * nan = nan in backward)"
    )
    return problem, "no nan among the values the loss is computed from", fix


def _nan_written(finding) -> bool:
    cause = finding.facts.cause
    return cause is not None and (cause.kind, cause.detail) == (DELIBERATE, "nan_constant")


@explains("nonfinite.origin")
def explain_origin(finding) -> tuple[str, str, str]:
    if _nan_written(finding):
        return _explain_nan_written(finding)
    if finding.facts.loss is not None:
        return _explain_reached_loss(finding)
    what = finding.kind
    cause = _cause(finding)
    if cause is not None and cause.kind == INPUT and cause.detail == DATA:
        problem = f"{what} came into torch here with the data: {_signature(finding.facts)} holds {what} it was given, not a value any op computed{_story(finding)}"
        return problem, "finite data", _fix(finding)
    problem = f"first {what} here: {_signature(finding.facts)} made {what} from {_inputs(finding)}{_story(finding)}"
    if cause is not None and cause.kind in (INPUT, WEIGHTS):
        return problem, f"finite {'parameters' if cause.kind == WEIGHTS else 'inputs'}: this op passed on the {what} it was given", _fix(finding)
    return problem, "finite outputs from finite inputs", _fix(finding)


@explains("nonfinite.received")
def explain_received(finding) -> tuple[str, str, str]:
    what = finding.kind
    problem = f"{what} received through {_signature(finding.facts)}: this rank's own inputs to the collective held no {what}, so another rank sent it{_story(finding)}"
    return problem, "finite values from every rank", _RECEIVED_FIX


@explains("nonfinite.overflow_risk")
def explain_overflow_risk(finding) -> tuple[str, str, str]:
    facts = finding.facts
    largest = facts.largest
    limit = torch.finfo(torch.float16).max
    problem = (
        f"{_signature(facts)} holds values up to {largest:.6g} in magnitude, "
        f"{limit / largest:.3g}x below the largest float16 ({limit:.0f}): one more sum or product and they overflow to inf"
    )
    expected = f"float16 activations well inside the float16 range (below {limit / HEADROOM_FACTOR:.0f})"
    return problem, expected, _RISK_FIX
