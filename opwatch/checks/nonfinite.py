"""nan / inf origins, found with batched, sync-free checks.

On a GPU, ``bool(t.isnan().any())`` after every op stalls the pipeline at every op. Instead,
each floating output gets one reduction, ``torch.aminmax``, whose two 0-dim results stay on the
tensor's device: nan shows as a nan min/max, inf as an infinite max or min. The results are
read back in one batch (one ``torch.stack`` and one transfer per device) at a *check point*:
the end of the block, ``Watch.check()``/``Watch.step()``, a value the program itself reads on
the host from a device where flags wait (``.item()``, ``bool(t)``, ``torch.equal``, and a copy
of a device tensor to the CPU, which printing a CUDA tensor does), and at the latest every
``max_records`` ops. Printing a CPU tensor and ``.tolist()`` run no op opwatch can see and are
not check points.

At a check point the op log is replayed over tensor identities to tell origins from
propagation:

- an op is an **origin** when an output holds nan or inf while every input was finite (its
  kind is what the output held: nan wins over inf). Later ops fed by it are counted as its
  spread, not reported again, also where they turn its inf into nan (``inf - inf``);
- ops that write uninitialised memory (``empty*``) are not checked and carry no earlier
  state; deliberate constants are never origins, though what they feed is tracked: explicit
  non-finite arguments (``full(-inf)``, ``masked_fill(mask, -inf)``, ``where(c, x, -inf)``),
  Python data (``m[mask] = float("-inf")``: lifts are checked, and non-finite there is on
  purpose), and ``finfo.max``/``finfo.min`` as an argument or held by an input; but nan made
  from inputs whose only non-finite values were deliberate infs (a softmax over a fully
  masked row) is an origin;
- an origin **matters** once its values reach a sink: a host read, an ``nn.Parameter``
  written by an op, a ``.grad`` accumulation, or a program-chosen check point (the end of the
  block, ``Watch.check()``) while still alive. Alive at another check point, it waits (autograd
  keeps a softmax output until backward). Values that died first were absorbed, and so were
  overflows GradScaler found in the scaled gradients: reported as *contained*, not anomalies;
- a write through a view lands in its base; unchecked outputs (sparse, subclasses) hold what
  their inputs held; a forward op recomputed in backward (checkpointing) is the same origin;
- float16 forward outputs within ``HEADROOM_FACTOR`` of the float16 limit are reported as
  ``overflow_risk`` before they overflow.

Collectives (``torch.distributed``) are read once they have completed, not when their op
returns (see ``NonFiniteTracker._observe_collective``). A nan/inf in a collective's output whose
inputs on this rank were finite was **received** from another rank: reported as received
through that collective, never as an origin (the combined summary names the rank that made it).

Inputs made before the watch or outside torch ops (``torch.from_numpy``) are assumed finite.
Only dense strided tensors of float16/bfloat16/float32/float64/complex dtypes on a real device
are checked: meta, fake, sparse, nested, quantized, zero tensors and subclasses are skipped.
"""

from __future__ import annotations

import math
import weakref
from itertools import islice

import torch

from ..compat import dispatch_modes_outside, inference_mode_enabled, no_python_dispatch
from ..collective_ops import on_completion
from ..ops import C10D, FUNCTIONAL, WAIT, WRAP, collective_of, is_collective_op
from ..records import BACKWARD, E_ARGS, E_FORWARD_FUNC, E_FUNC, E_INDEX, E_NINPUTS, E_PHASE, E_SITE, M_DEVICE, M_DTYPE, M_IDENT, entry_inputs, entry_outputs
from ..notation import format_dtype, format_meta
from .finding import Finding, text_finding

__all__ = ["NAME", "KINDS", "NonFiniteTracker", "Origin", "needs_carrier", "preserves_values", "makes_new_data", "checked_outputs"]

NAME = "nonfinite"
RISK_KIND = "overflow_risk"
KINDS = ("nan", "inf", RISK_KIND)

_REAL = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
_COMPLEX = {torch.complex64, torch.complex128}
_CHECKED_DTYPES = frozenset(_REAL | _COMPLEX)
_PLAIN_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))
_aminmax = torch.aminmax
_STRIDED = torch.strided

# Ops whose outputs are new data rather than the program's computation: uninitialised memory
# (garbage may look like nan/inf), and Python data entering torch (``torch.tensor([...])``
# lifts a tensor that no op made; its id may be a dead tensor's, so it must not inherit that
# tensor's state). Neither checked nor carrying an input's state.
_NEW_DATA_OPS = {
    "aten::empty", "aten::empty_like", "aten::new_empty", "aten::empty_strided",
    "aten::new_empty_strided", "aten::empty_permuted", "aten::resize_", "aten::resize_as_",
}
# Python data entering torch (``torch.tensor([...])``): new data, checked, and a non-finite
# value there is a constant the program wrote on purpose (``m[mask] = float("-inf")``).
_LIFTS = {"aten::lift_fresh", "aten::lift_fresh_copy", "aten::lift"}
# The largest finite values of each floating dtype: ``torch.finfo(dtype).min`` in a mask is a
# deliberate "minus infinity", and overflowing it (to -inf in float16) is deliberate too.
_SENTINELS = frozenset(
    sign * torch.finfo(dtype).max for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64) for sign in (1.0, -1.0)
)
_SENTINEL = "sentinel"  # a finite output holding one of them
# Views and copies that hold exactly their input's values: they keep its range.
_SAME_VALUES = {
    "aten::expand", "aten::view", "aten::reshape", "aten::_unsafe_view", "aten::t", "aten::transpose",
    "aten::permute", "aten::detach", "aten::alias", "aten::clone", "aten::contiguous", "aten::unsqueeze", "aten::squeeze",
}
_FLOAT16 = torch.float16
# fp16 headroom: a forward float16 output whose largest magnitude reaches 1/8 of the largest
# float16 (65504 / 8 = 8188) is one step from overflowing: a residual sum of a few such values,
# or a product with a weight above 8, is inf. Healthy fp16 activations stay far below (layer
# norms keep them near 1; logits and attention scores in the tens or hundreds).
HEADROOM_FACTOR = 8
_HEADROOM_LIMIT = torch.finfo(torch.float16).max / HEADROOM_FACTOR
# Ops that drop the values they do not select: a non-finite value masked there in forward can
# come back as nan in backward (the torch.where gradient trap).
_MASKING_OPS = {"aten::where", "aten::masked_fill", "aten::masked_fill_", "aten::nan_to_num", "aten::nan_to_num_"}
# GradScaler's overflow check of the scaled gradients (torch.amp.grad_scaler).
_GRAD_SCALER_CHECK = "aten::_amp_foreach_non_finite_check_and_unscale_"


