"""The private ``TorchDispatchMode`` that sees every ATen op: the hot path of opwatch.

The way of one op, in ``__torch_dispatch__``:

1. its arguments are read into tensor metadata (:func:`~opwatch.core.records.tensor_metas`)
   and a flat tuple of the other arguments; ``_head`` adds the index the log gives the op
   (``OpLog.next_index``: the modes beside this one number their calls in the same log, by
   ``OpLog.log_call``), the user's source site, the module (its path and class) and the phase;
2. the pre-kernel checks bound to the op (:class:`~opwatch.checks.ActiveChecks`) run on the
   metadata; a finding is logged (unfinished) and handed to the one exit of findings,
   :class:`~opwatch.findings.pipeline.FindingPipeline` (``self.findings``), in front of the
   :class:`~opwatch.findings.report.Reporter`; in strict mode the error it hands back is raised
   before the kernel runs;
3. the kernel runs; its own exceptions reach the program untouched;
4. the complete log entry (:func:`~opwatch.core.records.op_entry`) is appended and the checks'
   trackers observe the outputs; the exit learns the outputs of an op with a finding;
5. at check points (a host read where flags wait, every ``max_records`` ops, and when
   :class:`~opwatch.session.Watch` asks) the exit reports what the checks judge there.

The interceptor knows no check: what a finding becomes (held until its result is used, told
where its odd operand was made, contained) is decided by the exit's stages, each owned by its
check. While findings wait for an op that uses their result, every op takes a detour before
step 1 (the switch the hot path tests anyway, also set when the watch is inert) where the exit
sees its arguments; a healthy program never takes it.

Everything that does not change between calls of one ``OpOverload`` is worked out once and
cached in an :class:`_OpPlan`. opwatch's own work runs inside one guard: whatever goes wrong in
it becomes one :class:`~opwatch.OpwatchWarning` and the watch switches itself off; only an
:class:`~opwatch.AnomalyError` of strict mode may leave it.

Backward ops are tied to the forward line through autograd sequence numbers: a forward op
that creates an autograd node bumps the thread's sequence counter, so the counter read in the
forward op names its node; in backward, the node being run reports the same number. No
``grad_fn`` or node metadata is touched (both have crashed or raised in probes).

Collectives (:mod:`opwatch.core.collective_ops`) take the same way. Their outputs are the tensors they
write, also where they return ``([tensors], Work)`` or the ``Work`` alone (decided per op in
the plan); the nan/inf tracker reads them once the collective has completed. The engine's
final callbacks (the DDP reducer copying reduced buckets into ``.grad``) are backward ops, and
in a distributed watch the engine's ops without a forward line get a named site
(``DDP bucket [fc.weight, fc.bias]``, :mod:`opwatch.modes.reducer`) instead of none.

A process forked while a watch is active (DataLoader workers started with ``fork``) inherits
the thread's mode stack: there the watch is inert, as it is in spawned workers.
"""

from __future__ import annotations

# pytest leaves this module's frames out of a failing test's traceback (it reads
# __tracebackhide__ in each frame's globals): opwatch's frames are not the user's story.
__tracebackhide__ = True

import os
import sys
import traceback
import weakref
from itertools import islice
from time import perf_counter_ns

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..core.compat import SKIPS_DYNAMO_PER_CODE, autograd_sequence_nr, current_autograd_node, get_sequence_nr, op_kernel, skip_dynamo_for_code
from ..core.collective_ops import collective_outputs, describe_script_object
from ..core.ops import facts_of
from ..core.records import BACKWARD, E_INDEX, FORWARD, M_DEVICE, M_IDENT, OpLog, op_entry
from ..core.records import tensor_metas as _metas  # a module global: bench.ablate stubs it
from ..findings.pipeline import FindingPipeline
from ..core.sites import user_frame
from .compiled_returns import when_compiled_call_returns

__all__ = ["OpInterceptor", "keep_dynamo_out"]

_Tensor = torch.Tensor
_ScriptObject = torch.ScriptObject
# Non-tensor argument values stored as they are; others are summarised by their type's name.
_PLAIN_VALUES = {int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format}
_NO_SITE = (0, None, -1)
# Profiler ops that start (True) and end (False) a record_function region.
_REGION_OPS = {"profiler::_record_function_enter": True, "profiler::_record_function_enter_new": True, "profiler::_record_function_exit": False}


