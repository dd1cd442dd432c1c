"""The sentences of the dtype_mismatch rules (:mod:`opwatch.checks.dtype`).

Facts of each rule (``names``: the tensor arguments' names; ``operands``: their metadata):

- ``dtype.silent_upcast``: ``first`` and ``second`` (the first two floating dtypes met),
  ``dtypes`` (every floating dtype of the non-scalar operands), ``result`` (the promoted
  dtype), ``count`` (how many non-scalar floating operands), ``names``, ``common`` (the dtype
  of the operands that are not odd: the one the rest of the program uses, named by the fix).
- ``dtype.one_dtype``: ``op``, ``dtypes`` (in order of appearance), ``names``, ``common`` (the
  dtype of the operands that are not odd).
- ``dtype.arg_dtype``: ``op``, ``arg`` (``mask``, ``index``), ``got``, ``accepted`` (the
  dtypes the kernel takes there, preferred first), ``names``.
- ``dtype.index_dtype``: ``op``, ``position`` (1 for the first index), ``index``, ``indexed``.
- ``dtype.loss_target``: ``op`` (``mse_loss``), ``got`` (the target's dtype: another floating
  one, or an integer one where the loss's backward raises for it, ``huber_loss``), ``wanted``
  (the input's), ``promoted``, ``names``.
- ``dtype.loss_floating_target``: ``op``, ``got``, ``wanted``, ``names``.
- ``dtype.class_target``: ``got``, ``floating`` (whether ``got`` is floating), ``target_shape``, ``input_shape``, ``names``.
"""

from __future__ import annotations

import torch

from ..core.notation import format_dtype as _name
from ..core.notation import format_meta
from .phrases import named
from .rules import explains

# What a target of another floating dtype does in each elementwise loss (torch 2.13, CPU).
_LOSS_CONSEQUENCES = {
    "mse_loss": "promotes silently: the loss and its backward run in {promoted}",
    "smooth_l1_loss": "promotes silently: the loss and its backward run in {promoted}",
    "binary_cross_entropy_with_logits": "takes the target's dtype: the loss and its backward run in {target}",
    "huber_loss": "passes in forward, then the backward raises 'Found dtype {target_torch} but expected {input_torch}'",
    "soft_margin_loss": "converts the target to {input} on every call",
    "binary_cross_entropy": "raises 'Found dtype {target_torch} but expected {input_torch}'",
}
# How torch's own messages name dtypes.
_TORCH_NAMES = {
    torch.float64: "Double", torch.float32: "Float", torch.bfloat16: "BFloat16", torch.float16: "Half",
    torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte", torch.bool: "Bool",
}


@explains("dtype.silent_upcast")
def explain_silent_upcast(finding) -> tuple[str, str, str]:
    facts = finding.facts
    dtypes, first, result = facts.dtypes, facts.first, facts.result
    names = sorted(_name(d) for d in dtypes) if len(dtypes) > 2 else [_name(first), _name(facts.second)]
    problem = (
        f"silent promotion {' with '.join(names)} -> {_name(result)}: "
        f"{named(facts.names, finding.operands)}. The op runs in {_name(result)}, and so does every op "
        f"that uses its result until it is cast back."
    )
    expected = f"one floating dtype for all non-scalar operands (got {facts.count} operands in {', '.join(names[:-1])} and {names[-1]})"
    # The dtype the rest of the program uses, whichever side the odd operand is on (logs
    # exported before the fact existed: the narrowest dtype mixed).
    common = facts.common
    return problem, expected, _upcast_fix(finding, _name(common))


def _upcast_fix(finding, common: str) -> str:
    """Where to cast, by where the odd operand came from: a module's own tensor, or elsewhere
    (numpy, most often)."""
    for made in finding.made or ():
        how = getattr(made, "how", None)
        detail = getattr(made, "detail", None)
        if how in ("parameter", "buffer", "attribute"):
            kind, owner = how, made
        elif getattr(detail, "how", None) == "from_module":
            kind, owner = detail.kind, detail
        elif getattr(detail, "how", None) == "computed_from":
            return (
                f"it is computed from the {detail.kind} {detail.name} of {detail.path} ({detail.cls}), which is not in "
                f"{common}: a module kept in another dtype (transformers' _keep_in_fp32_modules) must cast its output "
                f"back (.to({common})) before it joins the rest, or run in the model's dtype"
            )
        else:
            continue
        return (
            f"the {kind} {owner.name} of {owner.path or owner.cls} is not in {common}: make it in the model's dtype "
            f"(torch.FloatTensor(...) and dtype=torch.float32 make float32 whatever the model's dtype), "
            f"or cast it where it is used (.to(other.dtype))"
        )
    return (
        f"cast where the odd tensor is made, e.g. torch.from_numpy(a).to({common}) or "
        f".to(other.dtype); torch.set_default_dtype is not the cause when numpy made the array"
    )