# Views, and ops that only move values around: a non-finite output here can only have come in
# through an input. They are not checked (that saves one reduction per view and copy); at a
# check point their outputs inherit their inputs' state. Ops that can drop non-finite values
# (relu, clamp, max, where, zeros_like, ...) are checked like any other, and so are casts
# (``_to_copy``, ``copy_``: f32 -> f16 can overflow). Limit: a view or selection that picks
# only finite values of a non-finite tensor still counts as carrying the older origin.
_VALUE_PRESERVING_OPS = {
    "aten::clone", "aten::contiguous", "aten::neg", "aten::abs", "aten::cat", "aten::stack",
    "aten::index_select", "aten::gather", "aten::index", "aten::masked_select", "aten::flip",
    "aten::roll", "aten::repeat", "aten::select_backward", "aten::slice_backward", "aten::embedding",
    "aten::_unsafe_view",
}
# A functional collective's output, waited for or wrapped as an AsyncCollectiveTensor: the same
# values (see NonFiniteTracker._observe_collective).
_VALUE_PRESERVING_OPS |= {"_c10d_functional::wait_tensor", "_c10d_functional::_wrap_tensor_autograd"}
_PRESERVES: dict = {}
# Views whose output has no ``_base`` link, so it does not keep its input alive (found by
# probing the common view ops; inference mode drops the link for all, checked on the hot path).
_UNLINKED_VIEWS = {("aten::detach", "default"), ("aten::view", "dtype")}


def makes_new_data(func) -> bool:
    """Ops whose outputs are not computed from the program's values (``empty*``,
    ``lift_fresh``): not checked, and they carry no input's nan/inf state."""
    return func._schema.name in _NEW_DATA_OPS


# Ops whose later outputs are statistics derived from the first (mean, rstd, logsumexp):
# finite whenever the first is, so one reduction suffices.
_PRIMARY_OUTPUT_ONLY = {
    "aten::native_layer_norm", "aten::native_batch_norm", "aten::_native_batch_norm_legit",
    "aten::_native_batch_norm_legit_no_training", "aten::native_group_norm",
    "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_cudnn_attention",
    "aten::max_pool2d_with_indices", "aten::max_pool3d_with_indices",
}
# FSDP2's all-gather copy-in returns (its input, the all-gather's output buffer): the second is
# uninitialised memory until the all-gather fills it (read then, as the collective's output).
_PRIMARY_OUTPUT_ONLY.add("fsdp::all_gather_copy_in")


def checked_outputs(func) -> int | None:
    """How many leading outputs of ``func`` need the nan/inf reduction; ``None``: all."""
    return 1 if func._schema.name in _PRIMARY_OUTPUT_ONLY else None


def preserves_values(func) -> bool:
    """Views and ops that only move or select values: their outputs are not checked."""
    known = _PRESERVES.get(func)
    if known is None:
        name = func._schema.name
        known = _PRESERVES[func] = (bool(func.is_view) or name in _VALUE_PRESERVING_OPS) and name not in _NEW_DATA_OPS
    return known


def needs_carrier(func) -> bool:
    """Whether the unchecked outputs of ``func`` must be remembered weakly to tell, at a check
    point, whether a non-finite value they carry is alive. Views need not: a view keeps its
    base alive (``_base``), and the base is remembered already. ``detach`` makes an alias
    without that link; so does any view made in inference mode (the interceptor asks then)."""
    return preserves_values(func) and (not func.is_view or (func._schema.name, func._overloadname) in _UNLINKED_VIEWS)


class Origin:
    """A nan/inf origin found at a check point, with how far its values spread and whether they
    reached a sink: a host read, a parameter. Judged once it is known whether it mattered."""

    __slots__ = ("record", "kind", "from_deliberate", "input_ranges", "masked_by", "back_in_backward", "spread", "last", "became_nan", "read_on_host", "reached_gradient", "reached_parameter", "skipped_by_grad_scaler", "matters")

    def __init__(self, record, kind, from_deliberate=False):
        self.record = record  # the OpRecord of the op that made the value
        self.kind = kind
        # Made nan from inputs holding only deliberate infs (masking constants).
        self.from_deliberate = from_deliberate
        # (tensor meta, (min, max) or None when unknown) of each floating input
        self.input_ranges: list = []
        self.masked_by = None  # a forward where/masked_fill that dropped its values
        self.back_in_backward = None  # then the first backward op its values reached
        self.spread = 0  # later ops that carried its values on
        self.last = record  # the last of them
        self.became_nan = None  # for an inf origin: the first op that turned its inf into nan
        self.read_on_host = False  # the program read one of its values (``.item()``, ``bool(t)``)
        self.reached_gradient = False  # autograd accumulated its values into a ``.grad``
        self.reached_parameter = False  # an op wrote its values into an ``nn.Parameter``
        # Born in backward and found by GradScaler's overflow check, which skips the step.
        self.skipped_by_grad_scaler = False
        self.matters = True

    def carried_by(self, record, kind=None) -> None:
        self.spread += 1
        self.last = record
        if kind == "nan" and self.kind == "inf" and self.became_nan is None:
            self.became_nan = record
        if self.masked_by is not None and self.back_in_backward is None and record.phase == BACKWARD and not preserves_values(record.func):
            self.back_in_backward = record

    def finding(self, *, contained: bool) -> Finding:
        record = self.record
        what = "nan" if self.kind == "nan" else "inf"
        spread = ""
        if self.spread:
            spread = f"; by the check point it had spread to {self.spread} later op(s), the last {self.last.op} at {self.last.where} ({self.last.phase})"
        if self.became_nan is not None:
            turned = self.became_nan
            spread += f"; it turned into nan at {turned.op} at {turned.where} ({turned.phase})"
        if self.masked_by is not None and self.back_in_backward is not None:
            masked, back = self.masked_by, self.back_in_backward
            spread += (
                f"; it was masked in forward by {masked.op} at {masked.where}, yet came back in backward at "
                f"{back.op}: the gradient of the entries {_op_name(masked.func)} did not select is 0 * {what} = nan, "
                f"and {_op_name(masked.func)} passes it on (the torch.where gradient trap)"
            )
        if self.reached_parameter:
            spread += "; it reached a parameter"
        elif self.reached_gradient:
            spread += "; it reached a .grad"
        if contained and self.skipped_by_grad_scaler:
            spread += "; GradScaler found it in the scaled gradients and skipped the step (how the scaler finds its scale)"
        elif contained:
            spread += "; it was absorbed before it mattered (no live tensor, parameter or host read held it)"
        if self.from_deliberate:
            inputs = "inputs whose only non-finite values were deliberate infs (masking constants such as masked_fill(mask, -inf))"
        else:
            inputs = "finite inputs" if record._entry[E_NINPUTS] else "no tensor inputs"
        health = _input_health(record, self.kind, self.input_ranges)
        if health:
            inputs += f" ({health})"
        if self.masked_by is not None and self.back_in_backward is not None and not contained:
            op = _op_name(record.func)
            fix = (
                f"make the unselected entries safe before {op}, not only after it: "
                f"torch.where(cond, torch.{op}(torch.where(cond, x, 1.0)), 0.0) (the double-where trick), "
                f"so that neither branch, nor its gradient, is ever {what}"
            )
        elif contained and self.skipped_by_grad_scaler:
            fix = "nothing to fix when it happens now and then: GradScaler lowers its scale; if every step is skipped, the gradients overflow even at a small scale: look at this op"
        elif self.from_deliberate:
            fix = _FROM_DELIBERATE_FIXES.get(_op_name(record.func), _FROM_DELIBERATE_FIX)
        else:
            fix = _fix_for(record)
        if is_collective_op(record.func):
            # Its outputs hold what other ranks sent: this rank's own inputs to it were finite.
            return text_finding(
                kind=self.kind,
                problem=f"{what} received through {record.signature()}: this rank's own inputs to the collective held no {what}, so another rank sent it{spread}",
                expected="finite values from every rank",
                fix=(
                    "find the rank that made it: w.all_anomalies() (or the combined summary of python -m opwatch under torchrun) "
                    "names its op and line; if no rank made it, the collective's reduction overflowed: reduce in float32 or scale the values down first"
                ),
            )
        return text_finding(
            kind=self.kind,
            problem=f"first {what} here: {record.signature()} made {what} from {inputs}{spread}",
            expected="finite outputs from finite inputs",
            fix=fix,
        )