class _OpPlan:
    """What one ``OpOverload`` needs on the hot path, worked out on its first call."""

    __slots__ = ("kernel", "func_id", "is_ignored", "region", "mutated_args", "pre_checks", "input_observers", "observers", "may_read_to_host", "is_copy", "collective")

    def __init__(self, func, func_id: int, checks):
        # The C++ op itself: OpOverload.__call__ is a Python frame around it.
        self.kernel = op_kernel(func)
        # The op's number in the log's table of ops (entries store it, not the op).
        self.func_id = func_id
        # record_function markers (optimizers emit them) are not computations.
        self.is_ignored = func.namespace == "profiler"
        # The start (True) or end (False) of a record_function region (an optimizer step's), else None.
        self.region = _REGION_OPS.get(func._schema.name) if self.is_ignored else None
        facts = facts_of(func)
        # Arguments written in place, as (position, name): the op's real outputs when it returns
        # nothing (``_foreach_add_`` updating parameters returns None).
        self.mutated_args = facts.mutated_args
        # The bound pre-kernel checks that can fire on this op, in order.
        self.pre_checks = checks.pre_kernel(func)
        # The checks' trackers to feed with this op's outputs and inputs (after the kernel).
        self.input_observers = checks.input_observers(func)
        self.observers = checks.observers(func)
        # Does the op (sometimes) bring device values to the host? Then it may be a check point.
        self.may_read_to_host = facts.reads_to_host
        # Is it a copy? It reads to the host only from a device to a CPU destination.
        self.is_copy = facts.is_copy
        # A c10d op or functional collective (opwatch.core.ops.Collective): its outputs are
        # the tensors it writes, filled only once it completes. None for every other op.
        self.collective = facts.collective


# Interceptors active in this process, made inert in a forked child (see the module's doc).
_active: weakref.WeakSet = weakref.WeakSet()


def _make_inert_after_fork() -> None:
    for interceptor in list(_active):
        interceptor.inert = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_make_inert_after_fork)


