"""The public entry points: ``watch()``, ``strict()`` and the ``Watch`` they return, which
enters and leaves the private modes. Beside it: :mod:`.options` (the options checked, the
``OPWATCH_DISABLE`` switch), :mod:`.optimizer_steps` (optimizer steps as check points) and
:mod:`.failure` (the note and the dump after a failing block)."""

from __future__ import annotations

# pytest leaves this module's frames out of a failing test's traceback (it reads
# __tracebackhide__ in each frame's globals): opwatch's frames are not the user's story.
__tracebackhide__ = True

import os
import traceback
from collections.abc import Iterable

from .. import checks as _checks
from ..findings.allow import Allow
from ..findings.anomaly import Anomaly, AnomalyError, OpwatchWarning
from ..modes.functions import FunctionWatch
from ..modes import compiled as _compiled
from ..modes import compiled_graphs as _graphs
from ..modes.interceptor import OpInterceptor, keep_dynamo_out
from ..modes.module_calls import ModuleCalls
from ..modes.modules import ModuleStack
from ..modes.ranks import DistributedWatch
from ..modes.torch_warnings import torch_warnings
from ..findings.ranks import DEFAULT_TIMEOUT, AllAnomalies, all_anomalies, publish
from ..core.records import OpLog, OpRecord
from ..core.sites import warn_at_user
from ..render import render_summary, render_table
from ..render.summary import render_disabled
from ..render.notices import compiled_ran_eagerly, internal_error
from ..findings.report import Reporter
from .failure import tell_failure
from .optimizer_steps import steps_checked as _steps_checked
from .options import DISABLE_VARIABLE, allow_entries, check_names, checks_off, flag, non_negative_int, positive_int, text_stream
from .options import disabled_by_environment as _disabled_by_environment  # the runners' name for it

__all__ = ["watch", "strict", "Watch", "DISABLE_VARIABLE", "checks_off"]


def watch(
    *,
    max_records: int = 10_000,
    checks: Iterable[str] | None = None,
    allow: Iterable[Allow] = (),
    dump_on_error: bool = True,
    last: int = 20,
    file=None,
    warn: bool = True,
    fingerprints: bool = False,
    compiled=None,
) -> Watch:
    """Watch every PyTorch op run inside a ``with`` block; collect anomalies and warn.

    Example::

        with opwatch.watch() as w:
            loss = model(x).sum()
            loss.backward()
        print(w.table(last=20))
        for anomaly in w.anomalies:
            print(anomaly)

    Every ATen op, forward and backward, is recorded with its tensors' shapes, dtypes and
    devices, the user's source line, the ``nn.Module`` path and the phase; backward ops point
    at the forward line that created them. The checks run on each op; each anomaly is kept in
    ``w.anomalies`` and warned once per (kind, file, line) as an :class:`OpwatchWarning`.

    Options (keyword-only):

    max_records
        Size of the op log, a ring buffer: ``w.records`` holds the last ``max_records`` ops and
        memory stays flat however long the loop. Also the longest stretch of ops between two
        nan/inf check points: at most one forced host read per ``max_records`` ops.
        ``watch(max_records=100)``.
    checks
        Which checks run: any of ``"device_mismatch"``, ``"dtype_mismatch"``, ``"broadcast"``,
        ``"nonfinite"`` (nan/inf origins), ``"collective_mismatch"`` (shapes and dtypes of each
        ``torch.distributed`` collective compared across ranks before it runs, through the
        process group's store: off by default, turn it on on every rank), ``"pre_dispatch"``
        (torch functions that reject a device or dtype before dispatching, such as the window of
        ``torch.stft``, judged from their arguments by a function mode every torch call goes
        through). ``None`` (default) runs all but ``"collective_mismatch"``; ``()`` only records.
        ``watch(checks=["broadcast", "nonfinite"])``.
    allow
        Anomalies you know about and accept, as :class:`Allow` entries (each field a glob
        pattern: ``kind``, ``op``, ``module``, ``where``). A matching finding goes to
        ``w.allowed``: no anomaly, no warning, no raise in ``strict()``.
        ``watch(allow=[opwatch.Allow(kind="broadcast", where="train.py:42")])``.
    dump_on_error
        When an exception escapes the block, print the last ``last`` ops as a compact table
        (consecutive alike ops folded into one row with their count, the failing op marked and
        its neighbours kept, fitted to the terminal's width, or 120 columns into a file or a
        pipe), and add a note to the exception naming the op, its line and its tensors. The
        exception itself propagates unchanged. ``watch(dump_on_error=False)``.
    last
        How many ops that dump shows. ``watch(last=50)``.
    file
        Where the dump goes (a text stream); ``sys.stderr`` when ``None``.
        ``watch(file=open("opwatch.log", "w"))``.
    warn
        Warn each anomaly once per (kind, file, line); with ``False`` anomalies are only
        collected. ``watch(warn=False)``.
    fingerprints
        Record a fingerprint of every floating, integer and bool op output (an exact hash and
        sum, L2 norm, min, max), computed on the device and read with the check points' reads,
        for comparing two runs with :func:`opwatch.diff`; kept per op with the log, saved by
        :meth:`Watch.export_jsonl`. Off by default (it costs a few small kernels per op).
        ``watch(fingerprints=True)``.
    compiled
        ``None`` (default): ``torch.compile``d code runs eagerly, op by op, where the checks see
        it. A backend (``"inductor"``, ``"aot_eager"``, or a backend made with
        ``torch._dynamo.backends.common.aot_autograd(...)``): every compiled function in the block
        runs compiled with that backend, and the watch logs what its graphs make: every node under
        the AOT backends, each graph's outputs under inductor, at the user's line (with
        ``fingerprints=True``, for :func:`opwatch.diff` against an eager run; the checks do not
        see inside the graphs). ``watch(fingerprints=True, compiled="inductor")``.

    Setting the environment variable ``OPWATCH_DISABLE=1`` turns every watch into a no-op.
    """
    return Watch(strict=False, max_records=max_records, checks=checks, allow=allow, dump_on_error=dump_on_error, last=last, file=file, warn=warn, fingerprints=fingerprints, compiled=compiled)