_DEFAULT_FIX = "guard the inputs of this op (clamp, add an epsilon, or mask before rather than after), or lower the learning rate if values grew over steps"
_FIXES = {
    "log": "log(0) = -inf: clamp the input (x.clamp_min(eps).log()) or use log_softmax/logsigmoid",
    "log2": "log(0) = -inf: clamp the input first (x.clamp_min(eps))",
    "log10": "log(0) = -inf: clamp the input first (x.clamp_min(eps))",
    "div": "division by zero: add an epsilon to the denominator or mask zero entries before dividing",
    "sqrt": "sqrt of a negative number is nan, and its gradient at 0 is inf: clamp the input (x.clamp_min(eps).sqrt())",
    "rsqrt": "rsqrt(0) = inf: add an epsilon (x + eps).rsqrt()",
    "pow": "pow overflowed or took a fractional power of a negative number: clamp the base",
    "exp": "exp overflowed: subtract the max first (x - x.amax(-1, keepdim=True)) or use logsumexp",
}
_FROM_DELIBERATE_FIX = "the masking constant met another one or a zero (-inf - -inf, 0 * inf): mask with a large finite value (torch.finfo(dtype).min) instead of -inf, or clean up with torch.where right after"
_FROM_DELIBERATE_FIXES = {
    "_softmax": "every entry of a row was masked with -inf, and softmax of all -inf is nan: keep one entry unmasked, mask with torch.finfo(dtype).min instead of -inf, or zero fully masked rows with torch.where",
    "_log_softmax": "every entry of a row was masked with -inf, and log_softmax of all -inf is nan: keep one entry unmasked, mask with torch.finfo(dtype).min instead of -inf, or zero fully masked rows with torch.where",
}
# Keyed by the forward op, for origins in backward.
_BACKWARD_FIXES = {
    "sqrt": "the gradient of sqrt at 0 is inf: clamp the input (x.clamp_min(eps).sqrt()) or add eps inside",
    "log": "the gradient of log at 0 is inf: clamp the input (x.clamp_min(eps).log())",
    "pow": "the gradient of x ** p with p < 1 is inf at 0: clamp the base away from 0",
    "norm": "the gradient of a norm is nan at 0: add eps (e.g. (x.pow(2).sum(-1) + eps).sqrt())",
    "linalg_vector_norm": "the gradient of a norm is nan at 0: add eps (e.g. (x.pow(2).sum(-1) + eps).sqrt())",
    "div": "the gradient of a / b is inf where b is 0: add an epsilon to the denominator",
    "acos": "the gradient of acos/asin is inf at +-1: clamp the input to (-1 + eps, 1 - eps)",
    "asin": "the gradient of acos/asin is inf at +-1: clamp the input to (-1 + eps, 1 - eps)",
}


def _input_health(record, kind, input_ranges) -> str:
    """``input f32[6, 4] cpu: min 0, max 0.9 -> log(0) = -inf``: each floating input's range,
    from the reductions already taken (or taken at the check point for an input still alive),
    and what in it explains the result."""
    if not input_ranges:
        return ""
    parts = []
    for meta, value_range in input_ranges:
        if value_range is None:
            parts.append(f"input {format_meta(meta)}: range unknown (made before the watch or the last check point, and no longer alive)")
        else:
            parts.append(f"input {format_meta(meta)}: min {value_range[0]:.4g}, max {value_range[1]:.4g}")
    text = "; ".join(parts)
    reason = _explain(record, kind, input_ranges)
    return f"{text} -> {reason}" if reason else text


def _explain(record, kind, input_ranges) -> str | None:
    """What in the inputs' ranges explains a non-finite result, for the common ops."""
    name = _op_name(record.func)
    ranges = [value_range for _, value_range in input_ranges]
    first = ranges[0] if ranges else None
    if first is None:
        return None
    low, high = first
    if name in ("log", "log2", "log10"):
        if low < 0:
            return f"{name} of a negative number is nan"
        if low == 0:
            return f"{name}(0) = -inf"
    if name == "log1p" and low <= -1:
        return "log1p(-1) = -inf, and below -1 it is nan"
    if name == "sqrt" and low < 0:
        return "sqrt of a negative number is nan"
    if name == "rsqrt" and low <= 0:
        return "rsqrt(0) = inf, and of a negative number nan"
    if name == "div" and len(ranges) > 1 and ranges[1] is not None and ranges[1][0] <= 0 <= ranges[1][1]:
        if kind == "nan" and low <= 0 <= high:
            return "the divisor holds 0, and so does the dividend: 0 / 0 = nan"
        return "the divisor holds 0: x / 0 = inf"
    dtype = record.outputs[0].dtype if record.outputs else None
    if dtype is not None and dtype.is_floating_point:
        limit = torch.finfo(dtype).max
        if name == "exp" and high > math.log(limit):
            return f"exp overflows {format_dtype(dtype)} above {math.log(limit):.4g}"
        largest = max(max(abs(r[0]), abs(r[1])) for r in ranges if r is not None)
        if largest > limit:
            return f"inputs reach {largest:.4g}, beyond the largest {format_dtype(dtype)} ({limit:.4g})"
    return None