class OpInterceptor(TorchDispatchMode):
    """Records every op into ``log``, runs the ``checks`` and hands their findings to
    ``reporter``. Errors of opwatch itself go to ``on_internal_error(error, traceback_text)``."""

    # The per-op work is __torch_dispatch__ with its cached _OpPlan: every helper it calls per
    # op is one more Python call on every op of the user's program. What is not per op (a new
    # op, a finding, a failed kernel, check points) is in the methods below; what a finding
    # becomes, in the exit (self.findings). tests/unit/test_rules.py keeps the class within
    # 235 code lines and __torch_dispatch__ within 80.

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps __torch_dispatch__ in torch._dynamo.disable, a Python
        # wrapper on every op; marking the code object (keep_dynamo_out) keeps Dynamo out as
        # well, free.
        return not SKIPS_DYNAMO_PER_CODE

    def __init__(self, *, log: OpLog, checks, reporter, modules, max_records: int, on_internal_error, check_every: int | None = None, distributed=None):
        super().__init__()
        self._log = log
        self._entries = log.entries
        self._checks = checks
        self._context = checks.context
        # The one exit of findings (defer, provenance, containment), in front of the reporter.
        self.findings = FindingPipeline(checks, reporter)
        self._modules = modules
        # At the latest every this many ops, a check point (at most one forced host read).
        self._check_every = check_every or max_records
        self._on_internal_error = on_internal_error
        # A RankState with .sites (opwatch.modes.ranks.DistributedWatch) where torch.distributed is
        # available, else None; its ReducerSites name the engine's ops without a forward line once the rank is known.
        self._distributed = distributed
        self._reducer_sites = distributed.sites if distributed is not None and distributed.rank is not None else None
        self._plans: dict = {}  # id(OpOverload) -> _OpPlan (OpOverload hashes in Python)
        # Forward sites kept, oldest dropped first: part of the fixed memory cost of
        # max_records, so that a long loop stays flat.
        self._table_limit = 2 * max_records + 4096
        # True once opwatch broke (after one warning) or in a forked child: ops pass through.
        self._inert = False
        # The one switch the hot path tests before its usual work: set while inert, or while
        # findings wait for an op that uses their result (FindingPipeline.waiting).
        self._detour = False
        self._window_start = log.next_index  # first op index not yet covered by a check point
        self._check_at = log.next_index + self._check_every - 1  # the op index that is one at the latest
        # autograd sequence number of a forward node -> (site id, module, op id) of its forward op
        self.forward_sites: dict = {}
        self._site_tuples: dict = {}
        self._last_seq = get_sequence_nr()
        # (op index, id of the exception) when a kernel raised
        self.failure: tuple[int, int] | None = None
        # Told where profiler regions start and end (opwatch.modes.functions), or None.
        self.on_region = None

    @property
    def inert(self) -> bool:
        """True once opwatch broke (after one warning) or in a forked child: ops pass through."""
        return self._inert

    @inert.setter
    def inert(self, value: bool) -> None:
        self._inert = value
        self._detour = value or self.findings.waiting

    def __enter__(self):
        _active.add(self)
        # Inside a compiled call, on the stack where it returns (see opwatch.modes.compiled_returns).
        if when_compiled_call_returns(super().__enter__, sys._getframe(1)):
            return self
        return super().__enter__()

    def __exit__(self, exc_type, exc, traceback_):
        _active.discard(self)
        if when_compiled_call_returns(lambda: super(OpInterceptor, self).__exit__(None, None, None), sys._getframe(1)):
            return False
        return super().__exit__(exc_type, exc, traceback_)

    # -- the hot path -------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # One function on purpose: this runs for every op, and Python calls cost. What is not
        # on every op (a new op, a finding, a failed kernel) is in the methods below it.
        if kwargs is None:
            kwargs = {}
        if self._detour:
            if self._inert:
                return func(*args, **kwargs)
            self._before(func, args, kwargs)  # strict: raises before a consumer's kernel
        plan = self._plans.get(id(func)) or self._plan(func)
        if plan is None or plan.is_ignored:
            return self._unwatched(plan, func, args, kwargs)

        # -- before the kernel: the op's arguments, source, module and phase; the checks.
        try:
            log = self._log
            tensors = []
            others = []  # flat: key, value, key, value, ...
            position = 0
            for value in args:
                if isinstance(value, _Tensor):
                    tensors.append(value)
                elif type(value) in _PLAIN_VALUES:
                    others += (position, value)
                else:
                    _split(position, value, tensors, others, log.intern)
                position += 1
            if kwargs:
                for name, value in kwargs.items():
                    if isinstance(value, _Tensor):
                        tensors.append(value)
                    else:
                        _split(name, value, tensors, others, log.intern)
            inputs = _metas(tensors, log, types)
            head = self._head(plan, others)
            finding = None
            context = self._context
            for check in plan.pre_checks:
                finding = check(inputs, context)
                if finding is not None:
                    break
            # A host read where flags wait is a free check point: the program syncs anyway.
            is_check_point = plan.may_read_to_host and inputs and _reads_to_host(plan, inputs, kwargs) and self._checks.flags_wait_on(inputs[-1][M_DEVICE])
        except Exception as error:
            self.internal_error(error)
            return func(*args, **kwargs)
        if is_check_point:
            # strict: raises for an origin before this read runs
            self.check_point(reading=tuple(meta[M_IDENT] for meta in inputs))
        # In the log before it is reported: a strict raise dumps it as the failing op.
        record = None if finding is None else self._found(finding, head, inputs)  # strict: raises

        # -- the kernel: its errors reach the program untouched.
        start = perf_counter_ns()
        try:
            out = plan.kernel(*args, **kwargs)
        except BaseException as error:
            self._failed(head, start, inputs, record, error)
            raise
        end = perf_counter_ns()

        # -- after the kernel: the outputs, the complete entry, the trackers.
        try:
            if isinstance(out, _Tensor):
                outputs = (out,)
            elif plan.collective is not None:
                outputs = collective_outputs(plan.collective, args, kwargs, out)  # with its Work
            elif type(out) is tuple or type(out) is list:
                outputs = tuple([item for item in out if isinstance(item, _Tensor)])
            elif plan.mutated_args:
                outputs = _mutated_tensors(plan.mutated_args, args, kwargs)
            else:
                outputs = ()
            metas = _metas(outputs, log, types)
            entry = op_entry(head, start, end, inputs, metas)
            if record is None:
                self._entries.append(entry)
            else:
                self._ran(record, entry, outputs)
            if outputs:
                for observe in plan.observers:
                    observe(entry, inputs, outputs, metas)
            for observe in plan.input_observers:  # in-place writes and detach only note what they read
                observe(head[E_INDEX], tensors)
        except Exception as error:
            self.internal_error(error)
            return out
        if head[E_INDEX] >= self._check_at:
            self.check_point()
        return out

    def _plan(self, func) -> _OpPlan | None:
        """The first call of ``func``: its plan, kept; ``None`` when making it failed (the op
        runs unwatched; the watch is inert)."""
        try:
            # The plan holds its op (through the log's table), so the id stays its.
            plan = self._plans[id(func)] = _OpPlan(func, self._log.func_id(func), self._checks)
            if plan.collective is not None and self._distributed is not None:
                self._collective_seen()
            return plan
        except Exception as error:
            self.internal_error(error)
            return None

    def _unwatched(self, plan, func, args, kwargs):
        """Run an op the watch does not record (a profiler marker, or any op once making its
        plan failed); the function mode learns where profiler regions start and end."""
        if plan is not None and plan.region is not None and self.on_region is not None:
            self.on_region(plan.region, args)
        return func(*args, **kwargs)

    def _found(self, finding, head, inputs):
        """A check found ``finding`` on the op about to run: log it (unfinished) and hand the
        finding to the exit. Returns its record; strict: raises before the kernel runs."""
        record = None
        try:
            record = self._log.add(op_entry(head, perf_counter_ns(), -1, inputs))
            error = self.findings.found(finding, record)
        except Exception as internal:
            self.internal_error(internal)
            return record
        if error is not None:
            raise error
        return record

    def _ran(self, record, entry, outputs) -> None:
        """The op of a finding has run: its complete entry replaces the unfinished one, and
        the exit learns its outputs (``None``: its kernel raised)."""
        if entry is not None:
            self._log.complete(record, entry)
        self.findings.ran(record, outputs)
        self._detour = self._inert or self.findings.waiting

    def _failed(self, head, start, inputs, record, error) -> None:
        """The kernel raised ``error``: the op is logged as it was when its kernel started."""
        try:
            if record is None:
                self._entries.append(op_entry(head, start, -1, inputs))
            else:
                self._ran(record, None, None)  # no result to wait on; the kernel's error goes on
        except Exception as internal:
            self.internal_error(internal)
        self.failure = (head[E_INDEX], id(error))

    def _collective_seen(self) -> None:
        """The first call of a collective op: the process group exists now (a script may create
        it inside the watch), so the rank is known and the reducer's ops can be named."""
        self._distributed.refresh()
        if self._distributed.rank is not None:
            self._reducer_sites = self._distributed.sites

    def _head(self, plan, others) -> tuple:
        """The start of the op's log entry: index, op, source site, module, phase, forward op,
        other arguments. Also tells the check context the op's site and phase."""
        modules = self._modules
        # Frames 0-1: this method, __torch_dispatch__ (then, on older torch, Dynamo's wrappers
        # around it, which the walk passes as torch's own frames). On a device's autograd thread
        # (CUDA backward) __torch_dispatch__ is called from C++ with no Python frame above it:
        # f_back is None there, where sys._getframe(2) would raise.
        code, lasti, reached_engine = user_frame(sys._getframe(1).f_back, modules.call_frame, modules.call_answer)
        module = modules.current
        forward_func = -1
        node = current_autograd_node()
        if node is not None and (reached_engine or code is None):
            # Run by the autograd engine: point at the forward op that made this node. A
            # module running now is a checkpoint recomputing its forward: keep its path.
            phase = BACKWARD
            site, forward_module, forward_func = self.forward_sites.get(autograd_sequence_nr(node), _NO_SITE)
            module = module or forward_module
            if not site and self._reducer_sites is not None:
                # No forward line: a parameter's gradient hook (the DDP reducer's copy into its
                # bucket, the bucket's all-reduce) or gradient accumulation. Named, not "autograd".
                site = self._reducer_sites.site(node, plan.collective is not None)
        elif reached_engine:
            # The engine's final callbacks (the DDP reducer copying the reduced buckets into
            # .grad): backward, with no node and no forward line.
            phase = BACKWARD
            site = 0 if self._reducer_sites is None else self._reducer_sites.site(None, plan.collective is not None)
        else:
            # Forward, or backward code of the user's own (a hook, a custom Function).
            phase = FORWARD if node is None else BACKWARD
            site = self._log.site_ids.get((id(code), lasti))
            if site is None:
                site = self._log.site_id(code, lasti)
        seq = get_sequence_nr()
        if seq != self._last_seq:
            # This op created an autograd node (in forward, in a checkpoint's recomputation, or
            # in a backward pass with create_graph): remember where, for its backward ops.
            self._last_seq = seq
            sites = self.forward_sites
            known = (site, module, plan.func_id if forward_func < 0 else forward_func)
            # Interned: each step makes the same few, and kept tuples cost garbage collections.
            sites[seq - 1] = self._site_tuples.setdefault(known, known)
            if len(sites) > self._table_limit:
                _drop_oldest_half(sites)
                self._site_tuples.clear()
        context = self._context
        context.site = site
        context.phase = phase
        context.args = others
        log = self._log  # it numbers the op (inline: see OpLog.next_index)
        index = log.next_index
        log.next_index = index + 1
        return (index, plan.func_id, site, module, phase, forward_func, tuple(others))

    # -- findings waiting for an op that uses their result ---------------------------------

    def _before(self, func, args, kwargs) -> None:
        """The detour of every op while findings wait: the exit reports (strict: raises) those
        whose result this op consumes, before its kernel."""
        try:
            error = self.findings.before(func, args, kwargs)
            self._detour = self._inert or self.findings.waiting
        except Exception as internal:
            self.internal_error(internal)
            return
        if error is not None:
            raise error

    def check_point(self, *, may_raise: bool = True, reading=(), final: bool = False) -> None:
        """Resolve queued nan/inf flags (one host read) and report what is judged now. In
        strict mode, raises for the first origin that matters (unless ``may_raise`` is false:
        another exception is already on its way). ``reading``: idents of the tensors a host read
        is about to read; ``final``: the program chose this point (see ``ActiveChecks.resolve``)."""
        if self.inert:
            return
        window_start = self._window_start
        next_index = self._log.next_index
        self._window_start = next_index
        self._check_at = next_index + self._check_every - 1
        try:
            error = self.findings.check_point(self._log, window_start, reading=reading, final=final, may_raise=may_raise)
            self._detour = self._inert or self.findings.waiting
        except Exception as internal:
            self.internal_error(internal)
            return
        if error is not None:
            raise error

    @property
    def log(self) -> OpLog:
        """The watch's log, which numbers every op (the modes beside this one log into it too)."""
        return self._log

    def internal_error(self, error: Exception) -> None:
        """An error of opwatch's own (here or in a mode beside this one, whose ops share the
        switch): the watch goes inert with one warning."""
        self.inert = True
        try:
            self._on_internal_error(error, traceback.format_exc())
        except Exception:
            pass  # telling about it failed too (warnings turned into errors): stay silent