@explains("dtype.one_dtype")
def explain_one_dtype(finding) -> tuple[str, str, str]:
    facts = finding.facts
    dtypes = facts.dtypes
    # The dtype of the operands that are not odd first (logs exported before: in order met).
    common = facts.common
    other = next(d for d in dtypes if d != common)
    return (
        f"{facts.op} needs one dtype for all operands, got {', '.join(_name(d) for d in dtypes)}: {named(facts.names, finding.operands)}",
        f"every operand in {_name(common)} (or all in {_name(other)})",
        "cast one side where it is made (.to(x.dtype)); a stray .double() or a float64 numpy array is the usual cause",
    )


@explains("dtype.arg_dtype")
def explain_arg_dtype(finding) -> tuple[str, str, str]:
    facts = finding.facts
    arg, accepted = facts.arg, facts.accepted
    wanted = " or ".join(_name(d) for d in accepted)
    return (
        f"argument {arg!r} is {_name(facts.got)} but {facts.op} needs {wanted}: {named(facts.names, finding.operands)}",
        f"{arg} as {wanted}",
        f"build it as {wanted} (e.g. {arg}.to({accepted[0]}) or dtype={accepted[0]} where it is made)",
    )


@explains("dtype.index_dtype")
def explain_index_dtype(finding) -> tuple[str, str, str]:
    facts = finding.facts
    problem = (
        f"index tensor {format_meta(facts.index)} (index #{facts.position}) of {facts.op} "
        f"is neither integer nor bool: indexed tensor {format_meta(facts.indexed)}. torch raises "
        f"'tensors used as indices must be long, int, byte or bool tensors'"
    )
    fix = (
        "idx.long() where the positions are computed (arange/linspace/division of floats"
        " makes floating positions), or build a bool mask with a comparison"
    )
    return problem, "index tensors as i64 or i32 (positions) or bool (a mask)", fix


@explains("dtype.loss_target")
def explain_loss_target(finding) -> tuple[str, str, str]:
    facts = finding.facts
    got, wanted = facts.got, facts.wanted
    consequence = _LOSS_CONSEQUENCES[facts.op].format(
        promoted=_name(facts.promoted), target=_name(got), input=_name(wanted),
        target_torch=_TORCH_NAMES.get(got, _name(got)), input_torch=_TORCH_NAMES.get(wanted, _name(wanted)),
    )
    target = f"a {_name(got)} target" if got.is_floating_point else f"an integer target ({_name(got)})"
    return (
        f"{facts.op} gets {target} for a {_name(wanted)} input: {named(facts.names, finding.operands)}. It {consequence}.",
        f"target in the input's dtype ({_name(wanted)})",
        f"cast the target where it is made, e.g. torch.from_numpy(y).to({wanted}) or target.to(pred.dtype)",
    )


@explains("dtype.loss_floating_target")
def explain_loss_floating_target(finding) -> tuple[str, str, str]:
    facts = finding.facts
    got, wanted = facts.got, facts.wanted
    problem = (
        f"{facts.op} needs a floating target, got {_name(got)}: {named(facts.names, finding.operands)}. "
        f"torch raises a cast error ('result type Float can't be cast to the desired output type ...')"
    )
    return (
        problem,
        f"target as {_name(wanted)}, like the input (0/1 labels as floats)",
        f"target.to({wanted}) where the labels are made (multi-hot labels are often built as i64)",
    )


@explains("dtype.class_target")
def explain_class_target(finding) -> tuple[str, str, str]:
    facts = finding.facts
    got = facts.got
    problem = f"class-index target of nll_loss/cross_entropy is {_name(got)}, but the kernel needs i64: {named(facts.names, finding.operands)}"
    if facts.floating:
        problem += (
            f". A floating target of shape {list(facts.target_shape)} holds class indices stored as floats;"
            f" cross_entropy takes floating targets only as class probabilities, shaped like the input"
        )
        fix = (
            "target.long() where the labels are made; for class probabilities (soft labels) give"
            f" cross_entropy a floating target of the input's shape {list(facts.input_shape)}"
        )
    else:
        fix = "target.long() where the labels are made (numpy int32 arrays and torch.int32 data loaders are the usual source)"
    return problem + "; torch raises 'expected target dtype to be Long or Byte'", "class indices as i64", fix
