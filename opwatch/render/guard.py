"""Every sentence :func:`opwatch.guard` says, built from the facts its rooms gather.

Facts used here:

- a *failure*: a :class:`~opwatch.render.guard_facts.Raised`, ``FailedElsewhere`` or
  ``NotFinite`` (:mod:`opwatch.render.guard_facts`, filled by ``opwatch.runners.guarded.check``),
  read by attribute;
- a *repro note*: a ``ReproNote(kind, op, where, why, error_type)`` of kind ``"alone"``,
  ``"raised_op"`` (op, where), ``"capture_broken"`` (why), ``"not_captured"``,
  ``"write_failed"`` (error_type, why) or ``"audit"``; or ``None`` (``opwatch.runners.guarded.replay``);
- ``buffers``: how many buffers a replay restored.
"""

from __future__ import annotations

import os

from ..core.notation import format_meta
from ..core.sites import display_path, location
from .guard_facts import FailedElsewhere, Raised, Unnamed
from .summary import exception_note
from .table import render_table

_MAX_NAMES = 4  # names listed in a message; the rest are counted

WHY = (
    ". A replay runs the step again from the same RNG states, buffers and .grad; it can differ when kernels are "
    "nondeterministic (CUDA atomics: index_add, scatter_add, some convolution backward algorithms), when the step "
    "reads data or state that changed since (data loading inside the step, a counter, Python's random), or when "
    "the failure depends on other processes. See help(opwatch.guard)."
)


def names(found) -> str:
    """``a, b, c, d, +2 more``; an unnamed parameter (:class:`Unnamed`) is described."""
    shown = ", ".join(_name(name) for name in found[:_MAX_NAMES])
    return shown + (f", +{len(found) - _MAX_NAMES} more" if len(found) > _MAX_NAMES else "")


def _name(name) -> str:
    if isinstance(name, Unnamed):
        return f"parameter {name.position} ({format_meta(name.meta)})"
    return name


def restored(buffers: int) -> str:
    """What a replay starts from: the step's RNG states and buffers put back, and its gradients
    cleared (never copied: a failing step's are dropped, runners.guarded.snapshot)."""
    return ("RNG states and " + f"{buffers} buffer(s)" if buffers else "RNG states") + " restored, .grad cleared"


def failure_text(failure) -> str:
    """``it raised ValueError: ...`` or ``the check after it found nan in the returned tensor``."""
    if isinstance(failure, Raised):
        return f"it raised {failure.error_type}: {failure.line}"
    if isinstance(failure, FailedElsewhere):
        return "this rank's results and gradients were finite, another rank's were not (the ranks decide each step together)"
    parts = [f"{value.kind} in " + (f"the returned {value.type}" if value.path == "returned" else value.path) for value in failure.returned]
    parts += [f"{bad.kind} in the .grad of {len(bad.names)} parameter(s): {names(bad.names)}" for bad in failure.grads]
    if not parts:
        found = "nan/inf (no longer there when described)"
    else:
        found = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return f"the check after it found {found}"


def context(call: int, name: str, failure, buffers: int | None, *, audited: bool = False) -> str:
    """The ``step:`` line of a replayed (or audited) anomaly."""
    if audited:
        return f"call {call} of {name} failed: {failure_text(failure)}; found by the audit of that call (it ran under a full watch)"
    return f"call {call} of {name} failed: {failure_text(failure)}; replayed from the same start ({restored(buffers)}) under a full watch"


def repro_note(note) -> str | None:
    if note is None:
        return None
    kind = note.kind
    if kind == "alone":
        return "this op alone, on its saved inputs"
    if kind == "raised_op":
        return f"{note.op} at {note.where}, the op that raised, alone on its saved inputs"
    if kind == "capture_broken":
        return f"none (capturing the replay's inputs failed: {note.why})"
    if kind == "not_captured":
        return "none (the op's inputs were not captured in the replay)"
    if kind == "write_failed":
        return f"none (it could not be written: {note.error_type}: {note.why})"
    if kind == "audit":
        return "none (found by an audit, which keeps no inputs; audit=\"never\" replays failing steps with a repro)"
    raise ValueError(f"unknown repro note {note!r}")


