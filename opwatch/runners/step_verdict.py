"""A step's verdict from what the step already computed: the clip's total norm, GradScaler's
``found_inf``, the loss the program backpropagated; one fused pass only where it computed none.

A healthy step of a guarded run asks one question (are the gradients about to be applied, and
the losses they came from, finite?) and most training loops have answered it already:

- ``clip_grad_norm_`` (nanoGPT's ``grad_clip``, the Hugging Face Trainer's ``max_grad_norm``,
  Lightning's ``gradient_clip_val``) reduces every gradient it clips to one total norm, and a
  p-norm (p > 0) is nan or inf whenever one of the values it covers is. :class:`StepReductions`
  keeps the norms the program computes (a scoped wrap of the function ``clip_grad_norm_`` calls,
  and of ``torch.nn.utils.get_total_norm``, restored on exit), with the gradients each covered;
- ``GradScaler.unscale_`` checks every gradient of an optimizer for nan/inf and skips the step
  itself when it finds one (so the step never reaches opwatch's hooks): a step it unscaled is
  decided by it, gradients-wise;
- the losses ``Tensor.backward()`` ran on are kept by the caller (detached views, no copy).

:class:`VerdictFromStep` reads the cheapest source that covers every gradient of the step: a
scaler's unscale (no read), a clip norm (one scalar read, together with the losses), else the
fused pass of :class:`opwatch.core.finite.FusedFiniteCheck` (GradScaler's kernel over the
gradients, one host read). :meth:`VerdictFromStep.device_flag` computes the same verdict as a
device tensor with no host read, for an optimizer that takes GradScaler's ``found_inf``
(the fused Adam, AdamW, SGD): it skips a failing step on the device, and :class:`DeferredFlag`
brings the flag to the host without blocking, read at the next step (:class:`FoundInfHandOff`:
the hand-off, GradScaler's contract: the flag set on the optimizer for one step). Only where a
host read would wait for the device: on the CPU (``HOST_DEVICES``) the read costs less than
the flag's kernels, and a fused optimizer's step is decided before it runs, as any other's.

:func:`shared_gradients` says when the verdict is the same on every rank of a job (DDP's
reduced gradients), so that a healthy step needs no collective of opwatch's.
"""

from __future__ import annotations

import importlib
import math
import weakref
from typing import NamedTuple

import torch

from ..core.compat import CLIP_HOME, TOTAL_NORM_HOME, amp_non_finite_check, dtensor_class, dtensor_parts, takes_found_inf, version_counter, version_counters
from ..core.finite import FusedFiniteCheck
from ..session.optimizer_steps import optimizer_parameters

__all__ = ["StepReductions", "VerdictFromStep", "FoundInfHandOff", "HOST_DEVICES", "LateVerdict", "DeferredFlag", "KernelSkips", "ScalerSkips", "ScalerSkip", "DeviceVerdict", "ClipNorm", "reduced_norm", "shared_gradients", "trained", "CLIP", "SCALER", "FUSED_PASS"]

# Where a verdict came from (StepVerdict.source): facts a test or a doc can name.
CLIP, SCALER, FUSED_PASS = "clip", "scaler", "fused pass"
_MAX_NORMS = 16  # clip norms kept between two optimizer steps (a loop clips once a step)


class DeviceVerdict(NamedTuple):
    """A step's verdict on the device: ``found_inf`` (0-dim float32, 1 when the step must not
    run) and ``parts``: ``[gradients not finite, losses not finite]`` (two float32 flags)."""

    found_inf: torch.Tensor
    parts: torch.Tensor


class ClipNorm(NamedTuple):
    """One total norm the program computed: the norm tensor, the tensors it covered (``{id:
    version counter}`` when it was computed), whether it is the same on every rank (FSDP2's
    norm, reduced across the ranks), and the same counters once the clip multiplied them by the
    norm (``None`` until a clip did)."""

    total: torch.Tensor
    covered: dict
    shared: bool = False
    clipped: dict | None = None

    def unwritten(self, grads) -> bool:
        """Whether nothing wrote into ``grads`` since this norm was taken (or since its clip)."""
        return unwritten_since(grads, self.covered if self.clipped is None else self.clipped)


