"""Every private torch API opwatch uses, in one place: the torch version that has it, and what
opwatch does without it. Nothing else in opwatch reaches into ``torch._C`` or private modules.

The package supports ``torch >= 2.5``; an entry without a fallback exists in every such torch.
"""

from __future__ import annotations

import torch

__all__ = [
    "get_sequence_nr",
    "current_autograd_node",
    "inference_mode_enabled",
    "no_python_dispatch",
    "dispatch_modes_outside",
    "engine_entry_code",
    "skip_dynamo_for_code",
    "SKIPS_DYNAMO_PER_CODE",
]

# The thread's autograd sequence counter: a forward op that creates an autograd node bumps it,
# and the node remembers the number (``node._sequence_nr()``). torch >= 1.8; no fallback needed.
get_sequence_nr = torch._C._autograd._get_sequence_nr

# The autograd node the engine is running on this thread, ``None`` outside backward.
# torch >= 2.0.
current_autograd_node = torch._C._current_autograd_node

# Whether inference mode is on (views made in it have no ``_base`` link). torch >= 1.9.
inference_mode_enabled = torch._C.is_inference_mode_enabled

# A context manager that turns Python dispatch off: no dispatch mode, ours or another, sees
# the ops run inside it (opwatch's own reductions and read-backs). torch >= 1.13.
no_python_dispatch = torch._C._DisableTorchDispatch

# How many dispatch modes are on the thread's stack right now (inside ``__torch_dispatch__``
# ours is popped, so a non-zero count means modes entered outside opwatch). torch >= 2.0.
dispatch_modes_outside = torch._C._len_torch_dispatch_stack


def engine_entry_code():
    """The code object of torch's Python entry into the C++ autograd engine
    (``torch.autograd.graph._engine_run_backward``, torch >= 2.2): a frame walk that meets it
    knows the op is run by the engine. ``None`` on older torch: backward ops are then told by
    ``current_autograd_node()`` alone."""
    from torch.autograd import graph

    run = getattr(graph, "_engine_run_backward", None)
    return getattr(run, "__code__", None)


try:  # torch >= 2.6: per-code-object frame strategies for TorchDynamo
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

    _SKIP_THIS_AND_CALLEES = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
    SKIPS_DYNAMO_PER_CODE = True
except (ImportError, AttributeError):  # older torch: TorchDispatchMode's own wrapper does it
    SKIPS_DYNAMO_PER_CODE = False


def skip_dynamo_for_code(code) -> None:
    """Make TorchDynamo run frames of ``code``, and every frame they call, uncompiled (as
    ``torch._dynamo.disable`` does, without its per-call Python wrapper or importing Dynamo).
    A no-op where ``SKIPS_DYNAMO_PER_CODE`` is false: there ``TorchDispatchMode`` wraps
    ``__torch_dispatch__`` in ``torch._dynamo.disable`` itself."""
    if SKIPS_DYNAMO_PER_CODE:
        set_code_exec_strategy(code, _SKIP_THIS_AND_CALLEES)