def replayed_message(message: str, step_context: str, repro, note, ranks=None) -> str:
    """An anomaly's message with the step it failed, the rank that made it (``ranks``: a
    ``RankOrigin`` in a distributed job, else ``None``) and its repro."""
    text = message + f"\n  step:     {step_context}"
    if ranks is not None:
        text += f"\n  ranks:    {ranks_text(ranks)}"
    said = repro_note(note)
    if repro is not None:
        text += f"\n  repro:    python {display_path(os.path.join(repro, 'repro.py'))} ({said})"
    elif said:
        text += f"\n  repro:    {said}"
    return text


def repro_about(anomaly, raised, record) -> list:
    """The repro script's docstring lines: what was found, what raised, the op, its code.
    ``raised``: a ``Raised`` failure fact or ``None``."""
    about = []
    if anomaly is not None:
        about.append("found:    " + anomaly.message.split("\n", 1)[0])
    if raised is not None:
        about.append(f"raised:   {raised.error_type}: {raised.line}")
    if record is not None:
        about.append(f"op:       {record.signature()}")
        code = record.position.expression() or record.position.line_text()
        if code:
            about.append(f"code:     {location(record)}: {code.strip()}")
    return about


def replay_raised_note(call, name, buffers, *, again, original, replay_raised, allowed, failed_record, repro) -> str:
    """The note added to a step's own exception when its replay found no anomaly before it.
    ``replay_raised``: the replay's exception type name, or ``None`` when it did not raise."""
    also = f" ({allowed} finding(s) matched an allow entry)" if allowed else ""
    if replay_raised is None:
        what = "it did not raise again: the failure did not reproduce" + WHY
    else:
        what = f"it raised {replay_raised} {'again' if again else f'(not {original})'}, with no anomaly before it{also}"
        if failed_record is not None:
            what += "\n" + exception_note(failed_record)
    if repro is not None:
        what += f"\none-op repro of the op that raised: python {display_path(os.path.join(repro, 'repro.py'))}"
    return f"opwatch.guard: call {call} of {name} was replayed from the same start ({restored(buffers)}) under a full watch: {what}"


def replay_raised_instead(call, name, failure, replay_raised) -> str:
    return (
        f"opwatch.guard: call {call} of {name} failed ({failure_text(failure)}); its replay under a full watch "
        f"raised {replay_raised} instead: the replay did not run as the step did" + WHY
    )


def only_allowed(call, name, failure, buffers, count, first_message) -> str:
    first = first_message.split("\n", 1)[0]
    return (
        f"opwatch.guard: call {call} of {name} failed ({failure_text(failure)}); its replay from the same start "
        f"({restored(buffers)}) under a full watch found only nan/inf origins that match an allow entry "
        f"({count}, the first: {first}). Allowed or not, they reached the step's results, "
        "and the optimizer must not see them; Guarded.last_replay.allowed holds them."
    )


def nothing_found(call, name, failure, buffers, allowed) -> str:
    also = f" ({allowed} finding(s) matched an allow entry)" if allowed else ""
    return (
        f"opwatch.guard: call {call} of {name} failed ({failure_text(failure)}), but its replay from the same start "
        f"({restored(buffers)}) under a full watch found no nan/inf origin{also}: the failure did not reproduce" + WHY
    )


def skipped_unexplained(problem: str, on_failure: str = "skip") -> str:
    if on_failure == "apply":
        return f"{problem}\nIts gradients were left for the optimizer (on_failure='apply')."
    return f"{problem}\nThe step was skipped."


def skipped_step(message: str, on_failure: str = "skip") -> str:
    if on_failure == "apply":
        return f"opwatch.guard let a failing step's gradients through (on_failure='apply'):\n{message}"
    return f"opwatch.guard skipped a step:\n{message}"


def poisoned_weights(call: int, name: str, since, bad: str, on_failure: str, *, by_program: bool = False) -> str:
    """Call ``call`` failed and the parameters themselves hold nan/inf (``bad``: the named
    ones); ``since``: the call whose failure was applied (on_failure='apply'), or ``None``;
    ``by_program``: no optimizer step wrote them (their version counters moved after the last
    optimizer step left them, or no optimizer step ran yet)."""
    if since is not None:
        head = f"opwatch.guard: call {call} of {name} failed and the weights hold nan/inf since call {since} (its gradients were applied, on_failure='apply'): {bad}."
    elif by_program:
        head = (
            f"opwatch.guard: call {call} of {name} failed and the weights already hold nan/inf: {bad}. They were written by the "
            "program, not by the optimizer: an in-place write changed them after the last optimizer step left them, or before "
            "any optimizer step ran (an assignment such as w[i] = ..., a state-dict load, an init)."
        )
    else:
        head = (
            f"opwatch.guard: call {call} of {name} failed and the weights already hold nan/inf: {bad}. Code outside the guarded step wrote "
            "them (the optimizer from finite gradients with a learning rate too large, or code that writes the weights)."
        )
    then = {
        "raise": " The step is not replayed: every op that reads the weights would look like an origin.",
        "skip": " The step is not replayed (every op that reads the weights would look like an origin) and is skipped, as are the next ones, warned no more.",
        "apply": " The step is not replayed (every op that reads the weights would look like an origin); later failures are warned no more.",
    }[on_failure]
    return head + then


