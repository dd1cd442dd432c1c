"""The lines of the leave-on runner (:mod:`opwatch.runners.leave_on`, ``python -m opwatch --guard`` and
the trainers' guard mode): a failing optimizer step, the re-check of the next step, the summary.

Parameters are ``(name, kind)`` pairs, ``kind`` being ``"nan"`` or ``"inf"``.
"""

from __future__ import annotations

__all__ = ["parameters", "failure", "poisoned", "recheck", "summary", "unjudged_end"]


def parameters(bad: list) -> str:
    """``net.fc1.weight (nan), net.fc1.bias (inf)``: the first eight, then how many more."""
    shown = ", ".join(f"{name} ({kind})" for name, kind in bad[:8])
    return shown + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")


def failure(step: int, bad: list, *, strict_mode: bool, last: bool = False) -> str:
    """The gradients about to be applied at ``step`` hold nan/inf; ``last``: the last failure told
    one by one."""
    head = f"opwatch: optimizer step {step}: the gradients about to be applied hold nan/inf: {parameters(bad)}."
    if strict_mode:
        return head + " The optimizer did not run: the weights are as they were before this step."
    tail = " Later failures are only counted in the summary." if last else ""
    return head + " The optimizer applies them as usual; the next step runs under a full watch to find the op that makes them." + tail


def poisoned(step: int, bad: list) -> str:
    """The optimizer of ``step`` wrote nan/inf into the weights: no later op can be named."""
    return (
        f"opwatch: optimizer step {step} wrote nan/inf into the weights: {parameters(bad)}. Every later step carries them, "
        "so no later op can be named as their origin; run with --strict to stop before the optimizer applies them. "
        "Later failures are only counted in the summary."
    )


def recheck(failed_step: int, step: int, origin, *, failed_again: bool) -> str:
    """What the full watch of ``step`` found of the failure of ``failed_step``: ``origin`` is
    ``(kind, op, where, phase)`` of the first nan/inf origin it found, or ``None``."""
    if origin is not None:
        kind, op, where, phase = origin
        return f"opwatch: the failure of step {failed_step} recurred at step {step}: {kind} first made by {op} at {where} ({phase})."
    if failed_again:
        return (
            f"opwatch: the failure of step {failed_step} recurred at step {step}, but no op of that step made the nan/inf: "
            "they came in with the weights, the batch or the optimizer's state."
        )
    return f"opwatch: the failure of step {failed_step} did not recur: step {step} ran under a full watch and its gradients were finite."


def summary(steps: int, audited: int, failed: int, enabled: bool) -> str:
    """The end-of-run line: steps run, audited and failed (or that the runner was off)."""
    if not enabled:
        return "opwatch guard: off (OPWATCH_DISABLE)."
    return f"opwatch guard: {steps} optimizer step{'s' if steps != 1 else ''} ran, {audited} audited under a full watch, {failed} failed (nan/inf in the gradients)."


def unjudged_end(step: int, rerun: str | None) -> str:
    """The run went on after its last optimizer step (``step``) with no watch on, and no
    gradient check followed: its summary cannot speak for those ops. ``rerun``: the command
    that checks every op."""
    after = f"after optimizer step {step}" if step else "before any optimizer step"
    command = f": {rerun}" if rerun else " (opwatch.watch() or opwatch.strict())"
    return (
        f"opwatch guard: the run ended before opwatch judged its last ops: the model ran forward {after} and no optimizer step "
        f"followed (a script that stops on a nan loss before backward() ends so), so no check saw them; "
        f"a full watch checks every op{command}"
    )
