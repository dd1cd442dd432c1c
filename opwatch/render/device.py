"""The sentences of the device_mismatch rules (:mod:`opwatch.checks.device`).

Facts of each rule:

- ``device.mix``: ``devices`` (the non-scalar operands' devices as strings, in order of
  appearance), ``names`` (the tensor arguments' names), ``target`` (the device the odd one out
  should move to); ``operands``: every tensor argument.
- ``device.index``: ``op`` (``index``, ``index_put_``), ``position`` (1 for the first index),
  ``indexed`` and ``index`` (the two tensors' metadata).
- ``device.joined`` (cat/stack): the facts of ``device.mix``, 0-dim CPU tensors counted.
- ``device.scalar_written``: ``written`` (the name of the 0-dim CPU tensor written in place),
  ``device`` (another operand's device, a string), ``names``; ``operands``: every tensor argument.
"""

from __future__ import annotations

from ..core.notation import format_meta
from .phrases import named
from .rules import explains

__all__ = ["meta_note"]


def meta_note(devices) -> str:
    """What a ``meta`` device among ``devices`` (strings) means, appended to a problem."""
    if "meta" not in devices:
        return ""
    return (
        " A 'meta' tensor has no data: a module or tensor was left on the meta device"
        " (e.g. built under torch.device('meta') and never materialised with to_empty())."
    )


@explains("device.mix")
def explain_mix(finding) -> tuple[str, str, str]:
    facts = finding.facts
    devices = facts.devices
    return (
        f"tensor arguments on different devices ({', '.join(devices)}): {named(facts.names, finding.operands)}.{meta_note(devices)}",
        "every non-scalar tensor argument on one device",
        f"create or move the odd one out with device=... / .to({facts.target!r}) where it is made",
    )


@explains("device.index")
def explain_index(finding) -> tuple[str, str, str]:
    facts = finding.facts
    indexed, index = facts.indexed, facts.index
    devices = [str(indexed.device), str(index.device)]
    indexed_on, index_on = devices
    problem = (
        f"index tensor {format_meta(index)} (index #{facts.position}) of {facts.op} is on "
        f"{index_on}, the indexed tensor {format_meta(indexed)} on {indexed_on}.{meta_note(devices)}"
    )
    if indexed_on == "cpu":
        expected = "index tensors on the CPU, like the indexed tensor"
    else:
        expected = f"index tensors on the indexed tensor's device ({indexed_on}) or on the CPU"
    fix = (
        f"make the index on {indexed_on!r} (device=... where it is made, or .to(x.device)); a buffer left on "
        f"the meta device is materialised with module.to_empty() or by creating it again"
    )
    return problem, expected, fix


@explains("device.joined")
def explain_joined(finding) -> tuple[str, str, str]:
    facts = finding.facts
    devices = facts.devices
    return (
        f"tensors joined from different devices ({', '.join(devices)}): {named(facts.names, finding.operands)}; "
        f"cat and stack take no CPU scalars, every tensor (0-dim ones too) must be on one device.{meta_note(devices)}",
        "every tensor joined on one device",
        f"move the odd one out with .to({facts.target!r}) (a 0-dim CPU tensor from torch.tensor(x): give it device=)",
    )


@explains("device.scalar_written")
def explain_scalar_written(finding) -> tuple[str, str, str]:
    facts = finding.facts
    device = facts.device
    return (
        f"a 0-dim CPU tensor ({facts.written}) is written in place from an operand on {device}: "
        f"{named(facts.names, finding.operands)}. A CPU scalar may be read by an op on {device}, not written by one "
        f"(on CUDA torch raises; on meta it passes silently).{meta_note([device])}",
        f"the tensor written on {device}, like the operands",
        _written_fix(facts.written, device),
    )


def _written_fix(written: str, device: str) -> str:
    if written == "out":
        return f"make the out= tensor on {device} (torch.empty((), device=x.device)), or drop out= and keep the result"
    return (
        f"make the accumulator on {device} (torch.zeros((), device=x.device)) and read it once at the end, "
        f"or add a Python number (total += loss.item(), a host sync per step)"
    )