def _fill_unknown_ranges(origins, log) -> None:
    """Ranges of an origin's inputs made before the watch (parameters, data) that are still
    alive: found at report time, once per check point, by one walk over the garbage
    collector's objects, then one reduction each. Never on a healthy step. An input some op
    of the watch made is not looked for: it died, and its id may be another tensor's now."""
    wanted = {}
    for origin in origins:
        for meta, value_range in origin.input_ranges:
            if value_range is None and log.producer_of(meta[M_IDENT]) is None:
                wanted[meta[M_IDENT]] = meta
    if not wanted:
        return
    import gc

    found = {}
    for candidate in gc.get_objects():
        if id(candidate) in wanted and isinstance(candidate, torch.Tensor):
            meta = wanted[id(candidate)]
            if tuple(candidate.shape) == meta[0] and candidate.dtype == meta[M_DTYPE] and candidate.device == meta[M_DEVICE]:
                found[id(candidate)] = candidate
    for ident, tensor in found.items():
        try:
            if tensor.numel() and type(tensor) in _PLAIN_TYPES and tensor.layout is _STRIDED and not tensor.is_meta:
                checked = torch.view_as_real(tensor.detach().resolve_conj()) if tensor.dtype in _COMPLEX else tensor.detach()
                low, high = _aminmax(checked)
                low, high = low.item(), high.item()
                # Its inputs were finite when the op ran: a non-finite range is another tensor.
                found[ident] = (low, high) if math.isfinite(low) and math.isfinite(high) else None
            else:
                found[ident] = None
        except Exception:
            found[ident] = None
    for origin in origins:
        origin.input_ranges = [
            (meta, value_range if value_range is not None else found.get(meta[M_IDENT])) for meta, value_range in origin.input_ranges
        ]


def _op_name(func) -> str:
    """``aten::div_`` -> ``div``: in-place variants share their op's fix."""
    name = func._schema.name.split("::")[-1]
    return name[:-1] if name.endswith("_") and not name.endswith("__") and not name.startswith("_") else name


def _fix_for(record) -> str:
    if record.forward_func is not None:
        fix = _BACKWARD_FIXES.get(_op_name(record.forward_func))
        if fix is not None:
            return fix
        return f"the gradient of {_op_name(record.forward_func)} is not finite for these inputs: " + _DEFAULT_FIX
    return _FIXES.get(_op_name(record.func), _DEFAULT_FIX)


