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
from ..records import BACKWARD, E_ARGS, E_FUNC, E_INDEX, E_NINPUTS, M_DEVICE, M_DTYPE, M_IDENT, entry_inputs, entry_outputs
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
    "aten::lift_fresh", "aten::lift_fresh_copy", "aten::lift",
}


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
    """A nan/inf origin found at a check point, with how far its values spread."""

    __slots__ = ("record", "kind", "spread", "last", "became_nan", "reached_backward", "matters")

    def __init__(self, record, kind):
        self.record = record  # the OpRecord of the op that made the value
        self.kind = kind
        self.spread = 0  # later ops that carried its values on
        self.last = record  # the last of them
        self.became_nan = None  # for an inf origin: the first op that turned its inf into nan
        self.reached_backward = record.phase == BACKWARD
        self.matters = True

    def carried_by(self, record, kind=None) -> None:
        self.spread += 1
        self.last = record
        if kind == "nan" and self.kind == "inf" and self.became_nan is None:
            self.became_nan = record
        if record.phase == BACKWARD:
            self.reached_backward = True

    def finding(self, *, contained: bool) -> Finding:
        record = self.record
        what = "nan" if self.kind == "nan" else "inf"
        spread = ""
        if self.spread:
            spread = f"; by the check point it had spread to {self.spread} later op(s), the last {self.last.op} at {self.last.where} ({self.last.phase})"
        if self.became_nan is not None:
            turned = self.became_nan
            spread += f"; it turned into nan at {turned.op} at {turned.where} ({turned.phase})"
        if contained:
            spread += "; it was absorbed before it mattered (no live tensor, gradient or backward op held it)"
        inputs = "finite inputs" if record._entry[E_NINPUTS] else "no tensor inputs"
        return Finding(
            kind=self.kind,
            problem=f"first {what} here: {record.signature()} made {what} from {inputs}{spread}",
            expected="finite outputs from finite inputs",
            fix=_fix_for(record),
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
    return func._schema.name.split("::")[-1]


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
        # Non-finite tensors still alive after the last check point: ident -> (kind, origin, ref)
        self._carry: dict[int, tuple] = {}

    def for_op(self, func):
        """The observer for ``func``'s outputs, called after each kernel as
        ``observe(entry, inputs, outputs, metas)``; ``None`` for ops whose outputs are new data."""
        if makes_new_data(func):
            return None
        if not preserves_values(func):
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
        return bool(self._carry)

    def pending_on(self, device) -> bool:
        """Whether flags wait on ``device``: a host read there already pays for a sync."""
        return device in self._devices

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

    def resolve(self, window) -> list[Origin]:
        """Check point: read all queued flags at once and return the new origins, oldest first.

        ``window`` is every log entry since the previous check point, oldest first.
        """
        carriers, self._carriers = self._carriers, {}
        if not self._indices:
            self._prune_carry()
            return []
        self._stack()
        kinds = self._read_flags()
        queued = zip(self._indices, self._positions, self._refs, kinds)
        self._chunks, self._indices, self._positions, self._refs = [], [], [], []
        self._devices = set()
        self._stats_device = None
        flagged = {}
        refs = {}
        for index, position, ref, kind in queued:
            if kind is not None:
                flagged[(index, position)] = kind
                refs[(index, position)] = ref
        if not flagged and not self._carry:
            return []
        return self._replay(window, flagged, refs, carriers)

    def _read_flags(self) -> list[str | None]:
        by_device: dict = {}
        for chunk in self._chunks:
            by_device.setdefault(chunk.device, []).append(chunk)
        if len(by_device) == 1:
            # The one host read of this check point.
            chunks = self._chunks
            values = (torch.cat(chunks) if len(chunks) > 1 else chunks[0]).tolist()
            if math.isfinite(sum(values)):
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
            else:
                kinds.append(None)
        return kinds

    def _replay(self, window, flagged, refs, carriers) -> list[Origin]:
        """Follow tensor identities through the window's ops to tell origins from spread."""
        log = self._log
        # ident -> (kind, origin or None when it came from a deliberate constant). Carried
        # tensors count even if they died since: ops in this window may have read them first,
        # and an id reused by a newer tensor is overwritten by the op that made it.
        status = {ident: (kind, origin) for ident, (kind, origin, _) in self._carry.items()}
        live = {ident: ref for ident, (_, _, ref) in self._carry.items()}
        origins: list[Origin] = []
        for entry in window:
            outputs = entry_outputs(entry)
            if not outputs:
                continue
            index = entry[E_INDEX]
            func = log.funcs[entry[E_FUNC]]
            fed = [meta[3] for meta in entry_inputs(entry) if meta[3] in status]
            input_states = [status[ident] for ident in fed]
            if preserves_values(func):
                # Not checked: its outputs hold what its inputs held.
                source = next((ident for ident in fed if status[ident][1] is not None), None)
                if source is None and fed:
                    source = fed[0]
                carrier = status[source] if source is not None else None
                if carrier is not None and carrier[1] is not None and carrier[1].last.index != index:
                    carrier[1].carried_by(log.view(entry))
                for position, meta in enumerate(outputs):
                    # A view to an integer dtype still holds the bits (x.view(torch.int32)).
                    if carrier is not None and (meta[1] in _CHECKED_DTYPES or func.is_view):
                        status[meta[3]] = carrier
                        # A view holds its base alive: the base's reference stands in for it.
                        ref = carriers.get(index << 32 | position) or live.get(source)
                        if ref is not None:
                            live[meta[3]] = ref
                    else:
                        status.pop(meta[3], None)
                continue
            input_origin = next((state[1] for state in input_states if state[1] is not None), None)
            record = None
            for position, meta in enumerate(outputs):
                ident = meta[3]
                kind = flagged.get((index, position))
                if kind is None:
                    status.pop(ident, None)
                    continue
                live[ident] = refs[(index, position)]
                if _has_nonfinite_constant(entry):
                    origin = None  # a deliberate constant such as masked_fill(mask, -inf)
                elif not input_states:
                    record = record or log.view(entry)
                    origin = Origin(record, kind)
                    origins.append(origin)
                else:
                    # Fed by non-finite inputs: spread, even where inf turns into nan (inf - inf).
                    origin = input_origin
                    if origin is not None and origin.last.index != index:
                        origin.carried_by(record or log.view(entry), kind)
                status[ident] = (kind, origin)
        self._carry = {
            ident: (kind, origin, live[ident])
            for ident, (kind, origin) in status.items()
            if ident in live and live[ident]() is not None
        }
        alive_origins = {id(origin) for _, origin, _ in self._carry.values() if origin is not None}
        for origin in origins:
            origin.matters = origin.reached_backward or id(origin) in alive_origins
        return origins

    def _prune_carry(self) -> None:
        self._carry = {ident: value for ident, value in self._carry.items() if value[2]() is not None}


def _has_nonfinite_constant(entry) -> bool:
    for value in entry[E_ARGS][1::2]:
        if type(value) is float and not math.isfinite(value):
            return True
    return False