def strict(
    *,
    max_records: int = 10_000,
    checks: Iterable[str] | None = None,
    allow: Iterable[Allow] = (),
    dump_on_error: bool = True,
    last: int = 20,
    file=None,
    warn: bool = True,
    fingerprints: bool = False,
) -> Watch:
    """Like :func:`watch`, but raise :class:`AnomalyError` at the first anomaly.

    Device, dtype and broadcast anomalies raise *before the kernel runs*. nan/inf anomalies
    raise at the first check point after the op that produced them (the end of the block,
    ``w.check()``/``w.step()``, or a value read on the host such as ``loss.item()``), naming
    that op. Contained nan/inf (absorbed before they mattered) never raise. Options are those
    of :func:`watch`::

        with opwatch.strict():
            train_step(model, batch)
    """
    return Watch(strict=True, max_records=max_records, checks=checks, allow=allow, dump_on_error=dump_on_error, last=last, file=file, warn=warn, fingerprints=fingerprints)


class Watch:
    """The result of :func:`watch` / :func:`strict`: a context manager and the op log.

    Attributes:
        records: the op log, oldest first, at most ``max_records`` :class:`OpRecord` s.
        anomalies: the :class:`Anomaly` s found (at most ``max_records``, oldest dropped).
        contained: nan/inf origins that were absorbed before they mattered; not anomalies.
        allowed: findings that matched an ``allow`` entry; not anomalies.
        counts: anomalies reported per kind over the watch's life, and contained origins.
        rank: this process's rank in a ``torch.distributed`` job, else ``None``; every rank's
            anomalies: :meth:`all_anomalies`.
        strict: whether anomalies raise.
        enabled: ``False`` when ``OPWATCH_DISABLE`` turned this watch into a no-op.
    """

    def __init__(self, *, strict, max_records, checks, dump_on_error, last, file, warn, allow=(), check_every=None, fingerprints=False, compiled=None):
        self.strict = strict
        self._max_records = positive_int("max_records", max_records)
        self._allow = allow_entries(allow)
        # Ops between two forced nan/inf check points; 1 checks each op as it goes (a replay,
        # where a host read per op is fine). Default: max_records.
        self._check_every = None if check_every is None else positive_int("check_every", check_every)
        self._checks = check_names(checks)
        self._dump_on_error = flag("dump_on_error", dump_on_error)
        self._last = non_negative_int("last", last)
        self._file = text_stream("file", file)
        self._warn = flag("warn", warn)
        # op index -> output fingerprints (opwatch.checks.fingerprints), or None when off
        self._fingerprints = {} if flag("fingerprints", fingerprints) else None
        # What each block's nan/inf tracker hands to the next's: which tensors an op of the
        # watch made (a batch made between two blocks may take a freed tensor's id in the log).
        self._earlier_blocks = _checks.nonfinite.EarlierBlocks()
        # watch(compiled=BACKEND): compiled code runs compiled, its graphs logged (modes.compiled_graphs)
        self._graphs_backend = None if compiled is None else _graphs.check_backend(compiled)
        self._graphs = None
        self.enabled = not _disabled_by_environment()
        self._log = OpLog(self._max_records)
        self._reporter = Reporter(log=self._log, strict=strict, warn=self._warn, limit=self._max_records, allow=self._allow)
        self._interceptor: OpInterceptor | None = None
        self._modules: ModuleStack | None = None
        self._functions: FunctionWatch | None = None  # the pre-dispatch checks' function mode
        self._told_internal_error = False
        self._compiled_calls: dict = {}  # compiled callable -> its calls run eagerly in the block
        self._told_compiled = False
        # The job's view from this process (opwatch.modes.ranks), where torch.distributed exists.
        self._distributed: DistributedWatch | None = None

    # -- reading ----------------------------------------------------------------------------

    @property
    def records(self) -> list[OpRecord]:
        return self._log.records()

    def _next_op_index(self) -> int:
        """The index this watch gives the next op it logs (``OpLog.next_index``): a mode
        entered inside the watch numbers its ops with it (opwatch.guard's input capture)."""
        return self._log.next_index

    @property
    def anomalies(self) -> list[Anomaly]:
        return list(self._reporter.anomalies)

    @property
    def contained(self) -> list[Anomaly]:
        return list(self._reporter.contained)

    @property
    def fingerprints(self) -> dict | None:
        """With ``watch(fingerprints=True)``: op index -> one ``(hash, sum, norm, min, max)``
        per output (``None`` for outputs not fingerprinted), for the ops in :attr:`records` up
        to the last check point; ``None`` when fingerprints are off."""
        return None if self._fingerprints is None else {index: tuple(prints) for index, prints in self._fingerprints.items()}

    @property
    def rank(self) -> int | None:
        """This process's rank in a ``torch.distributed`` job (read when the block starts, at its
        first collective and when it ends), else ``None``."""
        return self._log.rank

    @property
    def allowed(self) -> list[Anomaly]:
        return list(self._reporter.allowed)

    @property
    def counts(self) -> dict[str, int]:
        """How many anomalies of each kind this watch reported over its life (every block it
        was entered for, those dropped past ``max_records`` included): one entry per kind of
        :data:`opwatch.KINDS` (0 for none), and ``"contained"``, the nan/inf origins that were
        absorbed. ``w.counts["broadcast"]``; the metrics logged to TensorBoard are made from
        these (:func:`opwatch.runners.trainers.metrics`)."""
        kinds = self._reporter.kinds
        return {**{kind: kinds[kind] for kind in _checks.KINDS}, "contained": self._reporter.contained_count}

    def table(self, last: int | None = None, *, tablefmt: str = "simple") -> str:
        """The op log as a table (the last ``last`` ops, or all): index, op, inputs, outputs,
        where (``file:line``), the code that issued the op, module, phase and flags."""
        records = self._log.records()
        if last is not None:
            records = records[-non_negative_int("last", last) :] if last else []
        return render_table(records, tablefmt=tablefmt)

    def summary(self, *, raised: AnomalyError | None = None) -> str:
        """Each distinct anomaly once (per kind and line, with its count), ready to print; for a
        watch that ``OPWATCH_DISABLE`` turned off, a line saying that nothing was watched.
        ``raised``: the ``AnomalyError`` the reader has already seen (a strict watch's, in a
        traceback); its anomaly is named in one line rather than repeated:
        ``w.summary(raised=error)``."""
        if raised is not None and not isinstance(raised, AnomalyError):
            raise TypeError(f"raised must be an opwatch.AnomalyError or None, got {type(raised).__name__}")
        if not self.enabled:
            return render_disabled(DISABLE_VARIABLE, os.environ.get(DISABLE_VARIABLE, "").strip())
        ran = tuple(name for name in _checks.CHECK_NAMES if name in self._checks)
        return render_summary(
            self._reporter.anomalies, self._reporter.contained, self._reporter.allowed, rank=self._log.rank,
            raised=None if raised is None else raised.anomaly, ran=ran, off=checks_off(self._checks),
        )

    def all_anomalies(self, *, timeout: float = DEFAULT_TIMEOUT) -> AllAnomalies:
        """Every rank's anomalies in a ``torch.distributed`` job, once the block has ended: this
        rank's :class:`Anomaly` objects and each other rank's (each distinct one once, with
        ``.rank``, ``.count`` and its message), in rank order. Each rank publishes its own when
        its block ends, through the process group's store (or ``$OPWATCH_EXCHANGE_DIR``);
        this waits at most ``timeout`` seconds for the others, and names those that had not
        reported by then in ``.missing``. ``.summary()`` is the combined summary: the rank, op
        and line that made the first nan/inf, and where the others received it. No collective
        runs on your process groups. Outside a distributed job: this watch's anomalies. ::

            with opwatch.watch() as w:
                train_step(ddp_model, batch)
            if dist.get_rank() == 0:
                print(w.all_anomalies().summary())
        """
        return all_anomalies(self._distributed, self._reporter.anomalies, timeout=timeout, ended=self._interceptor is None)

    def check(self) -> list[Anomaly]:
        """A nan/inf check point now: at most one host read. Returns the new anomalies (in
        strict mode, raises at the first). Use it (or :meth:`step`) once per training step when
        the loop never reads a value on the host."""
        if self._interceptor is None:
            return []
        reported_before = self._reporter.count
        self._interceptor.check_point(final=True)
        return self._reporter.newest(self._reporter.count - reported_before)

    step = check

    def export_jsonl(self, path) -> None:
        """Write the log to ``path`` as JSON Lines: a header line (format, version, torch
        version, rank), then one object per record and per anomaly. Read it back with
        :func:`opwatch.load`. ``w.export_jsonl("run.jsonl")``."""
        from ..storage.jsonl import write_jsonl

        write_jsonl(self, path)

    def _repr_html_(self) -> str:
        """What a notebook shows: the counts, each place's first anomaly, the last 10 ops."""
        from ..render.html_repr import watch_html

        return watch_html(self)

    def report_html(self, path) -> None:
        """Write the report to ``path``: one self-contained HTML page (nothing fetched, it
        opens offline) with the findings first, the ops around each, the module tree and every
        op. ``w.report_html("report.html")``; for a saved log, ``python -m opwatch report run.jsonl``."""
        from ..render.html import render_report

        with open(path, "w", encoding="utf-8") as stream:
            stream.write(render_report(self))

    def export_chrome_trace(self, path) -> None:
        """Write the log to ``path`` as Chrome trace-event JSON (open it in Perfetto or
        ``chrome://tracing``): one event per op, module spans, arrows from backward ops to
        their forward op, anomalies as instant events. ``w.export_chrome_trace("run.json")``."""
        from ..storage.chrome_trace import write_chrome_trace

        write_chrome_trace(self, path)

    def _failure_told(self) -> None:
        """A guard (leave-on) told a failed optimizer step that ran outside this watch: from the
        next block on, nan/inf found in tensors made before a block are that failure's
        leftovers, named only once they reach the gradients or a parameter
        (``nonfinite.EarlierBlocks.failure_told``)."""
        self._earlier_blocks.failure_told = True

    # -- the context manager ------------------------------------------------------------------

    def __enter__(self) -> Watch:
        if self._interceptor is not None:
            raise RuntimeError("this Watch is already active; create a new one with opwatch.watch() to nest")
        if not self.enabled:
            return self
        try:
            keep_dynamo_out()
            if self._graphs_backend is None:
                _compiled.hold(self._compiled_calls)
            modules = ModuleStack()
            self._distributed = DistributedWatch.start(self._log, modules)
            active = _checks.ActiveChecks(
                self._checks, self._log, table_limit=2 * self._max_records + 4096, owners=modules.owners,
                fingerprints=self._fingerprints, every_op_checked=self._check_every == 1, earlier=self._earlier_blocks,
            )
            interceptor = (OpInterceptor if self._graphs_backend is None else _graphs.GraphsInterceptor)(
                log=self._log,
                checks=active,
                reporter=self._reporter,
                modules=modules,
                max_records=self._max_records,
                on_internal_error=self._internal_error,
                check_every=self._check_every,
                distributed=self._distributed,
            )
            modules.on_call = ModuleCalls(checks=active, modules=modules, interceptor=interceptor)
            # Under compiled=..., no function mode: Dynamo would trace into it.
            functions = self._function_watch(interceptor, modules, active) if self._graphs_backend is None else None
            if self._graphs_backend is not None:
                self._graphs = _graphs.hold(self._graphs_backend, interceptor, prints=active.prints)
            else:  # under compiled=..., no global module hooks either: Dynamo would trace them
                modules.install()
        except Exception as error:
            _compiled.release(self._compiled_calls)
            self._internal_error(error, traceback.format_exc())
            return self  # the block runs unwatched
        try:
            interceptor.__enter__()
        except BaseException:
            modules.uninstall()
            _compiled.release(self._compiled_calls)
            if self._graphs is not None:
                _graphs.release(self._graphs)
                self._graphs = None
            raise
        self._interceptor, self._modules = interceptor, modules
        torch_warnings.enter()  # torch's warnings at the program's line, not the modes'
        # The function mode is entered after the dispatch mode and left before it: it logs into
        # the interceptor's log and index, so it only ever runs while the interceptor does.
        # (The two modes live on separate stacks; torch runs a function mode's handler with the
        # mode taken off, so neither the function itself nor opwatch's own work re-enters it.)
        if functions is not None:
            try:
                functions.__enter__()
            except BaseException:
                self.__exit__(None, None, None)
                raise
            self._functions = functions
        if self._graphs is None:  # under compiled=..., Dynamo would trace the optimizer step's hook
            _steps_checked.hold(self)
        return self

    def _function_watch(self, interceptor: OpInterceptor, modules: ModuleStack, checks) -> FunctionWatch | None:
        """The function mode of the pre-dispatch checks (opwatch.checks.pre_dispatch), when they
        are on (by default, or named in ``checks=``); it judges the device and dtype rules that are asked for too, or both."""
        if _checks.pre_dispatch.NAME not in self._checks:
            return None
        kinds = self._checks & {_checks.device.KIND, _checks.dtype.KIND} or {_checks.device.KIND, _checks.dtype.KIND}
        return FunctionWatch(
            modules=modules,
            interceptor=interceptor,
            checks=checks,
            kinds=frozenset(kinds),
            on_internal_error=self._internal_error,
        )

    def __exit__(self, exc_type, exc, traceback_) -> bool:
        interceptor = self._interceptor
        if interceptor is None:
            return False
        self._interceptor = None
        functions, self._functions = self._functions, None
        _steps_checked.release(self)
        try:
            try:
                if functions is not None:  # entered last, left first
                    functions.__exit__(exc_type, exc, traceback_)
            finally:
                interceptor.__exit__(exc_type, exc, traceback_)
        finally:
            torch_warnings.exit()
            self._modules.uninstall()
            self._modules = None
            _compiled.release(self._compiled_calls)
            graphs, self._graphs = self._graphs, None
            if graphs is not None:
                _graphs.release(graphs)
        # The last check point; it must not hide the block's own exception.
        try:
            interceptor.check_point(may_raise=exc is None, final=True)
        finally:
            self._publish()
        self._tell_compiled()
        if exc is not None and isinstance(exc, Exception):
            try:
                tell_failure(self._log, interceptor.failure, exc, dump=self._dump_on_error, last=self._last, file=self._file)
            except Exception as error:
                self._internal_error(error, traceback.format_exc())
        return False

    @property
    def compiled_eagerly(self) -> list:
        """The ``torch.compile``d functions and modules that ran under this watch, each with
        ``name``, ``kind`` (``"module"`` or ``"function"``), ``where`` (``file:line``) and
        ``calls``: a watch runs compiled code eagerly, op by op, to see its ops (and leaves the
        compiled code to run again after the block); empty when none ran."""
        return _compiled.eager_calls(self._compiled_calls)

    def _tell_compiled(self) -> None:
        """Warn once in the watch's life that compiled code ran uncompiled under it."""
        if self._told_compiled or not self._warn or not self._compiled_calls:
            return
        self._told_compiled = True
        try:
            warn_at_user(OpwatchWarning(compiled_ran_eagerly(self.compiled_eagerly)))
        except OpwatchWarning:
            raise
        except Exception as error:
            self._internal_error(error, traceback.format_exc())

    def _before_optimizer_step(self) -> None:
        """A check point before an optimizer applies the gradients (the optimizer step
        pre-hook): in strict mode a nan/inf about to reach the weights raises here, naming the
        op that made it, and the weights stay as they were."""
        if self._interceptor is not None:
            self._interceptor.check_point(final=True)

    def _phase_begins(self, phase: str) -> None:
        """The ops logged from now on ran in ``phase`` (an optimizer step, gradient clipping)."""
        self._log.open_span(phase)

    def _phase_ends(self) -> None:
        self._log.close_span()

    def _publish(self) -> None:
        """In a distributed job, publish this rank's anomalies for ``all_anomalies()`` (one store
        ``set``); a failure is one warning, never an exception on the program's line."""
        publish(self._distributed, self._reporter.anomalies, len(self._reporter.contained))

    # -- when something goes wrong ------------------------------------------------------------

    def _internal_error(self, error: Exception, formatted_traceback: str) -> None:
        if self._told_internal_error:
            return
        self._told_internal_error = True
        import torch

        warn_at_user(OpwatchWarning(internal_error(error, formatted_traceback, torch.__version__)))