def unwritten_since(grads, versions: dict) -> bool:
    """Whether no in-place op wrote into any of ``grads`` since ``versions`` (``{id: version
    counter}``) were read (``False`` for one not there: a ``.grad`` replaced since). A program's
    own check (GradScaler's unscale, a clip's norm) speaks for the values it read, not for a
    write after it."""
    for grad in grads:  # a loop, not a generator: this runs once a step
        if versions.get(id(grad)) != version_counter(grad):
            return False
    return True


class _ScopedWrap:
    """``owner.name`` replaced by ``wrapper(original, ...)`` until :meth:`undo`; a wrap another
    one went on top of is left in place, passing calls through."""

    def __init__(self, owner, name: str, make_wrapper):
        self.owner, self.name = owner, name
        self.original = getattr(owner, name)
        self.active = True
        original = self.original
        wrap = self

        def wrapped(*args, **kwargs):
            if not wrap.active:
                return original(*args, **kwargs)
            return make_wrapper(original, *args, **kwargs)

        wrapped.__wrapped__ = original
        self.wrapped = wrapped
        setattr(owner, name, wrapped)

    def undo(self) -> None:
        self.active = False
        if getattr(self.owner, self.name, None) is self.wrapped:
            setattr(self.owner, self.name, self.original)


class StepReductions:
    """A context manager: while it is entered, the total norms the program computes and the
    optimizers a GradScaler unscales are kept (references, no copy, no kernel). Entering it
    forgets what an earlier scope kept; leaving it keeps them, to be read after the scope (a
    guarded call's check)."""

    _home = None  # the module whose global computes a total norm (imported at the first entry)

    def __init__(self):
        self.norms: list = []
        self._scaler_skips = ScalerSkips()  # the optimizers GradScaler checked, and what they did
        self.skipped: list = []  # ScalerSkip of each optimizer step before the latest backward GradScaler skipped
        self._wraps: list = []
        self._depth = 0
        # Called once, right after the next norm is kept (Lightning's guard mode decides its step
        # there: Lightning clips after the callback's hook, just before the update).
        self.on_norm = None

    def __enter__(self) -> StepReductions:
        self._depth += 1
        if self._depth > 1:
            return self
        self.forget()
        module_name, name = TOTAL_NORM_HOME
        if StepReductions._home is None:
            StepReductions._home = importlib.import_module(module_name)
        home = StepReductions._home
        kept = weakref.ref(self)

        def total_norm(original, tensors, *args, **kwargs):
            norm = original(tensors, *args, **kwargs)
            reductions = kept()
            if reductions is not None:
                norm = reductions.saw_norm(norm, tensors, args, kwargs)
                decide, reductions.on_norm = reductions.on_norm, None
                if decide is not None:
                    decide()
            return norm

        def clip(original, parameters, *args, **kwargs):
            result = original(parameters, *args, **kwargs)
            reductions = kept()
            if reductions is not None:
                reductions.saw_clip(parameters)
            return result

        def unscale_(original, scaler, optimizer):
            result = original(scaler, optimizer)
            reductions = kept()
            if reductions is not None and scaler.is_enabled():
                reductions._scaler_skips.checked(optimizer, scaler)
            return result

        def step(original, scaler, optimizer, *args, **kwargs):
            # GradScaler's step decides the update: it unscales and checks every gradient (a
            # fused optimizer's are checked, not unscaled, and it skips inside its kernel), or
            # they were unscaled already. Its subclasses inherit it (FSDP's ShardedGradScaler,
            # whose own unscale_ the wrap above does not see).
            reductions = kept()
            if reductions is not None and scaler.is_enabled():
                reductions._scaler_skips.checked(optimizer, scaler, again=False)
            return original(scaler, optimizer, *args, **kwargs)

        clip_name, public_clip = CLIP_HOME
        wrapped = [(home, name, total_norm), (torch.nn.utils, "get_total_norm", total_norm), (home, clip_name, clip),
                   (torch.nn.utils, public_clip, clip), (torch.amp.GradScaler, "unscale_", unscale_), (torch.amp.GradScaler, "step", step)]
        self._wraps = [_ScopedWrap(owner, attribute, wrapper) for owner, attribute, wrapper in wrapped if hasattr(owner, attribute)]
        return self

    def __exit__(self, *exc) -> bool:
        self._depth -= 1
        if self._depth == 0:
            for wrap in reversed(self._wraps):
                wrap.undo()
            self._wraps = []
        return False

    def saw_norm(self, norm, tensors, args, kwargs):
        """Keep a norm that answers the question: a p-norm with p > 0 (nan and inf carry through
        it; p = 0 counts nonzeros, p = -inf takes the smallest), of plain tensors or DTensors.
        Returns the norm the program gets back: itself, or for a DTensor norm still partial
        across the ranks (FSDP2: each rank's part of it, of its shards), the same norm reduced
        now (:func:`reduced_norm`) rather than in the clip's next op, so that the clip's own
        all-reduce carries the verdict: the same on every rank, no collective of opwatch's."""
        norm_type = next(iter(args), kwargs.get("norm_type", 2.0))  # get_total_norm(tensors, norm_type, ...)
        try:
            norm_type = float(norm_type)
        except (TypeError, ValueError):
            return norm
        if not norm_type > 0 or len(self.norms) >= _MAX_NORMS:
            return norm
        total, shared = norm, False
        if type(norm) is not torch.Tensor:
            dtensor = dtensor_class()
            if dtensor is None or not isinstance(norm, dtensor):
                return norm
            norm = reduced_norm(norm)
            total, placements, _ = dtensor_parts(norm)
            shared = all(placement.is_replicate() for placement in placements)
        covered = [tensors] if isinstance(tensors, torch.Tensor) else tensors
        self.norms.append(ClipNorm(total, dict(zip(map(id, covered), version_counters(covered))), shared))
        return norm

    def saw_clip(self, parameters) -> None:
        """A clip multiplied the gradients of ``parameters`` by its norm: the newest kept norm
        that covered them speaks for them as they are now (the counters read again). Parameters
        given as a generator (spent by the clip) are left alone: their norm then stops at them."""
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        if not isinstance(parameters, (list, tuple)) or not self.norms:
            return
        grads = [parameter.grad for parameter in parameters if parameter.grad is not None]
        wanted = set(map(id, grads))
        for position in range(len(self.norms) - 1, -1, -1):
            norm = self.norms[position]
            if wanted <= norm.covered.keys():
                self.norms[position] = norm._replace(clipped=dict(zip(map(id, grads), version_counters(grads))))
                return

    def after_backward(self) -> bool:
        """A backward ran: a norm computed before it covers gradients that changed since.
        Returns whether GradScaler skipped the step before this backward: an optimizer it
        unscaled never stepped, or a fused one it handed ``found_inf`` skipped inside its
        kernel (:attr:`skipped`'s ``in_kernel``: that step was counted as one that ran)."""
        self.norms.clear()
        return self.skipped_since()

    def skipped_since(self) -> bool:
        """Whether GradScaler skipped an optimizer step since the last call (see
        :meth:`after_backward`; the run's end asks it too), that step in :attr:`skipped`."""
        self.skipped, _ = self._scaler_skips.read()
        return bool(self.skipped)

    def after_step(self, optimizer) -> None:
        self.norms.clear()
        self._scaler_skips.stepped(optimizer)

    def forget(self) -> None:
        self.norms.clear()
        self._scaler_skips = ScalerSkips()

    def scaler_checked(self, optimizer, grads) -> bool:
        """Whether an enabled GradScaler's check of ``optimizer``'s gradients ``grads`` speaks for
        them now (its kernel checked every one; it skips the step itself when one is not finite):
        it ran inside its ``step()``, right before the optimizer's, or at its ``unscale_`` with
        nothing written into them since but by a clip whose norm was taken right after it."""
        if not self._scaler_skips.checking(optimizer):
            return False
        versions = self._scaler_skips.versions_at_check(optimizer)
        if versions is None or unwritten_since(grads, versions):
            return True
        norm = self.norm_covering(grads)  # a clip right after the unscale, and nothing since
        return norm is not None and norm.clipped is not None and norm.covered.items() >= versions.items()

    def norm_covering(self, grads) -> ClipNorm | None:
        """The newest kept norm that covered every tensor of ``grads`` and still speaks for them,
        or ``None``: none of them written since, but by the clip's own multiplication (by at most
        1, which keeps finite values finite)."""
        if not self.norms:
            return None
        wanted = set(map(id, grads))
        for norm in reversed(self.norms):
            if wanted <= norm.covered.keys():
                return norm if norm.unwritten(grads) else None
        return None


