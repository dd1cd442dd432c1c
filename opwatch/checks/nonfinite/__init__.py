"""nan / inf origins, found with batched, sync-free checks.

On a GPU, ``bool(t.isnan().any())`` after every op stalls the pipeline at every op. Instead,
each floating output gets one reduction, ``torch.aminmax``, whose two results stay on the
tensor's device (written into two slots of a small buffer of that device and dtype): nan shows
as a nan min/max, inf as an infinite max or min. The results are read back in one batch (one
transfer per device) at a *check point*:
the end of the block, ``Watch.check()``/``Watch.step()``, a value the program itself reads on
the host from a device where flags wait (``.item()``, ``bool(t)``, ``torch.equal``, and a copy
of a device tensor to the CPU, which printing a CUDA tensor does), and at the latest every
``max_records`` ops. Printing a CPU tensor and ``.tolist()`` run no op opwatch can see and are
not check points.

At a check point the op log is replayed over tensor identities to tell origins from
propagation:

- an op is an **origin** when an output holds nan or inf while every input was finite (its
  kind is what the output held: nan wins over inf). Later ops fed by it are counted as its
  spread, not reported again, also where they turn its inf into nan (``inf - inf``);
- ops that write uninitialised memory (``empty*``) are not checked and carry no earlier
  state; deliberate constants are never origins, though what they feed is tracked: explicit
  non-finite arguments (``full(-inf)``, ``masked_fill(mask, -inf)``, ``where(c, x, -inf)``),
  Python data (``m[mask] = float("-inf")``: lifts are checked, and non-finite there is on
  purpose), and ``finfo.max``/``finfo.min`` as an argument or held by an input; but nan made
  from inputs whose only non-finite values were deliberate infs (a softmax over a fully
  masked row) is an origin, and so is a forward reduction that took them into its inf result
  (a sum over masked log-probabilities: ``cross_entropy`` with ``label_smoothing``) once its
  values are the loss (one value) and reach a sink; one that reaches no loss is not reported;
- an origin **matters** once its values reach a sink: a host read, an ``nn.Parameter``
  written by an op, a ``.grad`` accumulation, a forward op that picks indices by comparing nan
  values (``argmax``, ``topk``: greedy decoding over nan logits), or a
  program-chosen check point (the end of the
  block, ``Watch.check()``) while still alive. Alive at another check point, it waits (autograd
  keeps a softmax output until backward). Values that died first were absorbed, and so were
  overflows GradScaler found in the scaled gradients: reported as *contained*, not anomalies;
- a write through a view lands in its base; unchecked outputs (sparse, subclasses) hold what
  their inputs held; a forward op recomputed in backward (checkpointing) is the same origin;
- float8 outputs are read through a float16 copy (no reduction takes float8);
- float16 forward outputs within ``HEADROOM_FACTOR`` of the float16 limit are reported as
  ``overflow_risk`` before they overflow.

Collectives (``torch.distributed``) are read once they have completed, not when their op
returns (see :mod:`.collectives`). A nan/inf in a collective's output whose inputs on this rank
were finite was **received** from another rank: reported as received through that
collective, never as an origin (the combined summary names the rank that made it).

Every origin gets a cause (:mod:`.cause`), decided when its check point is read: an input or a
parameter that already held the value (a batch made before the watch, a tensor from
``torch.from_numpy``, a poisoned weight), precision (finite when the op runs in float32/float64)
or undefined math (``log(0)``, ``0 / 0``). A forward overflow with a precision cause matters
even when a later op absorbs it (``rsqrt(inf) = 0``).

The package, one job a module: :mod:`.rules` (what is checked, deliberate values, headroom),
:mod:`.tracker` (the flags on the hot path, read at a check point), :mod:`.replay` (the replay
that judges origins), :mod:`.collectives` (collectives' outputs until read, received values),
:mod:`.origin` (origins and risks as facts), :mod:`.cause` (why an origin's values are not finite),
:mod:`.aliases` (which tensors share storage, for writes in place). Every sentence is made in
:mod:`opwatch.render.nonfinite`.
"""

from __future__ import annotations

from .origin import Origin, OverflowRisk, Verdict, verdict
from .rules import HEADROOM_FACTOR, KINDS, NAME, RISK_KIND
from .tracker import EarlierBlocks, NonFiniteTracker

__all__ = ["NAME", "KINDS", "RISK_KIND", "HEADROOM_FACTOR", "EarlierBlocks", "NonFiniteTracker", "Origin", "OverflowRisk", "Verdict", "verdict"]
