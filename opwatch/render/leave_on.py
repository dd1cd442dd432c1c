"""The lines of the leave-on runner (:mod:`opwatch.runners.leave_on`, ``python -m opwatch --guard`` and
the trainers' guard mode): a failing optimizer step, the re-check of the next step, the summary.

Parameters are ``(name, kind)`` pairs, ``kind`` being ``"nan"`` or ``"inf"``.
"""

from __future__ import annotations

__all__ = ["parameters", "failure", "poisoned", "recheck", "did_not_recur", "no_origin", "loop_ended", "summary", "unjudged_end"]


def parameters(bad: list) -> str:
    """``net.fc1.weight (nan), net.fc1.bias (inf)``: the first eight, then how many more."""
    shown = ", ".join(f"{name} ({kind})" for name, kind in bad[:8])
    return shown + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")


_ACTIONS = {
    "skip": " The optimizer step did not run (skipped, as GradScaler skips an overflow step): the weights are as they were.",
    "raise": " The optimizer step did not run: the weights are as they were.",
    "apply": " The optimizer applies them (on_failure='apply').",
}


def failure(step: int, bad: list, on_failure: str, *, audited: bool = False, replayed: bool = False, origin=None, last: bool = False) -> str:
    """The gradients about to be applied at ``step`` hold nan/inf, and what ``on_failure`` did;
    ``audited``: the step ran under the full watch (``origin``: ``(kind, op, where, phase)`` of
    the first nan/inf it made, or ``None``); ``replayed``: its batch ran again from its start
    under the full watch; ``last``: the last failure told one by one."""
    head = f"opwatch: optimizer step {step}: the gradients about to be applied hold nan/inf: {parameters(bad)}." + _ACTIONS[on_failure]
    watched = " This step ran under a full watch" if audited else " Its batch ran again from its start (RNG states, buffers and .grad restored) under a full watch"
    if (audited or replayed) and origin is not None:
        kind, op, where, phase = origin
        then = f"{watched}: {kind} first made by {op} at {where} ({phase})."
    elif audited or replayed:
        then = f"{watched} and no op of it made them: they came in with the weights, the batch or the optimizer's state."
    elif on_failure == "raise":
        then = " The next step runs under a full watch to find the op that makes them; then opwatch raises."
    else:
        then = " The next step runs under a full watch to find the op that makes them."
    tail = " Later failures are only counted in the summary." if last else ""
    return head + then + tail


def _kinds(bad: list) -> str:
    kinds = {kind for _, kind in bad}
    return "/".join(kind for kind in ("nan", "inf") if kind in kinds)


def poisoned(step: int, bad: list, *, from_finite: bool) -> str:
    """The weights hold nan/inf: written by the optimizer step ``step`` that applied non-finite
    gradients, or (``from_finite``) found at step ``step + 1``, written from finite ones."""
    if from_finite:
        head = (
            f"opwatch: the weights hold {_kinds(bad)} before optimizer step {step + 1}: {parameters(bad)}. An earlier optimizer step "
            "wrote them from finite gradients (a learning rate too large, an optimizer's own arithmetic, or code that writes the weights)."
        )
    else:
        head = f"opwatch: the weights hold {_kinds(bad)} since optimizer step {step}: {parameters(bad)} (it applied non-finite gradients, on_failure='apply')."
    return head + (
        " Every later step carries them, so no op of a later step is their origin: none is watched fully again, and later failures "
        "are only counted in the summary. on_failure='skip' (the default) keeps non-finite gradients out of the weights."
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


def did_not_recur(failed_step: int, step: int, bad: list) -> str:
    """``on_failure="raise"``: the fully watched step after a failure had finite gradients."""
    return (
        f"opwatch: optimizer step {failed_step}: the gradients held nan/inf: {parameters(bad)}. That step did not run, and the failure "
        f"did not recur: step {step} ran under a full watch (every op's outputs checked for nan/inf, forward and backward) and its "
        "gradients were finite, so no op can be named: the values of that one batch made them. The optimizer did not run on them: "
        "the weights are as they were."
    )


def no_origin(step: int, bad: list, recheck: int | None) -> str:
    """``on_failure="raise"``: a fully watched step failed and no op of it made the nan/inf."""
    of = f" (the re-check of step {recheck})" if recheck is not None else ""
    return (
        f"opwatch: optimizer step {step}{of}: the gradients about to be applied hold nan/inf: {parameters(bad)}, and no op of this fully "
        "watched step made them: they came in with the weights, the batch or the optimizer's state. The optimizer did not run on them."
    )


def loop_ended(step: int, bad: list, rerun: str | None, *, raising: bool) -> str:
    """The program ended before the step after the failure of ``step`` could be watched."""
    how = rerun or "run the program under a full watch (python -m opwatch SCRIPT, without --guard)"
    then = " The optimizer did not run on them." if raising else ""
    return (
        f"opwatch: optimizer step {step}: the gradients held nan/inf: {parameters(bad)}, and the program's loop ended before another "
        f"optimizer step could run under a full watch, so no op is named.{then} To find the op that made them: {how}."
    )


def summary(steps: int, audited: int, failed: int, enabled: bool, skipped: int = 0) -> str:
    """The end-of-run line: steps run, audited, failed and skipped (or that the runner was off)."""
    if not enabled:
        return "opwatch guard: off (OPWATCH_DISABLE)."
    tail = f", {skipped} of them skipped" if skipped else ""
    return (
        f"opwatch guard: {steps} optimizer step{'s' if steps != 1 else ''} ran, {audited} audited under a full watch, "
        f"{failed} failed (nan/inf in the gradients){tail}."
    )


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