class NonFiniteTracker:
    """Keeps per-output finiteness flags on device and resolves them at check points."""

    _CHUNK = 64  # 0-dim results stacked into one tensor at a time: fewer objects to keep
    _MAX_UNJUDGED = 1024  # origins kept alive by the program past this many are judged at once
    _MAX_REMEMBERED_SITES = 4096

    def __init__(self, log) -> None:
        self._log = log
        self._stats: list[torch.Tensor] = []  # (min, max) pairs: 0-dim tensors on _stats_device
        self._stats_device = None
        self._chunks: list[torch.Tensor] = []  # earlier pairs, stacked
        # Per queued pair, in parallel lists (ints and one weakref: few objects for the
        # garbage collector to count): the op index, the output's position, the output.
        self._indices: list[int] = []
        self._positions: list[int] = []
        self._refs: list[weakref.ref] = []
        self._devices: set = set()  # devices that flags wait on
        self._carriers: dict = {}  # (op index << 32 | output position) -> weakref, for unchecked outputs
        # In-place writes into a view: (op index << 32 | output position) -> (id of the base,
        # weakref to the base). The values live in the base's storage.
        self._written_bases: dict = {}
        # Non-finite tensors still alive after the last check point: ident -> (kind, origin, ref)
        self._carry: dict[int, tuple] = {}
        # Queued float16 outputs ((op index << 32) | position): their headroom is judged.
        self._half: set = set()
        # Finite tensors holding a sentinel (finfo.max/min) alive after the last check point.
        self._sentinels: dict[int, weakref.ref] = {}
        # Origins whose values were alive at a check point and reached no sink yet.
        self._unjudged: list[Origin] = []
        # (site, op id) -> Origin, for forward ops recomputed in backward (checkpointing).
        self._by_site: dict = {}
        # Collectives' outputs, read once the collective has completed (see _Pending):
        # (op index << 32 | output position) -> _Pending; and ident -> _Pending for the
        # functional ones not waited for yet (their tensor, its AsyncCollectiveTensor, its views).
        self._collectives: dict = {}
        self._awaiting: dict = {}

    def for_op(self, func):
        """The observer for ``func``'s outputs, called after each kernel as
        ``observe(entry, inputs, outputs, metas)``; ``None`` for ops whose outputs are new data."""
        collective = collective_of(func)
        if collective is not None:
            return {C10D: self._observe_collective, FUNCTIONAL: self._observe_collective, WAIT: self._observe_wait, WRAP: self._observe_wrap}[collective.kind]
        if makes_new_data(func):
            return None
        if func._schema.name in _LIFTS:
            return self._observe_all  # an alias of Python data: its values are new here
        if not preserves_values(func):
            if func._schema.is_mutable:
                return self._observe_written
            return self._observe_first if checked_outputs(func) == 1 else self._observe_all
        if needs_carrier(func):
            return self._observe_carrier
        # A view keeps its base alive, and the base is remembered; not so in inference mode.
        return self._observe_view

    @property
    def pending(self) -> int:
        return len(self._indices) + len(self._collectives)

    @property
    def carrying(self) -> bool:
        return bool(self._carry) or bool(self._unjudged)

    def pending_on(self, device) -> bool:
        """Whether flags wait on ``device`` (a host read there already pays for a sync), or
        origins wait to be judged (a host read may be what makes them matter)."""
        return device in self._devices or bool(self._unjudged)

    def _observe_all(self, entry, inputs, outputs, metas) -> None:
        """Hot path, inside the mode's ``__torch_dispatch__``: queue one reduction per
        checkable floating output. No host sync."""
        if dispatch_modes_outside():
            # Modes entered outside opwatch (another watch, the user's own) would see the
            # reductions, which are not the program's ops. Ours is off while it dispatches.
            with no_python_dispatch():
                self._reduce(entry[E_INDEX], outputs, metas)
        else:
            self._reduce(entry[E_INDEX], outputs, metas)

    def _observe_first(self, entry, inputs, outputs, metas) -> None:
        """Like ``_observe_all`` for ops whose later outputs are statistics of the first."""
        self._observe_all(entry, inputs, outputs[:1], metas)

    def _observe_written(self, entry, inputs, outputs, metas) -> None:
        """Like ``_observe_all`` for ops that write in place: a write into a view
        (``h[:, 0].div_(d)``) puts its values into the base, which outlives the view."""
        self._observe_all(entry, inputs, outputs, metas)
        index = entry[E_INDEX]
        for position, tensor in enumerate(outputs):
            base = tensor._base
            if base is not None:
                self._written_bases[index << 32 | position] = (id(base), weakref.ref(base))

    def _observe_view(self, entry, inputs, outputs, metas) -> None:
        if inference_mode_enabled():
            self._observe_carrier(entry, inputs, outputs, metas)

    def _reduce(self, index, outputs, metas) -> None:
        for position, tensor in enumerate(outputs):
            meta = metas[position]
            dtype = meta[M_DTYPE]
            if dtype not in _CHECKED_DTYPES or type(tensor) not in _PLAIN_TYPES or tensor.is_meta:
                continue
            if tensor.layout is not _STRIDED or tensor.is_nested or not tensor.numel() or tensor._is_zerotensor():
                continue
            checked = tensor
            if dtype in _COMPLEX:
                checked = torch.view_as_real(checked.resolve_conj())
            # No autograd graph: below the autograd layer, where __torch_dispatch__ runs, the
            # autograd keys are excluded for everything it calls.
            low, high = _aminmax(checked)
            stats = self._stats
            device = meta[M_DEVICE]
            if device != self._stats_device:
                self._stack()  # one chunk per device
                stats = self._stats
                self._stats_device = device
                self._devices.add(device)
            stats += (low, high)
            self._indices.append(index)
            self._positions.append(position)
            self._refs.append(weakref.ref(tensor))
            if dtype is _FLOAT16:
                self._half.add(index << 32 | position)  # judged for headroom
            if len(stats) >= self._CHUNK:
                self._stack()

    def _observe_carrier(self, entry, inputs, outputs, metas) -> None:
        """Hot path, for ops whose outputs are not checked: remember them weakly, so that a
        non-finite value they carry counts as alive at the check point. Not needed for views
        that keep a link to their base (see ``needs_carrier``)."""
        index = entry[E_INDEX]
        for position, tensor in enumerate(outputs):
            if metas[position][M_DTYPE] in _CHECKED_DTYPES:
                self._carriers[index << 32 | position] = weakref.ref(tensor)

    # -- collectives: their outputs are read once the collective has completed --------------

    def _observe_collective(self, entry, inputs, outputs, metas) -> None:
        """A c10d op or functional collective: its outputs hold nothing yet (gloo fills them on
        a thread, NCCL on a stream). A c10d op's outputs are read when its ``Work`` completes
        (a callback on its future: enqueued after the collective on NCCL, no host sync); a
        functional collective's when it is waited for (see ``_observe_wait``/``_observe_wrap``).
        Either is read at the next check point instead when an op used it before the read came
        (a future's waiters wake before its callbacks run)."""
        index = entry[E_INDEX]
        ready = []
        for position, tensor in enumerate(outputs):
            if not _checkable(tensor, metas[position][M_DTYPE]):
                continue
            pending = _Pending(index, position, tensor)
            self._collectives[index << 32 | position] = pending
            ready.append((pending, tensor))
        if not ready:
            return
        for pending, tensor in ready:
            # Until read: an op using it (not a view) means the program waited for it.
            self._awaiting[id(tensor)] = pending
        work = getattr(outputs, "work", None)
        if work is not None and not on_completion(work, lambda: _read_completed(ready)):
            for pending, _ in ready:
                pending.work = work  # no future: read at a check point once the Work says it completed

    def _observe_wait(self, entry, inputs, outputs, metas) -> None:
        """``wait_tensor``: the collective behind its argument has completed; read it now."""
        self._observe_carrier(entry, inputs, outputs, metas)
        pending = self._awaiting.get(inputs[0][M_IDENT]) if inputs else None
        if pending is not None and outputs:
            with no_python_dispatch():
                pending.stats = _min_max(outputs[0])
            pending.done = pending.used = True

    def _observe_wrap(self, entry, inputs, outputs, metas) -> None:
        """The ``AsyncCollectiveTensor`` around a functional collective's output: its first
        non-view use waits for the collective inside the subclass, where opwatch sees no op. The
        output is read at the next check point if still alive, else when the wrapper dies (its
        last moment), and counts only if an op other than a view used it before."""
        self._observe_carrier(entry, inputs, outputs, metas)
        pending = self._awaiting.get(inputs[0][M_IDENT]) if inputs else None
        if pending is None or not outputs:
            return
        wrapper = outputs[0]
        self._awaiting[id(wrapper)] = pending
        pending.aliases.append(entry[E_INDEX])
        tensor = pending.ref()
        if tensor is not None:
            # Holds the tensor no longer than the wrapper, which holds it anyway.
            finalizer = weakref.finalize(wrapper, _read_at_death, pending, tensor, weakref.ref(self._log))
            finalizer.atexit = False

    def _settle_collectives(self, window, final) -> list:
        """Queue the flags of the collective outputs that are known complete; return the window
        with the entries of earlier windows' collectives that completed since put first."""
        awaiting = self._awaiting
        if awaiting and any(pending.done for pending in awaiting.values()):
            awaiting = self._awaiting = {ident: pending for ident, pending in awaiting.items() if not pending.done}
        if awaiting:
            # Which waiting tensors an op used (an op other than a view: that waited for it).
            for entry in window:
                func = None
                for meta in entry_inputs(entry):
                    pending = awaiting.get(meta[M_IDENT])
                    if pending is None or pending.used or entry[E_INDEX] <= pending.index:
                        continue
                    func = func or self._log.funcs[entry[E_FUNC]]
                    collective = collective_of(func)
                    if func.is_view or (collective is not None and collective.kind == WRAP):
                        # Another name for the same values, not a use.
                        for output in entry_outputs(entry) or ():
                            awaiting[output[M_IDENT]] = pending
                        if func.is_view:
                            pending.aliases.append(entry[E_INDEX])
                    else:
                        pending.used = True
                        pending.used_at = entry[E_INDEX]
        first = window[0][E_INDEX] if window else None
        late = []
        for key, pending in list(self._collectives.items()):
            if not pending.done and pending.work is not None and _completed(pending.work):
                tensor = pending.ref()
                if tensor is not None:
                    with no_python_dispatch():
                        pending.stats = _min_max(tensor)
                pending.done = True
            if pending.used and not pending.done:
                tensor = pending.ref()
                if tensor is not None:  # alive, and waited for: read it now
                    with no_python_dispatch():
                        pending.stats = _min_max(tensor)
                    pending.done = True
                elif pending.read_at is not None and pending.read_at >= pending.used_at:
                    pending.done = True  # read as its wrapper died, after its use
            if pending.done or final or pending.ref() is None:
                del self._collectives[key]
            if not pending.done or pending.stats is None:
                continue
            low, high = pending.stats
            if self._stats_device != low.device:
                self._stack()
                self._stats_device = low.device
                self._devices.add(low.device)
            self._stats += (low, high)
            self._indices.append(pending.index)
            self._positions.append(pending.position)
            self._refs.append(pending.ref)
            if first is not None and pending.index < first:
                # Completed after the check point that replayed it: replay it (and the ops
                # that gave its values other names) again, first.
                for index in (pending.index, *pending.aliases):
                    record = self._log.find(index) if index < first else None
                    if record is not None and all(entry is not record._entry for entry in late):
                        late.append(record._entry)
        if awaiting:
            self._awaiting = {ident: pending for ident, pending in awaiting.items() if not pending.done and pending.ref() is not None}
        if late:
            late.sort(key=lambda entry: entry[E_INDEX])
            return late + list(window)
        return window

    def _stack(self) -> None:
        if self._stats:
            self._chunks.append(torch.stack(self._stats))
            self._stats = []

    def resolve(self, window, *, reading=(), final: bool = False) -> list[Origin]:
        """Check point: read all queued flags at once and return the origins judged now, oldest
        first, each with ``matters`` set.

        ``window`` is every log entry since the previous check point, oldest first.
        ``reading`` are the idents of tensors the program is about to read on the host.
        ``final``: the program chose this point (the end of the block, ``Watch.check()``), so
        what is still alive is the program's state: judge it now.
        """
        carriers, self._carriers = self._carriers, {}
        written_bases, self._written_bases = self._written_bases, {}
        if self._collectives:
            window = self._settle_collectives(window, final)
        half, self._half = self._half, set()
        kinds, values = self._read_flags(check_headroom=bool(half)) if self._indices else ([], None)
        queued = list(zip(self._indices, self._positions, self._refs, kinds))
        self._chunks, self._indices, self._positions, self._refs = [], [], [], []
        self._devices = set()
        self._stats_device = None
        checked = set()
        flagged = {}
        refs = {}
        sentinels = {}
        # (op index, output position) -> (min, max): read only when something is not finite,
        # to tell the inputs' health at an origin.
        ranges = {}
        for number, (index, position, ref, kind) in enumerate(queued):
            key = (index, position)
            checked.add(key)
            if values is not None:
                ranges[key] = (values[2 * number], values[2 * number + 1])
            if kind is None:
                continue
            if kind == _SENTINEL:
                sentinels[key] = ref
                continue
            flagged[key] = kind
            refs[key] = ref
        risks = _headroom_risks(window, half, ranges, self._log) if half and ranges else []
        if not flagged and not self._carry and not self._unjudged:
            self._remember_sentinels(sentinels)
            return risks
        new = self._replay(window, flagged, refs, carriers, checked, sentinels, written_bases, reading, ranges)
        _fill_unknown_ranges(new, self._log)
        judged = self._judge(new, final) + risks
        judged.sort(key=lambda found: found.record.index)
        return judged

    def _read_flags(self, check_headroom: bool = False) -> tuple[list, list | None]:
        """Per queued pair: None (finite), "nan", "inf", or _SENTINEL (finite, but holding
        ``finfo.max`` or ``finfo.min`` of a floating dtype: a deliberate mask value); and the
        values read (min, max, min, max, ...), or ``None`` when all were finite."""
        self._stack()
        by_device: dict = {}
        for chunk in self._chunks:
            by_device.setdefault(chunk.device, []).append(chunk)
        if len(by_device) == 1:
            # The one host read of this check point.
            chunks = self._chunks
            values = (torch.cat(chunks) if len(chunks) > 1 else chunks[0]).tolist()
            if math.isfinite(sum(values)) and (not check_headroom or _HEADROOM_LIMIT > max(map(abs, values))):
                # The usual case: all finite, no float16 near its limit. Masks holding
                # finfo.min (every Hugging Face model) only mark their outputs.
                kinds = [None] * (len(values) // 2)
                if not _SENTINELS.isdisjoint(values):
                    for position, value in enumerate(values):
                        if value in _SENTINELS:
                            kinds[position >> 1] = _SENTINEL
                return kinds, None
        else:
            # One host read per device; chunks are read back in their queued order.
            read = {device: iter(torch.cat(chunks).tolist()) for device, chunks in by_device.items()}
            values = [value for chunk in self._chunks for value in islice(read[chunk.device], len(chunk))]
        kinds = []
        for i in range(0, len(values), 2):
            low, high = values[i], values[i + 1]
            if math.isnan(low) or math.isnan(high):
                kinds.append("nan")
            elif math.isinf(low) or math.isinf(high):
                kinds.append("inf")
            elif low in _SENTINELS or high in _SENTINELS:
                kinds.append(_SENTINEL)
            else:
                kinds.append(None)
        return kinds, values

    def _remember_sentinels(self, sentinels) -> None:
        """Keep the finite sentinel-holding tensors that are still alive, for later windows."""
        alive = {ident: ref for ident, ref in self._sentinels.items() if ref() is not None}
        for (index, position), ref in sentinels.items():
            tensor = ref()
            if tensor is not None:
                alive[id(tensor)] = ref
        self._sentinels = alive

    def _replay(self, window, flagged, refs, carriers, checked, sentinels, written_bases, reading, ranges=None) -> list[Origin]:
        """Follow tensor identities through the window's ops to tell origins from spread."""
        log = self._log
        # ident -> (kind, origin or None when it came from a deliberate constant). Carried
        # tensors count even if they died since: ops in this window may have read them first,
        # and an id reused by a newer tensor is overwritten by the op that made it.
        status = {ident: (kind, origin) for ident, (kind, origin, _) in self._carry.items()}
        live = {ident: ref for ident, (_, _, ref) in self._carry.items()}
        holds_sentinel = set(self._sentinels)
        sentinel_refs = dict(self._sentinels)
        ranges = ranges or {}
        value_ranges: dict = {}  # ident -> (min, max) of tensors made in this window
        origins: list[Origin] = []
        deliveries: dict = {}  # outputs of collectives not used yet (see _delivered)
        for entry in window:
            outputs = entry_outputs(entry)
            if not outputs:
                continue
            index = entry[E_INDEX]
            func = log.funcs[entry[E_FUNC]]
            name = func._schema.name
            delivered = _delivered(entry, name, deliveries, status, origins) if deliveries else None
            # A lift's input is a tensor made from Python data outside any op: its id may be a
            # dead tensor's, whose state it must not inherit.
            fed = [] if name in _LIFTS else [meta[M_IDENT] for meta in entry_inputs(entry) if meta[M_IDENT] in status]
            if name == _GRAD_SCALER_CHECK:
                # GradScaler's overflow check: what it finds in the scaled gradients makes it
                # skip the step. Gradients are born in backward; a forward overflow is no
                # business of the scaler's (the scale does not touch the forward pass).
                for ident in fed:
                    origin = status[ident][1]
                    if origin is not None and origin.record.phase == BACKWARD:
                        origin.skipped_by_grad_scaler = True
            if name in _LIFTS:
                # Python data: new here. A non-finite value in it is a constant the program
                # wrote on purpose (m[mask] = float("-inf")).
                for position, meta in enumerate(outputs):
                    kind = flagged.get((index, position))
                    if (index, position) in ranges:
                        value_ranges[meta[M_IDENT]] = ranges[(index, position)]
                    if kind is None:
                        status.pop(meta[M_IDENT], None)
                    else:
                        status[meta[M_IDENT]] = (kind, None)
                        live[meta[M_IDENT]] = refs[(index, position)]
                continue
            # Gradient accumulation: a backward op autograd runs with no forward op behind it.
            # (No source line: site 0, or a named place such as the DDP reducer's "DDP gradient of fc.weight".)
            accumulates = entry[E_PHASE] == BACKWARD and log.sites[entry[E_SITE]][0] is None and entry[E_FORWARD_FUNC] < 0
            if name in _SAME_VALUES:
                inputs = entry_inputs(entry)
                if inputs and inputs[0][M_IDENT] in value_ranges:
                    for meta in outputs:
                        value_ranges[meta[M_IDENT]] = value_ranges[inputs[0][M_IDENT]]
            if preserves_values(func):
                self._carry_through(entry, func, outputs, fed, status, live, carriers)
                if accumulates and fed and status[fed[0]][1] is not None:
                    status[fed[0]][1].reached_gradient = True
                continue
            input_states = [status[ident] for ident in fed]
            input_origin = next((state[1] for state in input_states if state[1] is not None), None)
            deliberate = _has_sentinel_constant(entry) or name in _LIFTS or any(
                meta[M_IDENT] in holds_sentinel for meta in entry_inputs(entry)
            )
            record = None
            for position, meta in enumerate(outputs):
                ident = meta[M_IDENT]
                key = (index, position)
                if key in sentinels:
                    holds_sentinel.add(ident)
                    sentinel_refs[ident] = sentinels[key]
                else:
                    holds_sentinel.discard(ident)
                if key in ranges:
                    value_ranges[ident] = ranges[key]
                else:
                    value_ranges.pop(ident, None)
                kind = flagged.get(key)
                if kind is None:
                    if input_origin is not None and name in _MASKING_OPS and entry[E_PHASE] != BACKWARD and key in checked:
                        for state in input_states:
                            if state[1] is not None and state[1].masked_by is None:
                                state[1].masked_by = record = record or log.view(entry)
                    if key not in checked and meta[M_DTYPE] in _CHECKED_DTYPES and input_states:
                        # Not checked (sparse, nested, subclasses): it holds what its inputs held.
                        status[ident] = input_states[0]
                        ref = carriers.get(index << 32 | position)
                        if ref is not None:
                            live[ident] = ref
                    else:
                        status.pop(ident, None)
                    continue
                live[ident] = refs[key]
                if input_origin is not None:
                    # Fed by non-finite inputs: spread, even where inf turns into nan (inf - inf).
                    origin = input_origin
                    if origin.last.index != index:
                        origin.carried_by(record or log.view(entry), kind)
                elif input_states and not (kind == "nan" and all(state[0] != "nan" for state in input_states)):
                    origin = None  # carries deliberate constants on, and made nothing new
                elif deliberate and not input_states:
                    origin = None  # a deliberate constant: masked_fill(mask, -inf), finfo.min
                else:
                    # Non-finite from finite inputs, or nan from deliberate infs (a softmax over
                    # a fully masked row): an origin, unless it is a forward op recomputed
                    # during backward (activation checkpointing) that was one already.
                    # A collective's output: received from other ranks (is_collective_op), never recomputed.
                    record = record or log.view(entry)
                    origin = None if is_collective_op(func) or delivered else self._recomputed(record, entry)
                    if origin is None:
                        origin = Origin(delivered or record, kind, from_deliberate=bool(input_states))
                        origin.input_ranges = [
                            (meta, value_ranges.get(meta[M_IDENT])) for meta in entry_inputs(entry) if meta[M_DTYPE] in _CHECKED_DTYPES
                        ]
                        origins.append(origin)
                        self._remember_site(origin, entry)
                status[ident] = (kind, origin)
                if origin is not None:
                    if isinstance(refs[key](), torch.nn.Parameter):
                        origin.reached_parameter = True
                    if accumulates:
                        origin.reached_gradient = True
                base = written_bases.get(index << 32 | position)
                if base is not None:
                    # Written through a view: the values live in the base.
                    status[base[0]] = (kind, origin)
                    live[base[0]] = base[1]
            if is_collective_op(func):
                record = record or log.view(entry)
                for meta in outputs:
                    deliveries[meta[M_IDENT]] = (record, status.get(meta[M_IDENT]))
        for ident in reading:
            state = status.get(ident)
            if state is not None and state[1] is not None:
                state[1].read_on_host = True
        self._carry = {
            ident: (kind, origin, live[ident])
            for ident, (kind, origin) in status.items()
            if ident in live and live[ident]() is not None
        }
        self._sentinels = {
            ident: sentinel_refs[ident] for ident in holds_sentinel if sentinel_refs[ident]() is not None
        }
        return origins

    def _carry_through(self, entry, func, outputs, fed, status, live, carriers) -> None:
        """An op that only moves values: its outputs hold what its inputs held (non-finite
        state only: ranges of views are not followed, a view may hold a part of them)."""
        index = entry[E_INDEX]
        source = next((ident for ident in fed if status[ident][1] is not None), None)
        if source is None and fed:
            source = fed[0]
        carrier = status[source] if source is not None else None
        if carrier is not None and carrier[1] is not None and carrier[1].last.index != index:
            carrier[1].carried_by(self._log.view(entry))
        for position, meta in enumerate(outputs):
            # A view to an integer dtype still holds the bits (x.view(torch.int32)).
            if carrier is not None and (meta[M_DTYPE] in _CHECKED_DTYPES or func.is_view):
                status[meta[M_IDENT]] = carrier
                # A view holds its base alive: the base's reference stands in for it.
                ref = carriers.get(index << 32 | position) or live.get(source)
                if ref is not None:
                    live[meta[M_IDENT]] = ref
            else:
                status.pop(meta[M_IDENT], None)

    def _recomputed(self, record, entry):
        """The earlier origin this op repeats, when it is a forward op run again in backward
        (a checkpoint's recomputation: user code, not an autograd formula); else ``None``."""
        if record.phase != BACKWARD or entry[E_FORWARD_FUNC] >= 0:
            return None
        return self._by_site.get((entry[E_SITE], entry[E_FUNC]))

    def _remember_site(self, origin, entry) -> None:
        if len(self._by_site) >= self._MAX_REMEMBERED_SITES:
            self._by_site.clear()
        self._by_site.setdefault((entry[E_SITE], entry[E_FUNC]), origin)

    def _judge(self, new, final) -> list[Origin]:
        """Which origins mattered. An origin matters when its values reached a parameter or a
        host read. One whose values are still alive waits, unless ``final``: the program may yet
        drop them (autograd keeps a softmax output until backward), use them, or hand them to
        GradScaler. Then, or once they died: GradScaler's skipped steps are contained; values
        accumulated into a ``.grad`` or alive at the end matter; others were absorbed."""
        alive = {id(origin) for _, origin, _ in self._carry.values() if origin is not None}
        judged = []
        waiting = []
        for origin in self._unjudged + new:
            is_alive = id(origin) in alive
            if origin.reached_parameter or (origin.read_on_host and not origin.skipped_by_grad_scaler):
                origin.matters = True
            elif is_alive and not final and len(waiting) < self._MAX_UNJUDGED:
                waiting.append(origin)
                continue
            else:
                origin.matters = not origin.skipped_by_grad_scaler and (origin.reached_gradient or is_alive)
            judged.append(origin)
        self._unjudged = waiting
        judged.sort(key=lambda origin: origin.record.index)
        return judged


class OverflowRisk:
    """A float16 forward output within ``HEADROOM_FACTOR`` of the float16 limit: reported as
    kind ``overflow_risk`` before it overflows. Judged like an origin that matters."""

    __slots__ = ("record", "largest", "matters")

    def __init__(self, record, largest):
        self.record = record
        self.largest = largest
        self.matters = True

    def finding(self, *, contained: bool) -> Finding:
        limit = torch.finfo(torch.float16).max
        return text_finding(
            kind=RISK_KIND,
            problem=(
                f"{self.record.signature()} holds values up to {self.largest:.6g} in magnitude, "
                f"{limit / self.largest:.3g}x below the largest float16 ({limit:.0f}): one more sum or product and they overflow to inf"
            ),
            expected=f"float16 activations well inside the float16 range (below {limit / HEADROOM_FACTOR:.0f})",
            fix=(
                "run this op in bfloat16 or float32 (torch.autocast(dtype=torch.bfloat16), or keep the module in float32), "
                "normalise before it (LayerNorm/RMSNorm), or scale its inputs down (attention scores by 1/sqrt(d))"
            ),
        )


def _headroom_risks(window, half, ranges, log) -> list[OverflowRisk]:
    """Float16 outputs of forward ops near the float16 limit (finite: an inf is an origin)."""
    risks = []
    by_index = None
    for key, (low, high) in ranges.items():
        packed = key[0] << 32 | key[1]
        if packed not in half:
            continue
        # A finfo.min/max mask value is deliberate; the other end tells the headroom.
        ends = [abs(value) for value in (low, high) if value not in _SENTINELS]
        largest = max(ends) if ends else 0.0
        if not (_HEADROOM_LIMIT <= largest < math.inf):
            continue
        if by_index is None:
            by_index = {entry[E_INDEX]: entry for entry in window}
        entry = by_index.get(key[0])
        if entry is None or entry[E_PHASE] == BACKWARD:
            continue  # GradScaler's scaled gradients live near the limit on purpose
        risks.append(OverflowRisk(log.view(entry), largest))
    return risks


def _has_sentinel_constant(entry) -> bool:
    """An explicit non-finite or ``finfo.max``/``finfo.min`` constant among the arguments."""
    for value in entry[E_ARGS][1::2]:
        if type(value) is float and (not math.isfinite(value) or value in _SENTINELS):
            return True
    return False


# -- collectives ------------------------------------------------------------------------------


class _Pending:
    """A collective's output, read once the collective has filled it: by the ``Work``'s
    completion callback (c10d ops), at ``wait_tensor``, or, for an ``AsyncCollectiveTensor``
    waited inside the subclass, at the next check point (alive) or when it dies, valid when an
    op used it before (``used_at``) the read (``read_at``)."""

    __slots__ = ("index", "position", "ref", "stats", "done", "used", "used_at", "read_at", "work", "aliases")

    def __init__(self, index, position, tensor):
        self.index = index
        self.position = position
        self.ref = weakref.ref(tensor)
        self.stats = None  # (min, max), 0-dim tensors on the tensor's device
        self.done = False  # the stats hold the collective's result
        self.used = False  # an op other than a view used the output (functional: it was waited for)
        self.used_at = -1  # that op's index
        self.read_at = None  # the last op index logged when it was read at its wrapper's death
        self.work = None  # the Work, where it has no future to call back
        self.aliases: list[int] = []  # ops that gave its values another name (its wrapper, views)


def _checkable(tensor, dtype) -> bool:
    """The tensors ``_reduce`` reduces: dense, floating, non-empty, a plain tensor on a device."""
    return (
        dtype in _CHECKED_DTYPES
        and type(tensor) in _PLAIN_TYPES
        and not tensor.is_meta
        and tensor.layout is _STRIDED
        and not tensor.is_nested
        and tensor.numel() > 0
        and not tensor._is_zerotensor()
    )


def _min_max(tensor) -> tuple:
    checked = torch.view_as_real(tensor.resolve_conj()) if tensor.dtype in _COMPLEX else tensor
    return tuple(_aminmax(checked.detach()))


def _read_completed(ready) -> None:
    """The ``Work``'s callback: its collective has completed; read its outputs (on gloo's thread,
    or with the collective's stream current on NCCL), then let go of them."""
    with no_python_dispatch():
        for pending, tensor in ready:
            pending.stats = _min_max(tensor)
            pending.done = True
    ready.clear()


def _read_at_death(pending, tensor, log_ref) -> None:
    """An ``AsyncCollectiveTensor`` dies: read its collective's output while it still exists."""
    log = log_ref()
    if log is None:
        return  # the watch is gone
    try:
        with no_python_dispatch():
            pending.stats = _min_max(tensor)
        pending.read_at = log.entries[-1][E_INDEX] if log.entries else -1
    except Exception:
        pass


def _delivered(entry, name, deliveries, status, origins):
    """The collective whose result the op ``entry`` delivers, else ``None``. Some backends
    complete a collective into a buffer of their own and copy it into the output when the
    program waits (gloo's reduce-scatter: ``copy_(output, chunk of its buffer)``), after the
    ``Work``'s completion read the output: a ``copy_`` into a collective's output that nothing
    used yet is the collective's delivery, and what it writes was received through it (the
    earlier read, of a buffer not filled yet, is dropped). Any other use of an output ends its
    delivery."""
    inputs = entry_inputs(entry)
    if name == "aten::copy_" and inputs and inputs[0][M_IDENT] in deliveries:
        ident = inputs[0][M_IDENT]
        record, state = deliveries.pop(ident)
        for meta in inputs[1:]:
            deliveries.pop(meta[M_IDENT], None)
        stale = state[1] if state is not None else None
        if stale is not None and stale.record.index == record.index and not stale.spread and stale in origins:
            origins.remove(stale)  # read before the backend filled it
            status.pop(ident, None)
        return record
    for meta in inputs:
        deliveries.pop(meta[M_IDENT], None)
    return None


def _completed(work) -> bool:
    try:
        return torch._C._distributed_c10d.Work.unbox(work).is_completed()
    except Exception:
        return False