def check_failed(type_name: str, text: str) -> str:
    return (
        f"opwatch.guard could not check a step's results ({type_name}: {text}); "
        "steps that do not raise are not checked. Please report this to the opwatch issue tracker."
    )


def changed_parameters(name: str, changed) -> str:
    return (
        f"opwatch.guard: {name} changed {len(changed)} parameter(s) "
        f"while it ran ({names(changed)}): an optimizer.step() inside it? A guarded step must leave the "
        "parameters alone, so that a failing step can be replayed from where it started and the optimizer "
        "never sees its gradients. Call optimizer.step() after the guarded call:\n"
        "    step = opwatch.guard(train_step, model)\n"
        "    loss = step(batch)\n"
        "    optimizer.step()\n"
        "If it updates other parameters on purpose (an EMA copy), guard only the trained ones: "
        "opwatch.guard(train_step, model.net.parameters())."
    )


def changed_arguments(call: int, name: str, failure, changed) -> str:
    """``changed``: ``((path, meta), ...)`` of the arguments the step wrote in place."""
    described = [f"{path} ({format_meta(meta)})" for path, meta in changed]
    return (
        f"opwatch.guard cannot replay call {call} of {name} "
        f"({failure_text(failure)}): it changed its argument {names(described)} in place, so a replay would not start from "
        "the same data. Let the step work on a copy (x = x / 255 rather than x.div_(255)), or run it under "
        "opwatch.strict() to find the failure."
    )


def ops_note(records, index: int, *, audited: bool = False) -> str:
    return f"opwatch.guard: the {'audit' if audited else 'replay'}'s last {len(records)} ops up to op #{index}:\n" + render_table(records, mark=index)


def guarded_repr(step, calls: int, failures: int, audits: int) -> str:
    return f"<opwatch.guard of {step!r}: {calls} call(s), {audits} audit(s), {failures} failure(s)>"


def _compiled_names(verdict) -> str:
    return ", ".join(fact.name for fact in verdict.compiled)


def compiled_verdict(verdict) -> str:
    """The note of a failing step that runs compiled code when its eager replay fails too."""
    op, where = verdict.origin
    return (
        f"compiled: the step runs compiled code ({_compiled_names(verdict)}); the failing run was compiled and the replay "
        f"ran it eagerly: eager also fails: {op} at {where}. The nan/inf comes from the program, not from the compiler."
    )


def _stages(verdict) -> str:
    ran = "; ".join(f"{backend}: {outcome}" for backend, outcome in verdict.stages)
    if not verdict.stages:
        return ""
    *_, (backend, outcome) = verdict.stages  # the last stage run
    own = getattr(verdict, "own", None)
    if outcome == "finite" and own is not None and own != "finite":
        named = verdict.backend or "inductor, or the one given to torch.compile"
        first = f"the step's own backend ({named}) is the first stage that makes it (run again with it: {own})"
    elif outcome == "finite" and own == "finite":
        first = "every stage and the step's own backend, run again from the same start, gave a finite step: the failure did not reproduce"
    elif outcome == "finite":
        first = "the step's own backend (inductor, or the one given to torch.compile) is the first stage that makes it"
    elif outcome == "not run":
        first = "torch.compiler.set_stance(force_backend=...) is missing in this torch, so the stages were not run"
    elif outcome == "not apart":
        first = ("this torch gives opwatch no way to compile the stages beside the program's compiled code, so they were not run: "
                 "their compiles would have spent the recompile budget of the program's own frames")
    else:
        first = f"{backend} is the first stage that makes it ({_STAGE_MEANS.get(backend, backend)})"
    return f" Run again from the same start with each compiler stage as the backend ({ran}): {first}."


