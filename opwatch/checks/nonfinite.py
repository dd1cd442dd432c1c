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
- ops that write uninitialised memory (``empty*``) or bring Python data in (``torch.tensor``)
  are not checked and carry no earlier state; ops given an explicit
  non-finite constant (``full(-inf)``, ``fill_``, ``masked_fill(mask, -inf)``,
  ``where(c, x, -inf)``) are deliberate and never origins, though what they feed is tracked;
- an origin **matters** when its non-finite values reached a backward op or are still alive
  at the check point (a gradient, a parameter, the value being read, any live tensor). Others
  were absorbed (T5 takes ``log(0)`` on purpose, casts the ``-inf`` to an integer and drops it
  with ``where``) and are reported as *contained*, not as anomalies.

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
from ..records import BACKWARD, E_ARGS, E_FORWARD_FUNC, E_FUNC, E_INDEX, E_NINPUTS, E_PHASE, E_SITE, M_DEVICE, M_DTYPE, M_IDENT, entry_inputs, entry_outputs
from .finding import Finding

__all__ = ["NAME", "KINDS", "NonFiniteTracker", "Origin", "needs_carrier", "preserves_values", "makes_new_data", "checked_outputs"]

NAME = "nonfinite"
KINDS = ("nan", "inf")

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

    __slots__ = ("record", "kind", "from_deliberate", "spread", "last", "became_nan", "read_on_host", "reached_gradient", "reached_parameter", "skipped_by_grad_scaler", "matters")

    def __init__(self, record, kind, from_deliberate=False):
        self.record = record  # the OpRecord of the op that made the value
        self.kind = kind
        # Made nan from inputs holding only deliberate infs (masking constants).
        self.from_deliberate = from_deliberate
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

    def finding(self, *, contained: bool) -> Finding:
        record = self.record
        what = "nan" if self.kind == "nan" else "inf"
        spread = ""
        if self.spread:
            spread = f"; by the check point it had spread to {self.spread} later op(s), the last {self.last.op} at {self.last.where} ({self.last.phase})"
        if self.became_nan is not None:
            turned = self.became_nan
            spread += f"; it turned into nan at {turned.op} at {turned.where} ({turned.phase})"
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
        if contained and self.skipped_by_grad_scaler:
            fix = "nothing to fix when it happens now and then: GradScaler lowers its scale; if every step is skipped, the gradients overflow even at a small scale: look at this op"
        elif self.from_deliberate:
            fix = _FROM_DELIBERATE_FIXES.get(_op_name(record.func), _FROM_DELIBERATE_FIX)
        else:
            fix = _fix_for(record)
        return Finding(
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
        # Finite tensors holding a sentinel (finfo.max/min) alive after the last check point.
        self._sentinels: dict[int, weakref.ref] = {}
        # Origins whose values were alive at a check point and reached no sink yet.
        self._unjudged: list[Origin] = []
        # (site, op id) -> Origin, for forward ops recomputed in backward (checkpointing).
        self._by_site: dict = {}

    def for_op(self, func):
        """The observer for ``func``'s outputs, called after each kernel as
        ``observe(entry, inputs, outputs, metas)``; ``None`` for ops whose outputs are new data."""
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
        return len(self._indices)

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
        kinds = self._read_flags() if self._indices else []
        queued = list(zip(self._indices, self._positions, self._refs, kinds))
        self._chunks, self._indices, self._positions, self._refs = [], [], [], []
        self._devices = set()
        self._stats_device = None
        checked = set()
        flagged = {}
        refs = {}
        sentinels = {}
        for index, position, ref, kind in queued:
            key = (index, position)
            checked.add(key)
            if kind is None:
                continue
            if kind == _SENTINEL:
                sentinels[key] = ref
                continue
            flagged[key] = kind
            refs[key] = ref
        if not flagged and not self._carry and not self._unjudged:
            self._remember_sentinels(window, sentinels)
            return []
        new = self._replay(window, flagged, refs, carriers, checked, sentinels, written_bases, reading)
        return self._judge(new, final)

    def _read_flags(self) -> list:
        """Per queued pair: None (finite), "nan", "inf", or _SENTINEL (finite, but holding
        ``finfo.max`` or ``finfo.min`` of a floating dtype: a deliberate mask value)."""
        self._stack()
        by_device: dict = {}
        for chunk in self._chunks:
            by_device.setdefault(chunk.device, []).append(chunk)
        if len(by_device) == 1:
            # The one host read of this check point.
            chunks = self._chunks
            values = (torch.cat(chunks) if len(chunks) > 1 else chunks[0]).tolist()
            if math.isfinite(sum(values)) and _SENTINELS.isdisjoint(values):
                return [None] * (len(values) // 2)  # the usual case: all finite
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
        return kinds

    def _remember_sentinels(self, window, sentinels) -> None:
        """Keep the finite sentinel-holding tensors that are still alive, for later windows."""
        alive = {ident: ref for ident, ref in self._sentinels.items() if ref() is not None}
        for (index, position), ref in sentinels.items():
            tensor = ref()
            if tensor is not None:
                alive[id(tensor)] = ref
        self._sentinels = alive

    def _replay(self, window, flagged, refs, carriers, checked, sentinels, written_bases, reading) -> list[Origin]:
        """Follow tensor identities through the window's ops to tell origins from spread."""
        log = self._log
        # ident -> (kind, origin or None when it came from a deliberate constant). Carried
        # tensors count even if they died since: ops in this window may have read them first,
        # and an id reused by a newer tensor is overwritten by the op that made it.
        status = {ident: (kind, origin) for ident, (kind, origin, _) in self._carry.items()}
        live = {ident: ref for ident, (_, _, ref) in self._carry.items()}
        holds_sentinel = set(self._sentinels)
        sentinel_refs = dict(self._sentinels)
        origins: list[Origin] = []
        for entry in window:
            outputs = entry_outputs(entry)
            if not outputs:
                continue
            index = entry[E_INDEX]
            func = log.funcs[entry[E_FUNC]]
            name = func._schema.name
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
                    if kind is None:
                        status.pop(meta[M_IDENT], None)
                    else:
                        status[meta[M_IDENT]] = (kind, None)
                        live[meta[M_IDENT]] = refs[(index, position)]
                continue
            # Gradient accumulation: a backward op autograd runs with no forward op behind it.
            accumulates = entry[E_PHASE] == BACKWARD and entry[E_SITE] == 0 and entry[E_FORWARD_FUNC] < 0
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
                kind = flagged.get(key)
                if kind is None:
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
                    record = record or log.view(entry)
                    origin = self._recomputed(record, entry)
                    if origin is None:
                        origin = Origin(record, kind, from_deliberate=bool(input_states))
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
        """An op that only moves values: its outputs hold what its inputs held."""
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

    def _prune_carry(self) -> None:
        self._carry = {ident: value for ident, value in self._carry.items() if value[2]() is not None}


def _has_sentinel_constant(entry) -> bool:
    """An explicit non-finite or ``finfo.max``/``finfo.min`` constant among the arguments."""
    for value in entry[E_ARGS][1::2]:
        if type(value) is float and (not math.isfinite(value) or value in _SENTINELS):
            return True
    return False
