"""The lines of the leave-on runner (:mod:`opwatch.runners.leave_on`, ``python -m opwatch --guard`` and
the trainers' guard mode): a failing optimizer step, the re-check of the next step, the summary.

Parameters are ``(name, kind)`` pairs, ``kind`` being ``"nan"`` or ``"inf"``.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["NamedOrigin", "origin_words", "parameters", "failure", "poisoned", "recheck", "same_backward", "did_not_recur", "stage_words", "no_origin", "loop_ended", "summary", "unjudged_end",
           "made_elsewhere", "stuck", "stuck_in_scaler_skips", "scaler_skips", "scaler_skipped_loss", "no_op_named", "bad_input", "batch_words",
           "evaluation_nan", "evaluations_nan", "evaluation_check_failed", "overwritten_unwatched"]


def parameters(bad: list) -> str:
    """``net.fc1.weight (nan), net.fc1.bias (inf)``: the first eight, then how many more."""
    if not bad:
        return "(not named: the step's own check failed it)"
    shown = ", ".join(f"{name} ({kind})" for name, kind in bad[:8])
    return shown + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")


_ACTIONS = {
    "skip": " The optimizer step did not run (skipped, as GradScaler skips an overflow step): the weights and the buffers its forward wrote are as they were.",
    "raise": " The optimizer step did not run: the weights and the buffers its forward wrote are as they were.",
    "apply": " The optimizer applies them (on_failure='apply').",
}


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} " + ", ".join(str(rank) for rank in ranks)


def _who(rank) -> str:
    return "opwatch" if rank is None else f"opwatch (rank {rank})"


def _held(bad: list, elsewhere) -> str:
    """``: net.fc1.weight (nan)``, or, in a job where this rank's own were finite, `` on rank 1
    (this rank's were finite; the ranks decide each optimizer step together)``."""
    if not bad and elsewhere:
        return f" on {_ranks(elsewhere)} (this rank's were finite; the ranks decide each optimizer step together)"
    return f": {parameters(bad)}"


class NamedOrigin(NamedTuple):
    """The first nan/inf a full watch of a step named, as the runners' messages tell it."""

    kind: str  # "nan" or "inf"
    op: str
    where: str  # file:line (or a named place)
    phase: str
    rank: int | None = None  # the rank that made it, in a job where another rank did
    # What the op read it from, when no op of the step made it (opwatch.runners.ledger.came_with):
    # "input" (an input made before the step: its batch, or a tensor the program kept),
    # "weights"; else None.
    came_with: str | None = None


def origin_words(origin: NamedOrigin) -> str:
    """``nan first made by aten.sqrt.default at train.py:12 (forward)`` (`` on rank 1`` when
    another rank made it); for values no op of the step made, where they came in:
    ``nan came in with an input made before the step (its batch, or a tensor the program kept):
    the first op to read it was aten.addmm.default at train.py:12 (forward)``."""
    on_rank = "" if origin.rank is None else f" on rank {origin.rank}"
    at = f"{origin.op} at {origin.where} ({origin.phase}){on_rank}"
    if origin.came_with == "input":
        return (f"{origin.kind} came in with an input made before the step (its batch, or a tensor the program kept), "
                f"not made by any op of it: the first op to read it was {at}")
    if origin.came_with == "weights":
        return f"{origin.kind} was already in the weights, not made by any op of the step: the first op to read it was {at}"
    return f"{origin.kind} first made by {at}"


def _loss_line(kind: str) -> str:
    return (f"the loss backward() ran on is {kind} while the gradients about to be applied are finite (a loss of 0/0, as a "
            "batch whose every label is ignored makes, gives zero gradients)")


def _held_then(bad: list, loss: str | None) -> str:
    """``the gradients held nan/inf: fc.weight (nan)``, or the loss's line for a step whose
    gradients were finite."""
    return _loss_line(loss) if loss is not None and not bad else f"the gradients held nan/inf: {parameters(bad)}"


def stage_words(stage: str | None, called: str | None = None) -> str:
    """Where a failure no full watch saw began (``stage``, a :class:`~opwatch.runners.ledger.Failure`'s),
    from what the hooked model (``called``: ``Sequential at train.py:12``, the module the
    optimizer trains that the first audit saw called first) was fed and returned; ``""`` when
    not known."""
    model = "the model" if called is None else called.replace(" at ", " (called at ", 1) + ")"
    if stage == "model":
        return f"the arguments of {model} were finite, and what it returned was not: an op of its forward made them"
    if stage == "after_model":
        return (f"the arguments of {model} were finite, and so was what it returned; the loss backward() ran on was not: "
                "they came in after that call, with what the loss was computed from beside what it returned (the targets, "
                "another model's inputs, a mask, a weight), or from the loss's own math")
    if stage == "forward_or_loss":
        return (f"the arguments of {model} were finite, and the loss backward() ran on was not: its forward made them, or what "
                "the loss was computed from after it (the targets, a mask, a weight); what it returned was not kept to tell which")
    if stage == "backward":
        return ("the loss backward() ran on was finite: the backward made them (a derivative that is infinite where its function "
                "is finite: sqrt or a norm at 0, pow with an exponent below 1; or 0 * nan from a value torch.where or a mask left "
                "out of the loss)")
    return ""


def failure(step: int, bad: list, on_failure: str, *, audited: bool = False, replayed: bool = False, origin=None, last: bool = False,
            elsewhere=(), rank=None, loss: str | None = None, stage: str | None = None, called: str | None = None) -> str:
    """The gradients about to be applied at ``step`` hold nan/inf, and what ``on_failure`` did;
    ``audited``: the step ran under the full watch (``origin``: the facts of
    the first nan/inf it made: a :class:`NamedOrigin`, or ``None``);
    ``replayed``: its batch ran again from its start under the full watch; ``last``: the last
    failure told one by one; ``elsewhere``: in a job, the ranks whose gradients held them when
    this rank's were finite; ``rank``: this rank, in a job; ``loss``: ``"nan"`` or ``"inf"``
    when the gradients were finite and the loss was not; ``stage``, ``called``: where it
    began, when known (:func:`stage_words`)."""
    if loss is not None and not bad and not elsewhere:
        head = f"{_who(rank)}: optimizer step {step}: {_loss_line(loss)}." + _ACTIONS[on_failure]
    else:
        head = f"{_who(rank)}: optimizer step {step}: the gradients about to be applied hold nan/inf{_held(bad, elsewhere)}." + _ACTIONS[on_failure]
    if rank is not None:
        head += " Every rank does the same."
    watched = " This step ran under a full watch" if audited else " Its batch ran again from its start (RNG states and buffers restored, .grad cleared) under a full watch"
    if (audited or replayed) and origin is not None:
        then = f"{watched}: {origin_words(origin)}."
    elif audited or replayed:
        then = f"{watched} and no op of it made them: they came in with the weights, the batch or the optimizer's state."
    elif on_failure == "raise":
        then = " The next step runs under a full watch to find the op that makes them; then opwatch raises."
    else:
        then = " The next step runs under a full watch to find the op that makes them."
    where = stage_words(stage, called)
    if where and not (audited or replayed):
        then = f" In this step {where}.{then}"
    tail = " Later failures are only counted in the summary." if last else ""
    return head + then + tail


def _kinds(bad: list) -> str:
    kinds = {kind for _, kind in bad}
    return "/".join(kind for kind in ("nan", "inf") if kind in kinds)


def poisoned(step: int, bad: list, *, from_finite: bool, rank=None, by_program: bool = False) -> str:
    """The weights hold nan/inf: written by the optimizer step ``step`` that applied non-finite
    gradients, or (``from_finite``) found at step ``step + 1``, written from finite ones
    (``rank``: this rank in a job, whose own shards may be finite: ``bad`` empty); ``by_program``:
    written in place after optimizer step ``step`` left them (or before the first), not by it."""
    if from_finite and bad and by_program:
        when = f"between optimizer steps {step} and {step + 1}" if step else "before the first optimizer step"
        head = (
            f"{_who(rank)}: the weights hold {_kinds(bad)} before optimizer step {step + 1}: {parameters(bad)}. They were written by the "
            f"program {when}, not by the optimizer: an in-place write changed them "
            + (f"after optimizer step {step} left them" if step else "before any optimizer step ran")
            + " (an assignment such as w[i] = ..., a state-dict load, an init)."
        )
    elif from_finite and not bad:
        head = (
            f"{_who(rank)}: the weights hold nan/inf on another rank before optimizer step {step + 1} (this rank's are finite). "
            "An earlier optimizer step wrote them from finite gradients (a learning rate too large, an optimizer's own arithmetic, or "
            "code that writes the weights)."
        )
    elif from_finite:
        head = (
            f"{_who(rank)}: the weights hold {_kinds(bad)} before optimizer step {step + 1}: {parameters(bad)}. An earlier optimizer step "
            "wrote them from finite gradients (a learning rate too large, an optimizer's own arithmetic, or code that writes the weights)."
        )
    elif not bad:
        head = (f"{_who(rank)}: the weights hold nan/inf on another rank since optimizer step {step} (this rank's are finite; "
                "it applied non-finite gradients, on_failure='apply').")
    else:
        head = f"{_who(rank)}: the weights hold {_kinds(bad)} since optimizer step {step}: {parameters(bad)} (it applied non-finite gradients, on_failure='apply')."
    return head + (
        " Every later step carries them, so no op of a later step is their origin: none is watched fully again, and later failures "
        "are only counted in the summary. on_failure='skip' (the default) keeps non-finite gradients out of the weights."
    )


def failed_late(step: int, now: int | None, on_failure: str, *, loss: str | None = None, gradients: bool = True,
                read: bool = False) -> str:
    """A fused optimizer's step whose verdict went to it as ``found_inf`` failed: it skipped the
    update on the device; told at step ``now``'s check (``None``: at the end of the run), or,
    ``read``, when the run's counts were read after step ``now`` (a log, a summary).
    ``gradients``: its gradients held nan/inf (else only the loss, ``loss``, did)."""
    if gradients:
        what = "its gradients held nan/inf" + (f" (and the loss backward() ran on was {loss})" if loss is not None else "")
    else:
        what = _loss_line(loss or "nan/inf")
    if read:
        when = f"told when the run's counts were read after step {now}"
    else:
        when = f"told at step {now}, before that step runs" if now is not None else "told at the end of the run"
    head = (f"opwatch: optimizer step {step}: {what}. The fused optimizer got the verdict as found_inf, as GradScaler hands it, "
            f"and skipped that step on the device: the weights are as they were ({when}, so that a healthy step never waits for the device).")
    if on_failure == "raise":
        return head + " Rerun with on_failure='skip' to watch the next step fully and name the op that makes them."
    return head + (" The next step runs under a full watch to find the op that makes them." if now is not None else "")


def loss_here_only(step: int, kind: str | None, rank: int) -> str:
    """In a DDP job: this rank's loss is not finite while the reduced gradients, the same on
    every rank, are: told by this rank, applied on every rank alike."""
    return (f"opwatch (rank {rank}): optimizer step {step}: the loss backward() ran on is {kind or 'nan/inf'} on this rank, while the "
            "gradients DDP reduced across the ranks are finite: every rank applies the step alike (they decide from what they share, "
            "so that their weights never drift apart).")


def recheck(failed_step: int, step: int, origin, *, failed_again: bool, rank=None, turn: tuple[int, int] | None = None) -> str:
    """What the full watch of ``step`` found of the failure of ``failed_step``: ``origin`` is
    the :class:`NamedOrigin` of the first nan/inf origin it found, or ``None``. ``turn``:
    ``(the failed step before, the interval)`` when ``step`` was watched as the turn of a failure
    that recurred at that interval, else ``None`` (the step after the failure)."""
    before, every = turn or (None, None)
    which = f"step {failed_step}" if turn is None else f"steps {before} and {failed_step}"
    at = f"step {step}" if turn is None else f"step {step}, its next turn (every {every} steps, watched fully)"
    if origin is not None:
        return f"{_who(rank)}: the failure of {which} recurred at {at}: {origin_words(origin)}."
    if failed_again:
        return (
            f"{_who(rank)}: the failure of {which} recurred at {at}, but no op of that step made the nan/inf: "
            "they came in with the weights, the batch or the optimizer's state."
        )
    if turn is not None:
        return (f"{_who(rank)}: the failure of {which} did not recur at step {step}, its next turn (every {every} steps): "
                "it ran under a full watch and its gradients were finite.")
    return f"{_who(rank)}: the failure of step {failed_step} did not recur: step {step} ran under a full watch and its gradients were finite."


def same_backward(step: int, failed_step: int, bad: list, on_failure: str, *, rank=None) -> str:
    """A step whose gradients came from the backward the step before (``failed_step``) failed
    on: several optimizers, each stepping on its own parameters after one backward."""
    return (f"{_who(rank)}: optimizer step {step}: its gradients hold nan/inf too{_held(bad, ())}; they came from the same "
            f"backward as those of step {failed_step} (no backward and no call of the model ran between the two steps), "
            f"so that failure's story is theirs.{_ACTIONS[on_failure]}")


def did_not_recur(failed_step: int, step: int, bad: list, *, loss: str | None = None, stage: str | None = None,
                  rerun: str | None = None) -> str:
    """``on_failure="raise"``: the fully watched step after a failure had finite gradients
    (``stage``: where the failure began, when known: :func:`stage_words`; ``rerun``: the
    command that runs a script under a full watch, where no step of its loop can be replayed)."""
    where = stage_words(stage)
    text = (
        f"opwatch: optimizer step {failed_step}: {_held_then(bad, loss)}{f'; in that step {where}' if where else ''}. That step did not run, and the failure "
        f"did not recur: step {step} ran under a full watch (every op's outputs checked for nan/inf, forward and backward) and its "
        "gradients were finite, so no op can be named: the values of that one batch made them. The optimizer did not run on them: "
        "the weights and the buffers its forward wrote are as they were."
    )
    if rerun:
        text += (f" Its op is named where that batch runs again under a full watch: {rerun} (with the same seeds and data order), "
                 "or opwatch.guard(train_step, model) around the step, which replays a failing batch.")
    return text


def no_origin(step: int, bad: list, recheck: int | None, *, elsewhere=(), loss: str | None = None) -> str:
    """``on_failure="raise"``: a fully watched step failed and no op of it made the nan/inf
    (in a job: on no rank)."""
    of = f" (the re-check of step {recheck})" if recheck is not None else ""
    nowhere = " on any rank" if elsewhere else ""
    if loss is not None and not bad and not elsewhere:
        return (f"opwatch: optimizer step {step}{of}: {_loss_line(loss)}, and no op of this fully watched step made it: "
                "it came in with the batch or the weights. The optimizer did not run.")
    return (
        f"opwatch: optimizer step {step}{of}: the gradients about to be applied hold nan/inf{_held(bad, elsewhere)}, and no op of this fully "
        f"watched step made them{nowhere}: they came in with the weights, the batch or the optimizer's state. The optimizer did not run on them."
    )


def made_elsewhere(rank: int, step: int, origin, own_failed: bool, missing, timeout: float, message: str) -> str:
    """The error (or origin) on a rank whose own watch of a failing optimizer step found no
    origin while another rank made it (``origin``: a ``Made``); ``message``: that rank's own."""
    here = "this rank's gradients held them too, received from it" if own_failed else "this rank's gradients were finite"
    late = ""
    if missing:
        late = f"; {_ranks(missing)} did not report what {'they' if len(missing) > 1 else 'it'} found within {timeout:g} s"
    return (
        f"opwatch (rank {rank}): optimizer step {step} failed on every rank (the ranks decide each optimizer step together): rank "
        f"{origin.rank} made it: {origin.kind} in {origin.op} at {origin.where} ({origin.phase}); {here}{late}. That rank's message:\n"
        + message
    )


def loop_ended(step: int, bad: list, rerun: str | None, *, raising: bool, loss: str | None = None) -> str:
    """The program ended before the step after the failure of ``step`` could be watched."""
    how = rerun or "run the program under a full watch (python -m opwatch SCRIPT, without --guard)"
    then = " The optimizer did not run on them." if raising else ""
    return (
        f"opwatch: optimizer step {step}: {_held_then(bad, loss)}, and the program's loop ended before another "
        f"optimizer step could run under a full watch, so no op is named.{then} To find the op that made them: {how}."
    )


def overwritten_unwatched(rerun: str | None) -> str:
    """The note on torch's "modified by an inplace operation" error of a backward no watch saw."""
    how = rerun or ("run the step under a full watch (python -m opwatch SCRIPT, opwatch.watch() around it, or a trainer's "
                    "OpwatchCallback() in its default watch mode)")
    return (f"opwatch: no watch saw this backward's forward, so no op is named. To name the op whose backward needed the "
            f"tensor and the op that wrote into it in place: {how}.")


# What each cause of a failed step says in the summary line (opwatch.runners.ledger.CAUSES).
_CAUSE_WORDS = {
    "gradients": "nan/inf in the gradients",
    "loss": "a loss not finite",
    "weights": "the weights already held nan/inf",
    "input": "the batch held nan/inf",
    "raised": "the step raised",
}


def summary(steps: int, audited: int, failed: int, enabled: bool, skipped: int = 0, *, causes: dict | None = None,
            scaler: tuple = (0, 0, None, 0), evaluations: tuple = (0, 0)) -> str:
    """The end-of-run line: steps run, audited, failed and skipped (or that the runner was off);
    ``causes``: how many failed steps had each cause (``{"input": 1, ...}``), so that no step
    whose cause was the batch or the weights is summed up as "nan/inf in the gradients";
    ``scaler``: the steps GradScaler skipped, how many of them in a row at the end, its scale
    then, and how many it skipped on a loss that was not finite (:func:`scaler_skips`);
    ``evaluations``: the calls with gradients off that returned nan, and of them those whose
    batch held nan/inf."""
    if not enabled:
        return "opwatch guard: off (OPWATCH_DISABLE)."
    tail = f", {skipped} of them skipped" if skipped else ""
    causes = {cause: count for cause, count in (causes or {}).items() if count}
    losses = causes.get("loss", 0)
    if not failed:
        why = None  # nothing failed: no cause to give
    elif set(causes) <= {"gradients", "loss"} and losses < failed:
        why = "nan/inf in the gradients" if not losses else f"nan/inf in the gradients, or in the loss for {losses} of them"
    elif len(causes) == 1:
        why = _CAUSE_WORDS[next(iter(causes))]
    else:
        why = "; ".join(f"{_CAUSE_WORDS[cause]}: {count}" for cause, count in causes.items())
    return (
        f"opwatch guard: {steps} optimizer step{'s' if steps != 1 else ''} ran, {audited} audited under a full watch, "
        f"{failed} failed" + (f" ({why})" if why else "") + f"{tail}{scaler_skips(*scaler)}{evaluations_nan(*evaluations)}."
    )


def scaler_skips(skipped: int, in_a_row: int, scale, losses: int = 0) -> str:
    """``; GradScaler skipped 3 more (overflows of its scaled gradients)``; ``losses`` of them
    on a loss that was not finite before it was scaled, which no scale mends, told apart; and
    for a run that ended skipping with its scale below 1, what that means."""
    if not skipped:
        return ""
    overflows = skipped - losses
    if not losses:
        why = "overflows of its scaled gradients"
    elif not overflows:
        why = "the loss was not finite before it was scaled" if losses == 1 else "each on a loss not finite before it was scaled"
    else:
        why = (f"{overflows} overflow{'s' if overflows != 1 else ''} of its scaled gradients, {losses} on a loss not finite "
               "before it was scaled")
    text = f"; GradScaler skipped {skipped} more ({why})"
    if in_a_row > 1 and scale is not None and scale < 1:
        text += (f", the last {in_a_row} in a row with its scale down to {scale:.3g}: the gradients are not finite even "
                 "unscaled, which no scale mends")
    return text


def scaler_skipped_loss(after: int, in_a_row: int, kind: str, fed, *, batch_finite: bool = False, rerun: str | None = None,
                        rank: int | None = None) -> str:
    """GradScaler skipped an optimizer step, ``in_a_row`` in a row since step ``after``, and a
    loss ``backward()`` ran on held ``kind`` before GradScaler scaled it: no scale mends that,
    and the scaler's skip is no overflow. ``fed``: the :class:`~opwatch.runners.batches.FedInput`
    of a call of the model since the last optimizer step whose arguments held nan/inf, or
    ``None``; ``batch_finite``: every call's arguments were read and were finite; ``rerun``:
    the command that runs the script under a full watch."""
    since = f"after optimizer step {after}" if after else "from the first step"
    step = f"the optimizer step {since}" if in_a_row == 1 else f"an optimizer step ({in_a_row} in a row {since})"
    head = (f"{_who(rank)}: GradScaler skipped {step}: the loss backward() ran on held {kind} before "
            "GradScaler scaled it, which no scale mends (its skips are for gradients that overflow once scaled)")
    if fed is not None:
        return (f"{head}. cause: input: {fed.model}'s {_fed_argument(fed.argument)} held {fed.kind} when it entered the model"
                f"{_fed_at(fed.where, fed.call)}, so no op of the model made it: it came in with the batch (the lines that made "
                "it, or what they read: a file, a numpy array, a sample).")
    where = (f"; to name the op that made it, run the step where it fails under a full watch: {rerun} (with the same seeds and "
             "data order), or opwatch.guard(train_step, model) around the step, which replays a failing batch") if rerun else ""
    made = "; the batch was finite when it entered the model, so an op of the step made it" if batch_finite else ""
    return f"{head}{made}{where}."


def stuck_in_scaler_skips(after: int, in_a_row: int, scale: float, *, rerun: str | None, limit: int, command_line: bool,
                          origin=None, unit: str = "optimizer steps") -> str:
    """GradScaler skipped ``in_a_row`` steps in a row, all since ``after`` of them ran (``unit``:
    optimizer steps, or guarded calls whose step it skipped), the last at a scale below 1, and
    its scale fell to ``scale``: the run is stuck. ``origin``: the :class:`NamedOrigin` a full
    watch of those steps named, or ``None``; ``rerun``: the command that watches every op."""
    if unit == "optimizer steps":
        skipped = f"{in_a_row} optimizer steps in a row ({f'after optimizer step {after}' if after else 'from the first step'})"
        unseen, watched = "no optimizer step ran, so no check of opwatch's saw them", "the full watch of these steps"
    else:
        skipped = f"the optimizer step of {in_a_row} {unit} in a row (calls {after + 1} to {after + in_a_row})"
        unseen = "what the calls returned was finite, and their gradients are GradScaler's to check"
        watched = "a full watch of the call after them"
    if origin is not None:
        named = f"{unseen}; {watched} names it: {origin_words(origin)}."
    else:
        named = f"{unseen}. A full watch names the op that makes them: {rerun or 'opwatch.watch() or opwatch.strict() around the training step'}."
    option = "--max-failed-steps N (0: never stop)" if command_line else "max_failed_in_a_row=N (None: never stop)"
    return (
        f"opwatch: the run is stuck: GradScaler skipped {skipped}, and its scale fell to "
        f"{scale:.3g}: below 1 it scales the loss down, so the gradients overflow (or hold nan, or the loss does) even unscaled, "
        f"and no scale mends that; {named} opwatch stops a run once {limit} steps in a row were skipped, the last with the "
        f"scale below 1; {option} sets that limit."
    )


# What names the op of a batch that failed once, in a trainer whose guard mode does not run it
# again (no_op_named's ``trainer``).
_REPLAYS_IT = {
    "transformers": ("the callback alone does not run it again: guard_trainer(trainer) (opwatch.runners.transformers) replays a "
                     "failing batch from its start under a full watch, which names its op"),
    "lightning": ("a step that accumulates gradients, or steps its optimizers by hand, is not run again: OpwatchCallback() (mode "
                  "\"watch\") names its op where that batch runs again under a full watch (with the same seeds and data order)"),
}


def no_op_named(watch_summary: str, failed: int, unjudged: bool, origin=None, *, world: int | None = None, told: str | None = None,
                evaluations: int = 0, rerun: str | None = None, scaler_losses: int = 0, trainer: str | None = None) -> str:
    """The audits' summary of a run whose watch named nothing while a step failed, an
    evaluation returned nan (``evaluations``: how many calls with gradients off did) or the run
    ended unjudged: never "no anomalies" alone (the guard's line below says what happened).
    ``rerun``: the command that runs a script under a full watch, given where a failure no batch
    explains went unnamed and no step can be replayed (the CLI's loop).
    ``origin``: the :class:`NamedOrigin` a replay named, or ``None``; ``told``: that origin's
    own message (its problem, cause and fix), shown under the line, as a watch's summary shows
    the anomalies it found. ``world``: for the combined summary of a job of ``world`` ranks,
    printed after every guard's line. ``scaler_losses``: the steps GradScaler skipped on a loss
    that was not finite before it was scaled (none failed: GradScaler skipped them).
    ``trainer``: given where such a failure went unnamed in a trainer that does not run a
    failing batch again (``"transformers"``: the callback alone; ``"lightning"``: gradient
    accumulation, manual optimization), what does (:data:`_REPLAYS_IT`)."""
    who = "opwatch" if world is None else f"opwatch, all {world} ranks"
    guard_line = "below" if world is None else "above"
    if failed and origin is not None:
        said = (f"{who}: {failed} optimizer step{'s' if failed != 1 else ''} failed; the first origin a replay named: "
                f"{origin_words(origin)}.")
        if told:
            said += "\n\n" + told + "\n"
    elif failed:
        said = (f"{who}: no op was named in the fully watched steps, but {failed} optimizer step{'s' if failed != 1 else ''} "
                f"failed (see the guard's line {guard_line}).")
        if rerun:  # a script's loop: no step of it can run again on its batch
            said += (" A batch that fails once passes the re-check of the step after it; its op is named where that batch runs "
                     f"again under a full watch: {rerun} (with the same seeds and data order), or opwatch.guard(train_step, model) "
                     "around the step, which replays a failing batch.")
        elif trainer:
            said += f" A batch that fails once passes the re-check of the step after it; {_REPLAYS_IT[trainer]}."
    elif scaler_losses:
        said = (f"{who}: no op was named in the fully watched steps, but GradScaler skipped {scaler_losses} optimizer "
                f"step{'s' if scaler_losses != 1 else ''} on a loss that was not finite before it was scaled (see the guard's "
                f"line {guard_line}).")
    elif evaluations:
        said = (f"{who}: no anomalies in the fully watched steps, but {evaluations} call{'s' if evaluations != 1 else ''} with "
                f"gradients off (evaluations) returned nan (see the guard's line {guard_line}).")
    else:
        said = f"{who}: no anomalies in the fully watched steps; the run's last ops were not judged (see {guard_line})."
    first, newline, rest = watch_summary.partition("\n")
    return said + newline + rest if "no anomalies" in first else watch_summary


def stuck(first_step: int, step: int, in_a_row: int, bad: list, origin, *, poisoned_since: int | None, loss: str | None,
          limit: int, applied: bool = False, unit: str = "optimizer steps", command_line: bool = False, cause: str = "gradients") -> str:
    """``in_a_row`` steps in a row failed, ``first_step`` to ``step``: the run is stuck.
    ``origin``: the :class:`NamedOrigin` of the first failure's origin, or ``None``;
    ``unit``: what a step is (``"optimizer steps"``, ``"guarded calls"``); ``command_line``: the
    limit is named as the command line's option, else as the Python keyword; ``cause``: the
    first failure's (``opwatch.runners.ledger.CAUSES``)."""
    if origin is not None:
        why = f"The first, step {first_step}: {origin_words(origin)}."
    elif cause == "input":
        why = (f"The first, step {first_step}: the batch held nan/inf before the model ran (cause: input)"
               + (f"; the weights hold nan/inf since step {poisoned_since}, so every later step fails." if poisoned_since is not None else "."))
    elif poisoned_since is not None:
        why = (f"The weights hold nan/inf since step {poisoned_since}, so every later step fails; "
               f"the first failure, step {first_step}: {_held_then(bad, loss)}.")
    else:
        why = f"The first, step {first_step}: {_held_then(bad, loss)}; no full watch named an op for it."
    option = "--max-failed-steps N (0: never stop)" if command_line else "max_failed_in_a_row=N (None: never stop)"
    return (
        f"opwatch: the run is stuck: {in_a_row} {unit} in a row failed (steps {first_step} to {step}), "
        f"{'the optimizer applied all but the last' if applied else 'none of them applied'}. {why} opwatch stopped the run "
        f"after {limit} failed steps in a row; {option} sets that limit."
    )


def unjudged_end(step: int, rerun: str | None, scaler_in_a_row: int = 0, *, left=None) -> str:
    """The run went on after its last optimizer step (``step``) with no watch on, and no
    gradient check followed: its summary cannot speak for those ops. ``rerun``: the command
    that checks every op; ``scaler_in_a_row``: the steps GradScaler skipped since; ``left``:
    what those ops left, when it says something (a
    :class:`~opwatch.runners.ledger.LeftUnjudged`)."""
    after = f"after optimizer step {step}" if step else "before any optimizer step"
    command = f": {rerun}" if rerun else " (opwatch.watch() or opwatch.strict())"
    if scaler_in_a_row:
        why = f"GradScaler skipped the {scaler_in_a_row} step{'s' if scaler_in_a_row != 1 else ''} after it"
    else:
        why = "a script that stops on a nan loss ends so"
    return (
        f"opwatch guard: the run ended before opwatch judged its last ops: the model ran forward {after} and no optimizer step "
        f"followed ({why}), so no check saw them{_left_words(left)}; a full watch checks every op{command}"
    )


def _left_words(left) -> str:
    """``; what they left: the loss backward() ran on was nan, ...``, or ``""``."""
    if left is None:
        return ""
    fed = left.fed
    if fed is not None:
        return (f"; what they left: the batch held {fed.kind} before the model ran: {fed.model}'s {_fed_argument(fed.argument)} "
                f"held {fed.kind} when it entered the model{_fed_at(fed.where, fed.call)}, so no op of the model made it: it came in with the batch")
    where = stage_words(left.stage, left.called)
    if where:
        return f"; what they left: {where}"
    return f"; what they left: the loss backward() ran on was {left.loss}"


def batch_words(batch: dict) -> str:
    """A failure's bad batch as the run ledger keeps it (:class:`~opwatch.runners.ledger.Failure`'s
    ``batch``), for the report: ``the batch held nan when it entered the model: Sequential's
    argument 0 (f32[8, 8] cpu) at train.py:12 (call 1 of the 3 the model ran since the last
    optimizer step), on rank 1``."""
    import torch

    rank = batch.get("rank")
    on_rank = "" if rank is None else f", on rank {rank}"
    if "argument" not in batch:
        return f"the batch of rank {rank} held nan/inf when it entered the model (what it held did not reach this rank)"
    name, dtype, shape, device = batch["argument"]
    argument = _fed_argument((name, getattr(torch, dtype, dtype), shape, device))
    return (f"the batch held {batch['kind']} when it entered the model: {batch['model']}'s {argument}"
            f"{_fed_at(batch.get('where'), batch.get('call'))}{on_rank}")


def evaluation_nan(told, *, rerun: str | None, rank: int | None = None, poisoned_since: int | None = None) -> str:
    """A call of the model with gradients off returned nan (``told``: an
    :class:`~opwatch.runners.evaluations.EvaluationNan`): the batch's, when one of its arguments
    held nan/inf, else the weights' when they held nan/inf since optimizer step
    ``poisoned_since`` (told then), else the model's. No gradient holds it, so no step fails."""
    on_rank = "" if rank is None else f" (rank {rank})"
    call = (f"opwatch{on_rank}: a call of {told.model} with gradients off (an evaluation){_fed_at(told.where, None)}, "
            f"after optimizer step {told.after_step}, returned nan")
    if told.argument is not None:
        return (f"{call}: its {_fed_argument(told.argument)} held {told.kind} when it entered the model (cause: input), so no op of "
                "the model made it: it came in with the batch (the lines that made it, or what they read: a file, a sample). No gradient "
                "holds it: training goes on, and what the evaluation computes from it (a validation loss) is nan.")
    if poisoned_since is not None:
        return (f"{call} from finite arguments: the weights hold nan/inf since optimizer step {poisoned_since} (told then), and "
                "every call of the model reads them. What the evaluation computes from it (a validation loss) is nan.")
    how = rerun or "opwatch.watch() around the evaluation"
    return (f"{call} from finite arguments: an op of the model made it; a full watch names it: {how}. No gradient holds it: "
            "training goes on, and what the evaluation computes from it (a validation loss) is nan.")


def evaluation_check_failed(type_name: str, text: str) -> str:
    """The check of the model's calls with gradients off raised (a kind of tensor it does not
    read): it stops, the run goes on."""
    return (f"opwatch could not check what the model returned with gradients off ({type_name}: {text}); the calls of evaluations "
            "are not checked from now on. Please report this to the opwatch issue tracker.")


def evaluations_nan(count: int, from_input: int) -> str:
    """``; 3 calls with gradients off returned nan (2 of them from their batch)``: the summary's clause."""
    if not count:
        return ""
    batches = f", {from_input} of them from their batch" if from_input and from_input < count else (", from their batch" if from_input else "")
    return f"; {count} call{'s' if count != 1 else ''} with gradients off (evaluations) returned nan{batches}"


def _fed_argument(argument) -> str:
    """``argument 0 (f32[8, 8] cpu)``: a model's argument, ``(name, dtype, shape, device)``."""
    from ..core.notation import format_dtype, format_shape

    name, dtype, shape, device = argument
    return f"{name} ({format_dtype(dtype)}{format_shape(tuple(shape))} {device})"


def _fed_at(where, call) -> str:
    """`` at train.py:12 (call 1 of the 3 the model ran since the last optimizer step)``."""
    at = f" at {where}" if where else ""
    if call:
        number, calls = call
        at += f" (call {number} of the {calls} the model ran since the last optimizer step)"
    return at


def bad_input(step: int, bad: list, on_failure: str, fed, *, rerun: str | None = None, rank: int | None = None,
              ranks: tuple | None = None, elsewhere=()) -> str:
    """The gradients (or loss) of ``step`` failed and what the step fed the model held nan/inf
    when it entered it: cause *input*. ``fed``: a :class:`~opwatch.runners.batches.FedInput`
    (``model``'s ``argument``: ``(name, dtype, shape, device)``, ``kind``, ``where``: the
    ``file:line`` of the call; ``call``: ``(which call, of how many)`` where the model ran more
    than once before the step), or ``None`` when another rank's facts did not arrive.
    ``rerun``: with ``on_failure="raise"``, the command that watches every op. In a job:
    ``rank``, this rank; ``ranks``, those whose batch held nan/inf (the first one's is told);
    ``elsewhere``, the ranks whose gradients held them when this rank's were finite."""
    if bad or elsewhere:
        held = f"the gradients about to be applied hold nan/inf{_held(bad, elsewhere)}"
    else:
        held = "the loss is not finite"
    first = min(ranks) if ranks else None
    whose = "the batch" if first is None else "this rank's batch" if first == rank else f"rank {first}'s batch"
    also = f" (also the batch of {_ranks(set(ranks) - {first})})" if ranks and len(ranks) > 1 else ""
    if fed is None:
        told = (f"{whose} held nan/inf before the model ran{also} (what it held did not reach this rank), so no op of the "
                "model made them: they came in with the batch")
    else:
        told = (f"{whose} held {fed.kind} before the model ran{also}: {fed.model}'s {_fed_argument(fed.argument)} held {fed.kind} "
                f"when it entered the model{_fed_at(fed.where, fed.call)}, so no op of the model made them: they came in with the batch")
    head = (
        f"{_who(rank)}: optimizer step {step}: {held}. cause: input: {told} (the lines that made it, or what they read: a file, "
        "a numpy array, a sample)."
    )
    every = " Every rank does the same." if rank is not None else ""
    if on_failure == "raise":
        then = " The optimizer did not run on them." + every
        if rerun:
            then += f" To see the ops that made the batch, if torch made it: {rerun}."
        return head + then
    return head + _ACTIONS[on_failure] + every