_STAGE_MEANS = {
    "eager": "Dynamo's captured graph, run as it is: the capture itself differs from the Python code",
    "aot_eager": "AOTAutograd's forward and backward graphs: functionalization or the traced backward differs",
    "aot_eager_decomp_partition": "inductor's decompositions and the partitioner: a decomposition differs",
}


def only_compiled(call, name, failure, buffers, verdict) -> str:
    """The error of a failing step whose eager replay is finite while its compiled run was not."""
    return (
        f"opwatch.guard: call {call} of {name} failed ({failure_text(failure)}) running compiled code "
        f"({_compiled_names(verdict)}); its replay, run eagerly from the same start ({restored(buffers)}) under "
        f"a full watch, found no nan/inf: eager is finite on the same inputs: only the compiled step makes nan/inf "
        f"(a miscompile, or a fused kernel's precision)." + _stages(verdict) + _narrowed(verdict) + _settings(verdict) + _graph_repro(verdict)
    )


def replayed_verdict(verdict) -> str:
    """A leave-on replay's verdict on a failing step that runs compiled code (a trainer's guard
    mode replays the batch eagerly under a full watch): eager fails too, or only the compiled step."""
    if verdict.eager_fails:
        return compiled_verdict(verdict)
    return (
        f"compiled: the step runs compiled code ({_compiled_names(verdict)}); its replay ran it eagerly from the same start under a "
        "full watch and found no nan/inf: eager is finite on the same inputs: only the compiled step makes nan/inf (a miscompile, "
        "or a fused kernel's precision)." + _stages(verdict) + _narrowed(verdict) + _settings(verdict) + _graph_repro(verdict)
    )


def leave_on_only_compiled(step: int, shown: str, verdict) -> str:
    """``on_failure="raise"`` in a trainer's guard mode: the replayed step's eager run is finite."""
    return f"opwatch: optimizer step {step}: the gradients about to be applied hold nan/inf: {shown}. The optimizer did not run on them.\n" + (
        replayed_verdict(verdict)
    )


def _value(value) -> str:
    """``finite, max |x| 3.2`` or ``nan in 16 of 128 values, max finite |x| 3.2``."""
    largest = "" if value.max_abs is None else f", max {'finite ' if value.nonfinite else ''}|x| {value.max_abs:.4g}"
    if value.kind == "finite":
        return "finite" + largest
    return f"{value.kind} in {value.nonfinite} of {value.numel} values" + largest


def node_text(node) -> str:
    """``torch.sqrt (node sqrt, graph 1 of 1) at model.py:31: return torch.sqrt(h)``."""
    at = f" at {node.where}" + (f": {node.code}" if node.code else "") if node.where else " (no source line: the node has no stack trace)"
    return f"{node.op} (node {node.name}, graph {node.graph} of {node.graphs}){at}"


_NOT_NARROWED = {
    "outputs_agree": (
        " Each captured graph's outputs agree with eager on its inputs, and so do its inputs' gradients under a gradient of "
        "ones on its outputs: the difference needs the step's own output gradients or a later call of the graph in the step, "
        "which opwatch does not narrow."
    ),
    "no_graph": " No graph was captured in the failing run, so no node was narrowed.",
    "too_large": " The graphs' inputs were over repro_max_bytes, so none was kept and no node was narrowed.",
}


def _narrowed(verdict) -> str:
    """Where the failing backend first goes wrong: the graph node and its source line."""
    node = getattr(verdict, "node", None)
    if node is None:
        reason = getattr(verdict, "narrowed", None)
        if reason is None:
            return ""
        return _NOT_NARROWED.get(reason, f" Narrowing it to a graph node failed ({reason}).")
    how = "is not finite where eager is" if node.why == "nan/inf" else (
        f"differs from eager by up to {node.difference:.4g}, outside the tolerance of its dtype (rtol {node.rtol:g}, "
        f"atol {node.atol:g})"
    )
    if getattr(node, "phase", "forward") == "backward":
        return (
            f" Each captured graph's outputs agree with eager; its backward does not. The first node whose backward "
            f"{verdict.backend} gets wrong: {node_text(node)}; with a gradient of ones on the node's output, the gradient of "
            f"{node.gradient} {how} (eager: {_value(node.eager)}; compiled: {_value(node.compiled)})."
        )
    return (
        f" The first node of the forward graph whose output {verdict.backend} gets wrong: {node_text(node)}; its output {how} "
        f"(eager: {_value(node.eager)}; compiled: {_value(node.compiled)})."
    )