class VerdictFromStep:
    """Whether a step's gradients and losses are finite, read from the cheapest source that
    covers them (the module's docstring); :attr:`source` says which one the last call read."""

    def __init__(self, reductions: StepReductions | None = None, fused: FusedFiniteCheck | None = None):
        self.reductions = reductions
        self.fused = fused if fused is not None else FusedFiniteCheck()  # its flags kept from step to step
        self.source: str | None = None
        self.shared = False  # whether the last verdict's gradients part is the same on every rank (a reduced norm)

    def finite(self, grads, losses=(), optimizer=None) -> bool:
        """One verdict, at most one host read (none when a scaler decided and the losses are CPU scalars)."""
        reductions = self.reductions
        self.shared = False
        if reductions is not None and reductions.scaler_checked(optimizer, grads):
            self.source = SCALER  # the scaler skips an overflowing step itself: it never gets here
            return scalars_finite(losses, self.fused)
        norm = reductions.norm_covering(grads) if reductions is not None and grads else None
        if norm is not None:
            self.source, self.shared = CLIP, norm.shared
            return scalars_finite([norm.total, *losses], self.fused)
        self.source = FUSED_PASS
        return self.fused(grads, list(losses))

    def gradients_finite(self, grads, optimizer=None) -> bool:
        """The gradients' part alone (read after a failed :meth:`finite`, to tell a loss that is
        not finite on this rank from gradients that are not finite on every rank)."""
        return self.finite(grads, (), optimizer)

    def device_flag(self, grads, losses=(), optimizer=None):
        """The verdict as a :class:`DeviceVerdict` on the gradients' device, with no host read:
        ``found_inf`` for the optimizer and the two parts it is made of; ``None`` where it cannot
        be made that way (no gradient, several devices, DTensors)."""
        if not grads or dtensor_class() is not None and any(type(grad) is not torch.Tensor for grad in grads):
            return None
        first, *_ = grads
        device = first.device
        if any(grad.device != device for grad in grads) or any(loss.device != device for loss in losses):
            return None
        norm = self.reductions.norm_covering(grads) if self.reductions is not None else None
        with torch.no_grad():
            if losses:
                loss_bad = (~torch.isfinite(torch.cat([loss.detach().reshape(-1).float() for loss in losses]))).any().float()
            else:
                loss_bad = torch.zeros((), device=device)
            if norm is not None and norm.total.device == device:
                self.source = CLIP
                grads_bad = (~torch.isfinite(norm.total.detach())).float()
            elif amp_non_finite_check is None:
                return None
            else:
                self.source = FUSED_PASS
                grads_bad = torch.zeros((), device=device)
                writable = [grad for grad in grads if not grad.requires_grad]
                read_only = [torch.linalg.vector_norm(grad.detach(), math.inf).reshape(1) for grad in grads if grad.requires_grad]
                amp_non_finite_check(writable + read_only, grads_bad, torch.ones((), device=device))
            # found_inf must be exactly 0 or 1: the fused step subtracts it from its step counts
            return DeviceVerdict(torch.maximum(grads_bad, loss_bad), torch.stack((grads_bad, loss_bad)))


