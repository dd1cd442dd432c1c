"""Benchmark contenders and the op-counting mode.

A contender is a named factory of *fresh* context managers: the harness builds
a new one for every timed block (outside the timer), enters it, runs N steps,
and exits it.  Fresh instances matter because some tools (DebugMode) append
to an unbounded log, which would make later repetitions slower and bigger.

``OpCounter`` is the instrument for the "what did opwatch add" report: a
TorchDispatchMode entered *outside* the tool under test sees every op the tool
forwards and every op the tool issues itself (its checks), so comparing its
counts against the same counter around eager gives the tool's extra ops and
host syncs.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

try:  # the floor keeps Dynamo out as opwatch does; without opwatch, with torch's wrapper
    from opwatch.core.compat import SKIPS_DYNAMO_PER_CODE, skip_dynamo_for_code
except Exception:  # opwatch missing or broken: load_opwatch() says so in the report
    SKIPS_DYNAMO_PER_CODE, skip_dynamo_for_code = False, None

# Ops that read a tensor value back to the host.  Under a Python dispatch
# mode only ``_local_scalar_dense`` normally shows up (``item`` and
# ``is_nonzero`` are composites that decompose into it before reaching the
# mode), but count all three in case a tool dispatches them directly.
_HOST_READS = {
    torch.ops.aten._local_scalar_dense,
    torch.ops.aten.is_nonzero,
    torch.ops.aten.item,
}


class Passthrough(TorchDispatchMode):
    """The floor: the cheapest possible Python dispatch mode.

    Any tool built on TorchDispatchMode pays at least this much per op, so
    "x floor" is the honest measure of what a tool adds on top.  Like opwatch,
    it keeps Dynamo out by marking its code object rather than through the
    ``torch._dynamo.disable`` wrapper torch puts around a mode's
    ``__torch_dispatch__`` by default: that wrapper is a Python call per op
    (4-8% of this floor on the small workloads), and a floor that paid it
    would flatter every ratio over it.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return not SKIPS_DYNAMO_PER_CODE

    def __init__(self) -> None:
        super().__init__()
        if SKIPS_DYNAMO_PER_CODE:
            skip_dynamo_for_code(Passthrough.__torch_dispatch__.__code__)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class OpCounter(TorchDispatchMode):
    """Count dispatched ops, host reads among them, and ops by name."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.host_reads = 0
        self.by_op: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.total += 1
        self.by_op[str(func)] += 1
        if func.overloadpacket in _HOST_READS:
            self.host_reads += 1
        return func(*args, **(kwargs or {}))


@dataclass(frozen=True)
class Contender:
    """A named way of running the steps.

    ``make`` returns a fresh context manager; ``per_step`` (optional) is called
    with the context's ``__enter__`` value after every step, for tools whose
    documented usage includes a per-step call.
    """

    name: str
    make: Callable[[], ContextManager[Any]]
    per_step: Callable[[Any], None] | None = None
    is_opwatch: bool = False


# --------------------------------------------------------------------------- opwatch


def load_opwatch() -> tuple[Any | None, str]:
    """Import opwatch if it exists and looks usable; return (module, status)."""
    try:
        opwatch = importlib.import_module("opwatch")
    except Exception as exc:  # ImportError, or a half-written package
        return None, f"opwatch not importable ({type(exc).__name__}: {exc})"
    missing = [name for name in ("watch", "strict") if not hasattr(opwatch, name)]
    if missing:
        return None, f"opwatch has no {', '.join(missing)}"
    version = getattr(opwatch, "__version__", "unknown version")
    where = getattr(opwatch, "__file__", None) or "?"
    return opwatch, f"opwatch {version} from {where} (sources {_source_digest(where)})"


def _source_digest(init_file: str) -> str:
    """Short hash of the package's .py files, to tell which code a report measured."""
    root = os.path.dirname(init_file)
    digest = hashlib.sha1()
    for folder, _, files in sorted(os.walk(root)):
        for name in sorted(files):
            if name.endswith(".py"):
                with open(os.path.join(folder, name), "rb") as f:
                    digest.update(name.encode() + f.read())
    return f"sha1 {digest.hexdigest()[:10]}"


def probe_checks(opwatch: Any) -> str | None:
    """Return None if ``watch(checks=...)`` works, else why it does not.

    The probe enters a watch with every check but 'nonfinite', then one with
    all four, and runs one op in each; an error (typically TypeError or
    ValueError) means the option is missing or spelled differently, which the
    report states instead of guessing.
    """
    try:
        all_checks = opwatch.checks.CHECK_NAMES
        with opwatch.watch(checks=[c for c in all_checks if c != "nonfinite"]):
            torch.ones(2) + 1
        with opwatch.watch(checks=all_checks):
            torch.ones(2) + 1
    except Exception as exc:  # TypeError/ValueError: the option is not there as assumed
        return f"{type(exc).__name__}: {exc}"
    return None


