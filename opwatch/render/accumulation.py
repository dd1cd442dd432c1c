"""The sentences of the rules on writes into a tensor (:mod:`opwatch.checks.accumulation`).

Facts of each rule (``names``: the tensor arguments' names; ``operands``: their metadata):

- ``dtype.write_source``: ``op`` (``index_add_``), ``target`` and ``source`` (the metadata of
  ``self`` and of the source written into it), ``source_name`` (``source``, ``src``,
  ``values``, ``end``), ``source_wider`` (whether the source's floating dtype is more precise
  than ``self``'s: f32 into bf16, f64 into f32), ``names``.
- ``dtype.narrowing_write``: ``op`` (``add_``), ``written`` (the name of the tensor written:
  ``self`` or ``out``), ``target`` (its metadata), ``source`` (the first operand of a more
  precise dtype), ``computed`` (the dtype the op computes in), ``names``.
"""

from __future__ import annotations

import torch

from ..core.notation import format_dtype, format_meta
from .phrases import named
from .rules import explains


@explains("dtype.write_source")
def explain_write_source(finding) -> tuple[str, str, str]:
    facts = finding.facts
    target, source, name = facts.target, facts.source, facts.source_name
    wanted, got = target.dtype, source.dtype
    problem = (
        f"{facts.op} writes {name} {format_meta(source)} into self {format_meta(target)}; its kernel takes the "
        f"{name} in self's dtype only and raises on any other: {named(facts.names, finding.operands)}"
    )
    return problem, f"{name} in {format_dtype(wanted)}, like self", _write_fix(name, wanted, got, facts.source_wider)


def _write_fix(name: str, wanted: torch.dtype, got: torch.dtype, wider: bool) -> str:
    cast = f"cast the {name} where it is made ({name}.to({wanted}), or dtype= at its factory)"
    if got == torch.float64:
        return cast + "; float64 usually comes from numpy (torch.from_numpy(a).float())"
    if wider:
        return (
            f"{cast}: routing weights kept in {format_dtype(got)} on purpose are cast with the weighted expert output, "
            f"(out * weight).to(buf.dtype); or make the buffer {format_dtype(got)} to accumulate in {format_dtype(got)} "
            f"and cast it once at the end"
        )
    return cast


@explains("dtype.narrowing_write")
def explain_narrowing_write(finding) -> tuple[str, str, str]:
    facts = finding.facts
    target, source, computed, written = facts.target, facts.source, facts.computed, facts.written
    low, high = format_dtype(target.dtype), format_dtype(computed)
    problem = (
        f"{facts.op} computes in {high} ({format_meta(source)}) and rounds the result into {written} "
        f"{format_meta(target)} silently: {named(facts.names, finding.operands)}. Accumulated in {low}, every step "
        f"loses what {low} cannot hold (small updates to a running sum or average vanish)"
    )
    made = "the out= tensor" if written == "out" else "the accumulator"
    fix = (
        f"accumulate in {high} (make {made} with dtype={computed} and cast it once at the end), or add out of place "
        f"(x = x + y keeps {high}); where rounding to {low} is meant, cast the operand: y.to({target.dtype})"
    )
    return problem, f"the tensor written in the dtype of what is added to it ({high})", fix