def keep_dynamo_out() -> None:
    """Make TorchDynamo run ``__torch_dispatch__`` and everything it calls uncompiled, as
    ``torch._dynamo.disable`` would: a compiled function running under a watch must not try to
    compile opwatch. Called on every watch entry, since ``torch._dynamo.reset()`` may clear it."""
    skip_dynamo_for_code(OpInterceptor.__torch_dispatch__.__code__)


def _reads_to_host(plan, inputs, kwargs) -> bool:
    """Whether a host-read op really moves values from a device to the host. For copies: a
    non-CPU source (the last tensor argument) copied to a CPU destination."""
    if not plan.is_copy:
        return True
    source = inputs[-1][M_DEVICE]
    if source.type in ("cpu", "meta"):
        return False
    if len(inputs) > 1:  # copy_(destination, source)
        return inputs[0][M_DEVICE].type == "cpu"
    destination = kwargs.get("device")
    return destination is not None and torch.device(destination).type == "cpu"


def _split(key, value, tensors, others, intern) -> None:
    """Sort one non-tensor argument: tensor lists join ``tensors``; the rest goes to the flat
    ``others`` as key and value (lists interned, unknown types summarised by their name)."""
    kind = type(value)
    if kind is list or kind is tuple:
        # Schemas never mix: a list is all tensors (optional ones may be None) or all numbers.
        if value and (isinstance(value[0], _Tensor) or value[0] is None):
            tensors.extend(item for item in value if isinstance(item, _Tensor))
            return
        if value and type(value[0]) is list:  # Tensor[][] (c10d's allgather_ outputs): flattened
            for inner in value:
                tensors.extend(item for item in inner if isinstance(item, _Tensor))
            return
        value = intern(tuple(value))  # sizes and dims: numbers (unhashable ones stay as they are)
    elif kind not in _PLAIN_VALUES:
        # A c10d op's ProcessGroup is stored by its group name (``ProcessGroup(0)``).
        value = describe_script_object(value) if kind is _ScriptObject else kind.__name__
    others.append(key)
    others.append(value)


def _mutated_tensors(mutated_args, args, kwargs) -> tuple:
    tensors = []
    for position, name in mutated_args:
        value = args[position] if position < len(args) else kwargs.get(name)
        if isinstance(value, _Tensor):
            tensors.append(value)
        elif type(value) is list or type(value) is tuple:
            tensors.extend(item for item in value if isinstance(item, _Tensor))
    return tuple(tensors)


def _drop_oldest_half(table: dict) -> None:
    for key in list(islice(table, len(table) // 2)):
        del table[key]