def checks_contenders(opwatch: Any) -> list[Contender]:
    """watch() with and without the nan/inf check, to price that check alone."""
    without = tuple(c for c in opwatch.checks.CHECK_NAMES if c != "nonfinite")
    # opwatch.watch() itself (all checks, the default) is the "with" side.
    return [
        Contender("watch(no nonfinite)", lambda: opwatch.watch(checks=without), is_opwatch=True),
        Contender("watch(no checks)", lambda: opwatch.watch(checks=()), is_opwatch=True),
    ]


# --------------------------------------------------------------------------- opwatch.guard


def guard_split(opwatch: Any, step: Callable[[], None]) -> tuple[Callable[[], None], list[Contender]]:
    """The workload's step, its forward and backward callable through ``opwatch.guard``, and
    the two contenders to time on it: eager, and the guard.

    ``opwatch.guard`` wraps forward and backward only (``optimizer.step()`` comes after the
    guarded call), so the step that ``workloads._training_step`` builds is taken apart: its
    optimizer and loss closure, and the model the loss closure calls. Both contenders run the
    same step; the guard's context routes forward and backward through the guarded call.
    """
    opt, loss_fn = _free_variable(step, "opt"), _free_variable(step, "loss_fn")
    model = _free_variable(loss_fn, "model")

    def forward_backward() -> torch.Tensor:
        loss = loss_fn()
        loss.backward()
        return loss

    guarded = opwatch.guard(forward_backward, model)
    current = [forward_backward]

    def split_step() -> None:
        opt.zero_grad(set_to_none=True)
        current[0]()
        opt.step()

    @contextlib.contextmanager
    def guarding():
        current[0] = guarded
        try:
            yield guarded
        finally:
            current[0] = forward_backward

    return split_step, [Contender("eager", contextlib.nullcontext),
                        Contender("opwatch.guard()", guarding, is_opwatch=True)]


AUDITED_STEPS = 200  # steps of one block of the audited guard: one fresh guard, one audit


def guard_audit_split(opwatch: Any, step: Callable[[], None]) -> tuple[Callable[[], None], list[Contender]]:
    """Like :func:`guard_split`, with a guard made fresh in each block (``audit="new"``, the
    default): its first call runs under a full watch, so a block of :data:`AUDITED_STEPS`
    steps bills one audit, the way a 200-step run does; a fresh ``audit="never"`` guard beside
    it isolates the audit's share. Time them with
    ``measure(step, contenders, rounds, target_seconds=1e9, max_steps=AUDITED_STEPS)`` so that
    every block is exactly that many steps."""
    split_step, (eager, _) = guard_split(opwatch, step)
    current = _free_variable(split_step, "current")
    forward_backward = current[0]
    model = _free_variable(_free_variable(step, "loss_fn"), "model")

    def fresh(audit: str) -> Callable[[], ContextManager]:
        @contextlib.contextmanager
        def guarding():
            current[0] = guarded = opwatch.guard(forward_backward, model, audit=audit)
            try:
                yield guarded
            finally:
                current[0] = forward_backward

        return guarding

    return split_step, [eager,
                        Contender(f"opwatch.guard(audit='new') x{AUDITED_STEPS}", fresh("new"), is_opwatch=True),
                        Contender(f"opwatch.guard(audit='never') x{AUDITED_STEPS}", fresh("never"), is_opwatch=True)]


def _free_variable(function: Callable, name: str) -> Any:
    """The value of ``name`` in ``function``'s closure (how the workload's step is taken apart)."""
    names = function.__code__.co_freevars
    if name not in names:
        raise LookupError(f"{function.__qualname__} has no free variable {name!r} (it has {names}): "
                          "bench.workloads changed; update guard_split")
    return function.__closure__[names.index(name)].cell_contents


# --------------------------------------------------------------------------- all


def _debug_mode_full():
    from torch.utils._debug_mode import DebugMode

    return DebugMode(record_stack_trace=True, record_nn_module=True)


def _debug_mode():
    from torch.utils._debug_mode import DebugMode

    return DebugMode()


def main_contenders(opwatch: Any | None) -> list[Contender]:
    """The contenders of the main table, eager and floor first."""
    contenders = [
        Contender("eager", contextlib.nullcontext),
        Contender("passthrough", Passthrough),
    ]
    if opwatch is not None:
        contenders += [
            Contender("opwatch.watch()", opwatch.watch, is_opwatch=True),
            Contender("opwatch.strict()", opwatch.strict, is_opwatch=True),
            # The documented pattern for loops that never read a value on the host:
            # one batched nan/inf check point per step.
            Contender("watch()+w.step()", opwatch.watch, per_step=lambda w: w.step(),
                      is_opwatch=True),
        ]
    contenders += [
        Contender("DebugMode()", _debug_mode),
        Contender("DebugMode(stack,module)", _debug_mode_full),
        # What users compare opwatch with: autograd's anomaly mode, nan checks on (its default).
        Contender("detect_anomaly(check_nan=True)", lambda: torch.autograd.detect_anomaly(check_nan=True)),
    ]
    return contenders