def reduced_norm(norm):
    """A DTensor total norm with its partial placements reduced (``Replicate`` on every mesh
    dimension): the all-reduce the clip's next op (``total_norm + eps``) makes anyway, made
    here instead, with the same values (the clip then meets a reduced norm and makes none). A
    norm that cannot be redistributed is returned as it is (its local part still stands for
    this rank's shards)."""
    _, placements, mesh = dtensor_parts(norm)
    if not any(placement.is_partial() for placement in placements):
        return norm
    try:
        from torch.distributed.tensor import Replicate

        return norm.redistribute(mesh, [Replicate()] * len(placements))
    except Exception:  # an older DTensor API: the norm as the program made it
        return norm


def scalars_finite(tensors, fused: FusedFiniteCheck) -> bool:
    """Whether a few small tensors (a norm, losses) hold only finite values: CPU scalars read
    where they lie, the others in one fused read."""
    for tensor in tensors:  # loops, not generators: this runs once a step, with cold caches
        if not tensor.is_cpu or tensor.numel() != 1:
            return fused([], list(tensors))
    for tensor in tensors:
        if not math.isfinite(tensor.item()):
            return False
    return True


class DeferredFlag:
    """A device flag brought to the host without blocking: a pinned buffer and an event (on a
    CUDA device), read at the next step, when the device has almost always finished it."""

    def __init__(self):
        self._host = None
        self._event = None
        self.pending = False

    def hand(self, flag) -> None:
        """Start the copy of ``flag`` (a small float32 tensor: a verdict's parts) to the host."""
        if flag.is_cuda:
            if self._host is None or self._host.shape != flag.shape:
                self._host = torch.zeros(flag.shape, pin_memory=True)
            self._host.copy_(flag, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = flag  # a CPU flag is on the host already: read it when asked
            self._event = None
        self.pending = True

    def read(self, *, wait: bool = True) -> tuple | None:
        """The flag handed last, as a tuple of bools (waits for the copy only if it has not
        ended); ``None`` when none is pending, or, ``wait=False``, when the device has not
        finished it yet (it stays pending: no wait)."""
        if not self.pending:
            return None
        if self._event is not None:
            if not wait and not self._event.query():
                return None
            self._event.synchronize()
        self.pending = False
        return tuple(value != 0 for value in self._host.tolist())


class KernelSkips:
    """The steps a fused optimizer skipped inside its kernel. GradScaler does not skip the call of
    a fused optimizer (Adam, AdamW, SGD, Adagrad with ``fused=True``: the Hugging Face Trainer's
    default): it hands it ``found_inf`` (set on the optimizer until its step returns), and the
    kernel leaves the weights alone when it is set. :meth:`stepped` keeps that flag at the
    step's post-hook, :meth:`read` reads it at the next backward or guarded call, through a
    :class:`DeferredFlag`: no host read on the step itself, none at all on the CPU."""

    def __init__(self):
        self._kept: dict = {}  # id(optimizer) -> _KeptFlag

    def stepped(self, optimizer) -> bool:
        """``optimizer`` stepped; returns whether it holds a ``found_inf`` for that step (kept)."""
        flag = getattr(optimizer, "found_inf", None) if takes_found_inf(optimizer) else None
        if not isinstance(flag, torch.Tensor):
            return False
        kept = self._kept.get(id(optimizer))
        deferred = kept.flag if kept is not None and kept.optimizer() is optimizer else DeferredFlag()
        deferred.hand(flag.detach().reshape(1).float())
        self._kept[id(optimizer)] = _KeptFlag(weakref.ref(optimizer), deferred)
        return True

    def read(self) -> dict:
        """``{id(optimizer): whether its kernel skipped the step}`` for each flag kept since the
        last read, read now (waiting for the device's copy where it has not ended)."""
        if not self._kept:
            return {}
        read = {}
        for ident, kept in self._kept.items():
            parts = kept.flag.read()
            if parts is not None:
                read[ident] = any(parts)
        self._kept = {ident: kept for ident, kept in self._kept.items() if kept.optimizer() is not None}
        return read


class _KeptFlag(NamedTuple):
    optimizer: weakref.ref
    flag: DeferredFlag


class _Checked(NamedTuple):
    optimizer: weakref.ref
    scaler: weakref.ref
    versions: dict | None  # {id(grad): version counter} after GradScaler's unscale_, None: checked in its step()


class ScalerSkip(NamedTuple):
    """A step GradScaler skipped: its optimizer, the GradScaler, and whether the step was called
    and skipped inside a fused optimizer's kernel."""

    optimizer: object
    scaler: object
    in_kernel: bool


class ScalerSkips:
    """What GradScaler did with each optimizer whose gradients it checked, from one :meth:`read`
    to the next (a backward, a guarded call): the optimizer stepped, or did not (GradScaler skipped
    its step), or was a fused one that stepped with the ``found_inf`` GradScaler handed it and
    skipped inside its kernel when that flag is set (:class:`KernelSkips`, read then). Told of
    the checks (GradScaler's ``unscale_`` and ``step``) and of each step (the post-hook): no
    kernel, no host read but a kept flag's."""

    def __init__(self):
        # Optimizers checked, {id: _Checked}, and the ids of those that stepped since: a dict
        # and a set, whose reads on every step (empty, but under GradScaler) cost no Python call
        # as a WeakSet's do.
        self._checked: dict = {}
        self._stepped: set = set()
        self._kernel_skips = KernelSkips()

    def checked(self, optimizer, scaler, *, again: bool = True) -> None:
        """GradScaler ``scaler`` checked ``optimizer``'s gradients: at its ``unscale_``, their
        version counters read now, or (``again=False``) inside its ``step()``, which changes
        nothing when its ``unscale_`` did since the optimizer's last step."""
        ident = id(optimizer)
        if again or ident not in self._checked or ident in self._stepped:
            grads = [parameter.grad for parameter in trained(optimizer)] if again else None
            versions = None if grads is None else dict(zip(map(id, grads), version_counters(grads)))
            self._checked[ident] = _Checked(weakref.ref(optimizer), weakref.ref(scaler), versions)
            self._stepped.discard(ident)

    def checking(self, optimizer) -> bool:
        """Whether GradScaler checked ``optimizer``'s gradients since its last step."""
        checked = self._checked.get(id(optimizer)) if self._checked else None
        return checked is not None and id(optimizer) not in self._stepped and checked.optimizer() is optimizer

    def versions_at_check(self, optimizer) -> dict | None:
        """``{id(grad): version counter}`` of the gradients GradScaler's ``unscale_`` checked
        (:meth:`checking` first), or ``None`` where its ``step()`` checked them, right before the
        optimizer's."""
        return self._checked[id(optimizer)].versions

    def stepped(self, optimizer, scaler=None) -> None:
        """``optimizer`` stepped. A fused one holding GradScaler's ``found_inf`` is decided when
        that flag is read; ``scaler``: the GradScaler it is put down to when none was seen
        checking it (a guard's, which follows only ``unscale_``)."""
        ident = id(optimizer)
        if ident not in self._checked:  # no GradScaler in the loop: every step
            if scaler is not None and self._kernel_skips.stepped(optimizer):
                self._checked[ident] = _Checked(weakref.ref(optimizer), weakref.ref(scaler), None)
        elif not self._kernel_skips.stepped(optimizer):
            self._stepped.add(ident)

    def read(self) -> tuple:
        """``(skips, stepped)`` since the last read: a :class:`ScalerSkip` of each optimizer
        checked and alive that did not step or whose kernel skipped the step (several optimizers
        after one backward: each is an optimizer step skipped), in the order GradScaler checked
        them; whether one stepped. Forgets them."""
        if not self._checked:
            return [], False
        in_kernel = self._kernel_skips.read()  # {id: whether the kernel skipped the step}, of the fused steps
        skips = []
        for ident, (reference, scaler, _) in self._checked.items():
            optimizer = reference()
            if optimizer is not None and in_kernel.get(ident, ident not in self._stepped):
                skips.append(ScalerSkip(optimizer, scaler(), ident in in_kernel))
        stepped = bool(self._stepped) or not all(in_kernel.values())
        self._checked.clear()
        self._stepped.clear()
        return skips, stepped


class LateVerdict(NamedTuple):
    """The verdict of a step handed to a fused optimizer, its flag read a step later."""

    step: int
    failed: bool  # the optimizer skipped it on the device
    gradients: bool  # its gradients held nan/inf (else only its losses did, if it failed)
    losses: list  # the losses backward() ran on (references, kept for a failed step), to say which kind


class _Handed(NamedTuple):
    flag: DeferredFlag
    step: int
    losses: list


# Devices whose values the host reads without waiting for queued work: a verdict is read there
# before the step, never handed to a fused optimizer to be read a step late.
HOST_DEVICES = frozenset({"cpu"})


class FoundInfHandOff:
    """The verdict handed to fused optimizers as ``found_inf`` (set on the optimizer for its
    step, deleted after it, as GradScaler does), each flag read back at that optimizer's next
    step (or at the end of the run) through a :class:`DeferredFlag`."""

    def __init__(self):
        self._deferred = weakref.WeakKeyDictionary()  # optimizer -> _Handed
        # Optimizers holding opwatch's found_inf for the step running now, {id: weak reference}
        # (read after every step: a dict, no Python call).
        self._handed: dict = {}

    @staticmethod
    def takes(optimizer) -> bool:
        """Whether ``optimizer`` skips its own update on the device when handed ``found_inf``,
        has none from GradScaler for this step, and trains parameters whose values a host read
        would wait for (not on the CPU: there a read costs less than the flag's kernels, and
        the step is decided before it runs, with no verdict told late)."""
        if not takes_found_inf(optimizer) or getattr(optimizer, "found_inf", None) is not None:
            return False
        first = next(iter(optimizer_parameters(optimizer)), None)
        return first is not None and first.device.type not in HOST_DEVICES

    def hand(self, optimizer, verdict: DeviceVerdict, step: int, losses) -> None:
        kept = self._deferred.get(optimizer)
        flag = kept.flag if kept is not None else DeferredFlag()
        flag.hand(verdict.parts)
        self._deferred[optimizer] = _Handed(flag, step, losses)  # references: read only if it failed
        optimizer.found_inf = verdict.found_inf
        optimizer.grad_scale = None
        self._handed[id(optimizer)] = weakref.ref(optimizer)

    def forget(self, optimizer) -> None:
        self._deferred.pop(optimizer, None)

    def pending(self) -> bool:
        """Whether a flag handed is still to be read."""
        return any(kept.flag.pending for kept in list(self._deferred.values()))

    def after_step(self, optimizer) -> None:
        handed = self._handed.pop(id(optimizer), None) if self._handed else None
        if handed is not None and handed() is optimizer:
            del optimizer.found_inf, optimizer.grad_scale

    def read(self, optimizer=None, *, wait: bool = True) -> list:
        """The :class:`LateVerdict` s of the flags handed to ``optimizer`` (``None``: to every
        optimizer) and not read yet, each read once; ``wait=False``: only the flags the device
        has finished."""
        found = []
        for handed in [optimizer] if optimizer is not None else list(self._deferred):
            kept = self._deferred.get(handed)
            parts = None if kept is None else kept.flag.read(wait=wait)
            if parts is not None:
                gradients_bad, _ = parts
                found.append(LateVerdict(kept.step, any(parts), bool(gradients_bad), kept.losses))
                self._deferred[handed] = kept._replace(losses=[])
        return found


def trained(optimizer) -> list:
    """The parameters of ``optimizer`` that have a gradient."""
    return [parameter for parameter in optimizer_parameters(optimizer) if parameter.grad is not None]


def shared_gradients(params, modules) -> bool:
    """Whether every parameter of ``params`` is trained by a ``DistributedDataParallel`` module
    among ``modules``: its gradient is reduced across the ranks before the optimizer step, so a
    verdict read from it is the same on every rank (a nan/inf on one rank reaches all of them)."""
    ddp = torch.nn.parallel.DistributedDataParallel
    reduced: set = set()
    for module in modules:
        if isinstance(module, ddp):
            reduced.update(id(parameter) for parameter in module.parameters() if parameter.requires_grad)
    if not reduced:
        return False
    return all(id(parameter) in reduced for parameter in params)