_SETTING_MEANS = {
    "emulate_precision_casts": "a fused kernel's precision (inductor keeps intermediates in higher precision than eager's casts)",
    "fallback_random": "random numbers that differ from eager's",
}


def _settings(verdict) -> str:
    """What inductor's settings closer to eager did, each run once from the step's start."""
    settings = getattr(verdict, "settings", ())
    if not settings:
        return ""
    ran = "; ".join(f"{name}=True: {outcome}" for name, outcome in settings)
    fixed = [name for name, outcome in settings if outcome == "finite"]
    if fixed:
        said = " and ".join(f"{name} makes the step finite: {_SETTING_MEANS.get(name, name)}" for name in fixed)
    elif all(outcome == "not run" for _, outcome in settings):
        said = "this torch's inductor has neither setting"
    else:
        said = "neither makes the step finite: it is not the precision of casts nor the random numbers"
    return f" Inductor's settings, each for one run from the same start ({ran}): {said}."


def _graph_repro(verdict) -> str:
    repro = getattr(verdict, "repro", None)
    if repro is None:
        return ""
    return f" One-file repro (the graph on its saved inputs, eager and compiled): python {display_path(repro)}"


def graph_repro_about(node, backend: str, graphs: int, missing) -> list:
    """The docstring lines of a compiled graph's repro."""
    about = [f"backend:  {backend} (the failing one; the graph is Dynamo's, before the backend)"]
    if backend.startswith("__main__:"):
        about.append("          it is defined in the training script: set TORCH_COMPILE_BACKEND=module:function to name it")
    if node is not None and getattr(node, "phase", "forward") == "backward":
        about.append(f"node:     {node_text(node)}: its backward (its output agrees with eager)")
        about.append(f"values:   the gradient of {node.gradient}: eager {_value(node.eager)}; compiled {_value(node.compiled)}")
    elif node is not None:
        about.append(f"node:     {node_text(node)}")
        about.append(f"values:   eager {_value(node.eager)}; compiled {_value(node.compiled)}")
    else:
        about.append(f"graph:    1 of {graphs} captured; no single node was found wrong")
    if missing:
        about.append(f"missing:  {', '.join(missing)}: defined in the training script or nowhere importable; define them above Repro")
    about.append("inputs:   inputs.pt (the graph's example inputs in the failing step, and the RNG state)")
    return about


# -- distributed jobs: every rank decides each step together ---------------------------------


def _origin_text(origin) -> str:
    """``rank 1 made it: nan in aten.sqrt.default at train.py:12 (forward)`` (``origin``: a ``Made``)."""
    return f"rank {origin.rank} made it: {origin.kind} in {origin.op} at {origin.where} ({origin.phase})"


def _missing_text(ranks) -> str:
    """``; rank 1 did not report what its replay found within 30 s`` (``ranks``: a RankOrigin)."""
    if not ranks.missing:
        return ""
    listed = ", ".join(str(rank) for rank in ranks.missing)
    several = len(ranks.missing) > 1
    return f"; rank{'s' if several else ''} {listed} did not report what {'their replays' if several else 'its replay'} found within {ranks.timeout:g} s"


def ranks_text(ranks) -> str:
    """The ``ranks:`` line: which rank made the nan/inf (facts exchanged after every rank replayed)."""
    if ranks.origin is None:
        head = "no rank's replay found where it was made"
    elif ranks.origin.rank == ranks.rank:
        head = f"this rank (rank {ranks.rank}) made it"
    else:
        head = _origin_text(ranks.origin)
    return head + "; every rank replayed this step (the ranks decide each step's failure together)" + _missing_text(ranks)


def failed_elsewhere(call, name, failure, buffers, ranks) -> str:
    """A rank whose own replay found no origin while another rank made the nan/inf."""
    return (
        f"opwatch.guard (rank {ranks.rank}): call {call} of {name} failed on another rank: {_origin_text(ranks.origin)}. "
        f"Here {failure_text(failure)}; this rank replayed the step with the others ({restored(buffers)}) and found no origin"
        + _missing_text(ranks) + "; the error on that rank names the origin's line, and its repro lives there."
    )


def poisoned_elsewhere() -> str:
    """The parameters that hold nan/inf when they are another rank's shards."""
    return "parameters of another rank (their shards on this rank are finite)"


