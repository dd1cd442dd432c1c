"""Why a backward raised torch's "one of the variables needed for gradient computation has been
modified by an inplace operation": the op whose backward needed the tensor, and the in-place op
that wrote into it after it was saved.

torch's message names the tensor's shape and version and the node that made it, but no line;
``detect_anomaly`` adds the forward line of the op whose backward failed, not the write. The
watch holds both: the autograd graph under the tensors ``backward()`` ran on still holds the
node that failed (its saved tensor raises the same error when read: one pass over the graph,
after the error only), the node's sequence number gives its forward op's line
(:class:`~opwatch.modes.interceptor.OpInterceptor` keeps them for backward ops), and the log holds
that op's tensors (their ``id()``) and every op that wrote into one of them, or into a view of
it, since. Nothing here runs on a healthy op.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from itertools import islice

from ..core.compat import autograd_sequence_nr, modified_saved_tensors
from ..core.records import (
    BACKWARD, E_FUNC, E_INDEX, E_MODULE, E_PHASE, E_SITE, M_IDENT, M_SHAPE, OpRecord, entry_inputs, entry_outputs,
)

__all__ = ["OverwrittenSave", "overwritten_save"]

_MAX_WRITERS = 3  # the writes told; a loop that writes the tensor each pass is one story
_MAX_CANDIDATES = 32  # calls at the op's line searched, newest first (each a pass over the log)
_TENSOR_IN_MESSAGE = re.compile(r"\[[\w.]+ \[([\d, ]*)\]\]")  # [torch.FloatTensor [8, 32]]


@dataclass(frozen=True)
class OverwrittenSave:
    """The facts of a backward that met a saved tensor written in place: ``needed_by``, the
    forward op whose backward needed it (its record); ``saved``, the name its backward gives
    it (``"result"``, ``"self"``, ``"mat2"``); ``writers``, the records of the ops that wrote
    into it (or a view of it) after that op, oldest first (at most ``_MAX_WRITERS``; ``()``
    when the log no longer holds them); ``tensor``, its :class:`~opwatch.core.records.TensorMeta`
    as that op saw it (``None`` where its tensors of that shape are not one)."""

    needed_by: OpRecord
    saved: str
    writers: tuple
    tensor: object = None


def overwritten_save(error: BaseException, roots, log, forward_sites: dict, started: int) -> OverwrittenSave | None:
    """What made the backward from ``roots`` raise ``error``, or ``None`` where it is not torch's
    in-place error or the watch does not hold the op. ``log``: the watch's
    :class:`~opwatch.core.records.OpLog`; ``forward_sites``: the interceptor's
    ``{sequence number: (site, module, op id)}``; ``started``: the index of the first op of
    that backward (the ops before it include the forward)."""
    text = str(error)
    node, saved = next(((node, saved) for node, saved, message in modified_saved_tensors(roots) if text.startswith(message)),
                       (None, None))
    if node is None:
        return None
    site, module, func_id = forward_sites.get(autograd_sequence_nr(node), (None, None, None))
    if site is None:
        return None
    shape = _shape_in(text)
    candidates = list(islice((entry for entry in reversed(log.entries)
                              if entry[E_INDEX] < started and entry[E_PHASE] != BACKWARD and entry[E_FUNC] == func_id
                              and entry[E_SITE] == site and entry[E_MODULE] == module), _MAX_CANDIDATES))
    # The newest call at that line whose saved tensor was written since (a loop runs it again).
    for entry in candidates:
        writers = _writers(log, entry, saved, shape)
        if writers:
            return OverwrittenSave(log.view(entry), saved, writers, _saved_meta(log.view(entry), saved, shape))
    newest = next(iter(candidates), None)
    if newest is None:
        return None
    needed = log.view(newest)
    return OverwrittenSave(needed, saved, (), _saved_meta(needed, saved, shape))


def _saved_tensors(tensors, shape: tuple | None) -> list:
    return [meta for meta in tensors if shape is None or meta[M_SHAPE] == shape]


def _saved_meta(record: OpRecord, saved: str, shape: tuple | None):
    """The saved tensor's metadata as ``record`` saw it, where one tensor of that shape fits."""
    fitting = _saved_tensors((record.outputs or ()) if saved.startswith("result") else record.inputs, shape)
    return next(iter(fitting)) if len({meta.ident for meta in fitting}) == 1 else None


def _shape_in(text: str) -> tuple | None:
    """The shape torch's message gives the tensor (``[torch.FloatTensor [8, 32]]``), or ``None``."""
    match = _TENSOR_IN_MESSAGE.search(text)
    if match is None:
        return None
    sizes = match.group(1).replace(" ", "")
    return tuple(int(size) for size in sizes.split(",")) if sizes else ()


def _writers(log, entry: tuple, saved: str, shape: tuple | None) -> tuple:
    """The ops after ``entry`` that wrote into its tensor named ``saved`` (an output for
    ``result``, else an input) of ``shape``, or into a view of it or of what it views."""
    tensors = (entry_outputs(entry) or ()) if saved.startswith("result") else entry_inputs(entry)
    family = {meta[M_IDENT] for meta in _saved_tensors(tensors, shape)}
    for ident in list(family):  # what it views (a weight's transpose viewed the weight)
        family |= _bases(log, ident, entry[E_INDEX])
    writers = []
    for later in log.entries:
        if later[E_INDEX] <= entry[E_INDEX] or later[E_PHASE] == BACKWARD:
            continue
        inputs = entry_inputs(later)
        if not inputs:
            continue
        viewed, written = _aliasing(log.funcs[later[E_FUNC]], len(inputs))
        first, *_ = inputs
        if viewed and first[M_IDENT] in family:
            family.update(meta[M_IDENT] for meta in entry_outputs(later) or ())
        if any(inputs[position][M_IDENT] in family for position in written):
            writers.append(log.view(later))
            if len(writers) == _MAX_WRITERS:
                break
    return tuple(writers)


def _bases(log, ident: int, before: int) -> set:
    """The tensors ``ident`` is a view of, through the view ops the log holds before op ``before``."""
    bases = set()
    for _ in range(8):  # a view of a view, a few deep
        maker = log.producer_of(ident, before=before)
        if maker is None:
            break
        inputs = maker.inputs
        viewed, _ = _aliasing(maker.func, len(inputs))
        if not viewed or not inputs:
            break
        first, *_ = inputs
        ident, before = first.ident, maker.index
        bases.add(ident)
    return bases


@lru_cache(maxsize=1024)
def _alias_schema(func) -> tuple:
    """``(returns a view of its first argument, (kind, how many tensor arguments) of each
    argument written in place)`` from ``func``'s schema; kind ``"first"`` (``self``: a tensor,
    or a list every list argument's length shares), ``"out"`` (an ``out=`` argument, last)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return False, ()
    alias = next((returned.alias_info for returned in schema.returns), None)
    viewed = alias is not None and not alias.is_write
    lists = sum(str(argument.type).startswith("List[Tensor") for argument in schema.arguments)
    written = []
    for number, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        if number == 0:
            written.append(("first", lists))
        elif argument.kwarg_only:
            written.append(("out", 0))
    return viewed, tuple(written)


def _aliasing(func, count: int) -> tuple:
    """``(returns a view of input 0, positions among the ``count`` tensor inputs it writes)``."""
    viewed, written = _alias_schema(func)
    positions = []
    for kind, lists in written:
        if kind == "out":
            positions.append(count - 1)
        elif lists:  # a foreach op: its lists share one length
            positions.extend(range(count // lists))
        else:
            positions.append(0)
    return viewed, positions