# --------------------------------------------------------------------------- counting


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2: the profiler's C++ side logs start/stop lines
    there that no environment variable turns off."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class BypassReads:
    """Count ``Tensor.tolist()`` / ``Tensor.numpy()`` calls while active.

    These read tensor values on the host without dispatching any ATen op on
    CPU (on an accelerator they would show up as a copy to CPU), so neither a
    dispatch mode nor the profiler sees them.  Batched checks typically read
    their results this way, so they are counted by patching the two methods.
    """

    _METHODS = ("tolist", "numpy")

    def __init__(self) -> None:
        self.count = 0
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> "BypassReads":
        for name in self._METHODS:
            self._saved[name] = torch.Tensor.__dict__.get(name)  # None: inherited from C
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, _original=original, **kwargs):
                self.count += 1
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for name, saved in self._saved.items():
            if saved is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, saved)


@dataclass(frozen=True)
class OpCount:
    """What the counters around one contender saw.

    Per step, while the steps ran: ``ops`` (and ``by_op``, by op name),
    ``host_reads`` (dispatched
    ``_local_scalar_dense``-style reads) and ``bypass_reads``
    (``tolist``/``numpy``).  Once, in the contender's ``__exit__`` (e.g. a
    final check point): ``exit_ops``, ``exit_reads``, ``exit_bypass_reads``.
    For the hidden-read cross-check, over a short block of ``profile_steps``
    steps including the exit: ``total_reads`` (counter) and
    ``profiler_reads`` (profiler), and ``profiler_by_op``: ops called from
    Python per step by name, as the profiler saw them, which shows the ops a tool
    runs with Python dispatch disabled (opwatch's reductions) that no counting
    mode sees.
    """

    steps: int
    ops: float
    by_op: dict[str, float]
    host_reads: float
    bypass_reads: float
    exit_ops: int
    exit_reads: int
    exit_bypass_reads: int
    total_reads: int
    profiler_reads: int
    profiler_by_op: dict[str, float]


def _run_steps(step: Callable[[], None], contender: Contender, handle: Any, steps: int) -> None:
    for _ in range(steps):
        step()
        if contender.per_step is not None:
            contender.per_step(handle)


def _count(step: Callable[[], None], contender: Contender, steps: int):
    """One block under OpCounter + BypassReads; returns them and the in-steps counts."""
    counter = OpCounter()
    with BypassReads() as bypass, counter:
        with contender.make() as handle:
            _run_steps(step, contender, handle, steps)
            during = (counter.total, counter.host_reads, bypass.count, Counter(counter.by_op))
    return counter, bypass, during


def _called_not_nested(event) -> bool:
    """A profiler event of an op called from Python: at top level, or directly under a Python
    dispatch mode's scope (an op it forwards, or one it runs itself), not one that another
    op's kernel runs inside it (aminmax's own fill_)."""
    return event.cpu_parent is None or event.cpu_parent.name == "PythonDispatchMode"


def count_ops(step: Callable[[], None], contender: Contender, steps: int,
              profile_steps: int) -> OpCount:
    """Count what ``contender`` adds over ``steps`` steps in one context.

    The OpCounter is entered first, so it sits *below* the contender on the
    mode stack and sees what the contender forwards plus whatever it issues
    itself, including any work done in ``__exit__``.

    As a cross-check that does not rely on the tool letting its own ops reach
    other modes, host reads are also counted with the autograd profiler, which
    records at the dispatcher and so sees ops run with Python dispatch
    disabled.  A Python mode makes the profiler record each forwarded op twice
    (once on entry, once on redispatch), so profiler counts are only
    comparable between Python-mode contenders (e.g. against the passthrough).
    The profiler's Python-side event list is slow to build, hence the shorter
    ``profile_steps`` block, which every contender must share.
    """
    counter, bypass, (ops, reads, bypassed, by_op) = _count(step, contender, steps)
    short = counter if profile_steps == steps else _count(step, contender, profile_steps)[0]
    with _quiet_stderr(), torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with contender.make() as handle:
            _run_steps(step, contender, handle, profile_steps)
    events = prof.events()
    return OpCount(
        steps=steps, ops=ops / steps, by_op={k: v / steps for k, v in by_op.items()},
        host_reads=reads / steps, bypass_reads=bypassed / steps,
        exit_ops=counter.total - ops, exit_reads=counter.host_reads - reads,
        exit_bypass_reads=bypass.count - bypassed,
        total_reads=short.host_reads,
        profiler_reads=sum(1 for e in events if e.name == "aten::_local_scalar_dense"),
        profiler_by_op={k: v / profile_steps for k, v in Counter(e.name for e in events if _called_not_nested(e)).items()},
    )