_WAITED = {
    "flag": "the failure flag of call {call} of {name} (every rank's guard decides each step's failure together)",
    "gradients": "the check of the gradients before optimizer step {call} (every rank decides each optimizer step together)",
    "left": "the end of the program, which raised before optimizer step {call} ({detail})",
    "poisoned": "the question whether the parameters hold nan/inf after call {call} of {name}",
    "scaler_loss": ("the question whether the loss of the step GradScaler skipped after optimizer step {call} was finite before it "
                    "was scaled (every rank counts GradScaler's skips alike)"),
    "raised": "call {call} of {name}, which raised there ({detail}), on its way to the failure flag",
}


def _waited(where) -> str:
    return _WAITED.get(where.get("waited"), "{waited} of call {call} of {name}").format(
        call=where.get("call"), name=where.get("name"), waited=where.get("waited"), detail=where.get("detail", "")
    )


def no_answer(rank, here, others, silent, timeout, error_line) -> str:
    """A rank timed out waiting for the others at one of the guard's own waits."""
    within = f"within {timeout:g} s" if timeout is not None else "within the process group's timeout"
    late = sorted(silent) or sorted(others)  # silent ones, else the ones that were somewhere else
    listed = ", ".join(str(other) for other in late)
    text = f"opwatch.guard (rank {rank}): rank{'s' if len(late) > 1 else ''} {listed} did not answer {within}: this rank waited at {_waited(here)}"
    for other in sorted(others):
        text += f"; rank {other} was at {_waited(others[other])}"
    if silent:
        text += (
            f"; rank{'s' if len(silent) > 1 else ''} {', '.join(str(other) for other in silent)} said nothing: "
            "crashed, hangs in a collective of its own, or ran a different number of guarded steps"
        )
    return text + f" ({error_line}). Set OPWATCH_COLLECTIVE_TIMEOUT (seconds) to wait longer or less."


def _ranks_list(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} " + ", ".join(str(rank) for rank in ranks)


def raised_elsewhere(rank, call, name, other, error_type, where, line, more) -> str:
    """A rank whose step ``call`` ran while rank ``other``'s raised ``error_type`` at ``where``."""
    what = f"raised {error_type}" if error_type else "raised"
    at = f" at {where}" if where else ""
    said = f" ({line})" if line else ""
    also = f"; {_ranks_list(more)} raised too" if more else ""
    return (
        f"opwatch.guard (rank {rank}): call {call} of {name} raised on another rank: rank {other} {what}{at}{said}{also}. "
        "Every rank stops at this step (the ranks decide each step together); no rank replays it, since a replay would run "
        "collectives the raising rank does not reach. The .grad are as the step found them; the error on that rank has the traceback."
    )


def returned_here_only(call: int, name: str, rank: int) -> str:
    """A DDP job: what this rank's step returned is not finite while the reduced gradients, the
    same on every rank, are: told by this rank, and the step goes on alike on every rank."""
    return (
        f"opwatch.guard (rank {rank}): call {call} of {name} returned nan/inf on this rank, while the gradients DDP reduced across "
        "the ranks are finite: the step goes on alike on every rank (they decide from what they share, so that their weights "
        "never drift apart)."
    )


def raised_here_shared_note(rank, world) -> str:
    """The note on the exception of a rank whose step raised, in a DDP job whose healthy steps
    meet no flag of opwatch's (their reduced gradients decide them alike on every rank)."""
    return (
        f"opwatch.guard (rank {rank}): this rank's step raised. The model is DDP's: its reduced gradients decide each healthy step "
        f"alike on the {world} ranks, so opwatch runs no collective of its own there and the other ranks are not told by opwatch "
        "(they stop at DDP's next collective, within the process group's timeout). It is not replayed under a full watch in a job "
        "of several ranks: the replay would run collectives the other ranks do not."
    )


def raised_here_note(rank, decision_raised, world) -> str:
    """The note on the exception of a rank whose step raised, in a distributed job."""
    others = [other for other in decision_raised if other != rank]
    also = f" ({_ranks_list(others)} raised too)" if others else ""
    return (
        f"opwatch.guard (rank {rank}): this rank's step raised{also}; every one of the {world} ranks stops at this step with an error "
        "naming this rank and this line (the ranks decide each step together). It is not replayed under a full watch in a job of "
        "several ranks: the replay would run collectives the other ranks do not. Run the step under opwatch.watch() on this rank "
        "to see the ops before the raise."
    )
