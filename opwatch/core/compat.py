"""Every private torch API opwatch uses, in one place: the torch version that has it, and what
opwatch does without it. Nothing else in opwatch reaches into ``torch._C`` or private modules.

The package supports ``torch >= 2.6`` (tested: 2.6.0 and 2.14.1 besides 2.13.0); an entry without a
fallback exists in every such torch.
"""

from __future__ import annotations

import functools
import gc
import operator
import os
import sys
import types

import torch

__all__ = [
    "get_sequence_nr",
    "MODIFIED_SAVED_TENSOR",
    "modified_saved_tensors",
    "current_autograd_node",
    "inference_mode_enabled",
    "no_python_dispatch",
    "no_torch_function",
    "dispatch_modes_outside",
    "function_mode_alone",
    "sole_function_mode",
    "unseen_by_dispatch_modes",
    "take_function_mode_off",
    "put_function_mode_back",
    "optimizer_step_runs_only",
    "engine_entry_code",
    "restore_caller_state",
    "amp_non_finite_check",
    "foreach_norm",
    "foreach_copy_",
    "TOTAL_NORM_HOME",
    "CLIP_HOME",
    "takes_found_inf",
    "version_counter",
    "version_counters",
    "unbox_process_group",
    "unbox_work",
    "resolve_process_group",
    "default_store",
    "script_object_type",
    "skip_dynamo_for_code",
    "SKIPS_DYNAMO_PER_CODE",
    "dynamo_loaded",
    "force_eager_stance",
    "force_backend_stance",
    "count_compiled_calls",
    "aot_eager_with",
    "aot_backend_parts",
    "aot_backend_with",
    "inductor_with_inner",
    "graph_module_behind",
    "dtensor_shard",
    "compiled_module_inner",
    "module_class_name",
    "pack_padded_sequence_function",
    "op_kernel",
    "autograd_sequence_nr",
    "tensor_base",
    "is_zerotensor",
    "hooks_dict_of",
    "dtensor_class",
    "dtensor_parts",
    "frame_backends",
    "compiled_code_set_aside",
    "registered_backend",
    "backend_identity",
    "is_inductor",
    "inductor_settings",
    "NODE_STACK_TRACE",
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
# Every __torch_function__ off for the block, modes included (torch 1.13+): opwatch's own torch
# calls at a check point must not enter its function mode (opwatch.modes.functions).
no_torch_function = torch._C.DisableTorchFunction

# How many dispatch modes are on the thread's stack right now (inside ``__torch_dispatch__``
# ours is popped, so a non-zero count means modes entered outside opwatch). torch >= 2.0.
dispatch_modes_outside = torch._C._len_torch_dispatch_stack


def unseen_by_dispatch_modes(function, *args):
    """``function(*args)``, none of its ops seen by a dispatch mode (an audit's watch, the
    program's own): under ``no_python_dispatch`` where one is on the thread's stack, called as it
    is where none is. Entering torch's guard costs more than the few ops a step's check makes
    (measured inside a training step, where caches are cold: a loss's ``detach()`` 19 us with the
    guard, 4 without), and with no mode on the stack it changes nothing. The per-op observers
    (the nan/inf tracker, fingerprints) write the same test inline: there a call per op costs."""
    if dispatch_modes_outside():
        with no_python_dispatch():
            return function(*args)
    return function(*args)


def function_mode_alone(mode) -> bool:
    """Whether ``mode`` is the one function mode on the thread's stack (torch >= 2.0:
    ``_len_torch_function_stack``, ``_get_function_stack_at``)."""
    return torch._C._len_torch_function_stack() == 1 and torch._C._get_function_stack_at(0) is mode


def sole_function_mode():
    """The function mode on the thread's stack when it is the only one, else ``None``."""
    return torch._C._get_function_stack_at(0) if torch._C._len_torch_function_stack() == 1 else None


# Take the innermost function mode off the thread's stack, and put one back on top (what
# ``TorchFunctionMode.__exit__`` and ``__enter__`` do; torch >= 2.0).
take_function_mode_off = torch._C._pop_torch_function_stack
put_function_mode_back = torch._C._push_on_torch_function_stack


def optimizer_step_runs_only(optimizer, pre_hook_id: int, *, own_post_hook_ids=frozenset()) -> bool:
    """Whether a step of ``optimizer`` runs no optimizer step hook besides the global pre-hook
    ``pre_hook_id``, the last global pre-hook, and opwatch's own post-hooks ``own_post_hook_ids``
    (the per-optimizer one ends a phase span, the global one reads version counters): then
    nothing but torch's and opwatch's own code runs from that hook to the end of the step. The global hooks are the ordered dicts
    ``torch.optim.optimizer._global_optimizer_pre_hooks`` and ``_global_optimizer_post_hooks``,
    the optimizer's own ``_optimizer_step_pre_hooks`` and ``_optimizer_step_post_hooks`` (torch
    >= 2.0). Fallback: ``False`` (other hooks may run)."""
    try:
        from torch.optim import optimizer as optim

        others = [key for hooks in (optimizer._optimizer_step_post_hooks, optim._global_optimizer_post_hooks) for key in hooks if key not in own_post_hook_ids]
        if optimizer._optimizer_step_pre_hooks or others:
            return False
        return next(reversed(optim._global_optimizer_pre_hooks), None) == pre_hook_id
    except Exception:
        return False


# Inside ``__torch_dispatch__`` torch's dispatch machinery excludes some keys (autocast among
# them) from the thread's state; this guard restores the state the op was called with, so that
# ``torch.is_autocast_enabled()`` read inside it is the caller's. Outside ``__torch_dispatch__``
# entering it raises RuntimeError (the state is the caller's already). torch >= 1.13; ``None``
# where missing: autocast then looks off inside a watch.
restore_caller_state = getattr(torch._C, "_RestorePythonTLSSnapshot", None)


# GradScaler's fused finiteness check of a tensor list (torch >= 1.6; a CPU kernel since 2.3):
# ``None`` where missing, and opwatch.guard falls back to ``foreach_norm``.
amp_non_finite_check = getattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None)

# One kernel over a tensor list: norms, and copies into kept tensors. torch >= 2.1.
foreach_norm = torch._foreach_norm
foreach_copy_ = torch._foreach_copy_

# Where ``clip_grad_norm_`` and ``get_total_norm`` compute a total norm: the module global
# ``torch.nn.utils.clip_grad._get_total_norm``, looked up at each call, so a wrap of it sees every
# clip however the program imported ``clip_grad_norm_``. torch >= 2.6 (the supported floor).
TOTAL_NORM_HOME = ("torch.nn.utils.clip_grad", "_get_total_norm")
# What multiplies the gradients by that norm: the same module's ``_clip_grads_with_norm_`` (which
# ``clip_grad_norm_`` calls), and its public name in ``torch.nn.utils`` (torch >= 2.6).
CLIP_HOME = ("_clip_grads_with_norm_", "clip_grads_with_norm_")


def takes_found_inf(optimizer) -> bool:
    """Whether ``optimizer.step()`` reads a ``found_inf`` attribute and skips its update on the
    device when it is nonzero (``_step_supports_amp_scaling``: the fused Adam, AdamW, SGD and
    Adagrad, torch >= 2.0; GradScaler hands its flag over the same way). ``False`` without it."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def version_counter(tensor) -> int:
    """The tensor's version counter, bumped by every in-place write (``Tensor._version``,
    torch >= 1.0): tells whether a step changed a parameter or an argument."""
    return tensor._version


def cuda_initialized() -> bool:
    """``torch.cuda.is_initialized()``, answered from torch.cuda's module flag where CUDA never
    started (a guarded step asks at each start; the public call checks for a bad fork too)."""
    return getattr(torch.cuda, "_initialized", True) and torch.cuda.is_initialized()


def version_counters(tensors) -> list:
    """``version_counter`` of each tensor, in one list (a guarded step reads its parameters'
    at its start and its end)."""
    return [tensor._version for tensor in tensors]


# torch.distributed's private pieces (torch 2.13 has them all; callers guard each use, and
# degrade as opwatch.core.collective_ops says, where a torch build lacks them or distributed itself).


def unbox_process_group(value):
    """The ``ProcessGroup`` behind a ``ScriptObject`` argument of a c10d op."""
    return torch._C._distributed_c10d.ProcessGroup.unbox(value)


def unbox_work(value):
    """The ``Work`` behind a ``ScriptObject`` result of a c10d op (its future tells completion)."""
    return torch._C._distributed_c10d.Work.unbox(value)


def resolve_process_group(name: str):
    """The process group registered under ``name`` (functional collectives name their group)."""
    return torch._C._distributed_c10d._resolve_process_group(name)


def default_store():
    """The default process group's store (``distributed_c10d._get_default_store``)."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def script_object_type(value) -> str:
    """The TorchScript class name of a ``ScriptObject`` (``ScriptObject._type().name()``,
    torch >= 1.4): ``ProcessGroup``, ``ReduceOp``, ``Work``. Fallback: ``"ScriptObject"``."""
    try:
        return value._type().name()
    except Exception:
        return "ScriptObject"


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


def dynamo_loaded() -> bool:
    """Whether TorchDynamo has been imported: ``torch.compile`` imports it, so without it no
    compiled function exists yet (and opwatch does not pay its ~1 s import)."""
    return "torch._dynamo.eval_frame" in sys.modules


def run_uncompiled(function):
    """``function``, wrapped so that TorchDynamo never traces it: a compiled frame that calls it
    (an optimizer step hook of opwatch's, inside a compiled training step) breaks its graph
    there and runs it as Python, rather than tracing opwatch's bookkeeping into the graph and
    guarding its dicts.

    Two ways in, one per place Dynamo meets the hook. While Dynamo traces a frame that calls it
    (``torch.compiler.is_dynamo_compiling()``, folded to true in tracing), the call goes through
    ``torch._disable_dynamo``, torch's own wrapper for its hooks (``Optimizer.zero_grad``): it
    lives in a file Dynamo never inlines, so the graph breaks there. Run as Python (eagerly,
    or from a compiled frame's resumed bytecode), the hook is called directly: the wrapper's code
    object is marked for Dynamo's frame callback to skip it and everything it calls
    (:func:`skip_dynamo_for_code`), which costs nothing per call, where torch's wrapper enters
    and leaves a disabled region at every call of every step. On a torch without that marking,
    torch's wrapper is taken wherever Dynamo is loaded."""

    def call(*args, **kwargs):  # a plain function: torch's wrapper keeps an attribute on it
        return function(*args, **kwargs)

    skipped = torch._disable_dynamo(call)
    if SKIPS_DYNAMO_PER_CODE:
        tracing = _dynamo_tracing

        @functools.wraps(function)
        def uncompiled(*args, **kwargs):
            if tracing():
                return skipped(*args, **kwargs)
            return function(*args, **kwargs)

        # Marked at each wrap: torch._dynamo.reset() may clear the marks.
        skip_dynamo_for_code(uncompiled.__code__)
        return uncompiled

    @functools.wraps(function)
    def loaded_uncompiled(*args, **kwargs):
        if dynamo_loaded():
            return skipped(*args, **kwargs)
        return function(*args, **kwargs)

    return loaded_uncompiled


# False when called, true where TorchDynamo traces the call (it folds the call to a constant).
_dynamo_tracing = getattr(torch.compiler, "is_dynamo_compiling", lambda: False)


# Dynamo's wrapper around a torch.compile'd call saves the thread's dispatch keys when called and
# puts them back when it returns (torch >= 2.13: ``compile_wrapper``): code objects seen, judged.
_KEYS_RESTORED_BY: dict = {}
_EVAL_FRAME_FILE = os.path.join("torch", "_dynamo", "eval_frame.py")


def compiled_call_frame(frame):
    """The outermost frame, ``frame`` or above it, of a ``torch.compile``d call whose wrapper puts
    the thread's dispatch keys back as they were when it was called: a dispatch mode pushed or
    popped inside such a call is undone where it returns (a popped mode leaves the Python key
    on with no mode on the stack, and the next factory op fails torch's internal assert).
    ``None`` where no such call is running (and on torch versions whose wrapper keeps no keys)."""
    if not dynamo_loaded():
        return None
    outermost = None
    while frame is not None:
        code = frame.f_code
        restores = _KEYS_RESTORED_BY.get(code)
        if restores is None:
            restores = _KEYS_RESTORED_BY[code] = code.co_filename.endswith(_EVAL_FRAME_FILE) and (
                "_ForceDispatchKeyGuard" in code.co_names or "_dynamo_save_local_dispatch_key_set" in code.co_names)
        if restores:
            outermost = frame
        frame = frame.f_back
    return outermost


def force_eager_stance():
    """Put TorchDynamo in the ``"force_eager"`` stance (``torch.compiler.set_stance``, public,
    torch >= 2.6): compiled functions run their Python code eagerly and leave their compiled code
    and its cache as they are. Returns the callable that puts the stance back, or ``None`` where
    no stance could be set: an older torch, or a call from inside a region Dynamo is running
    (``set_stance`` refuses there). Without it a dispatch mode seen by Dynamo's frame callback
    marks the compiled frame's code "skip" for good (``ConvertFrameReturn``'s default), and the
    function never runs compiled again in the process."""
    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    if set_stance is None:
        return None
    try:
        stance = set_stance("force_eager")  # sets it now; the object remembers the one before
    except RuntimeError:
        return None
    return lambda: stance.__exit__(None, None, None)


def force_backend_stance(backend: str):
    """Make every compiled function compile with ``backend`` (a registered backend's name)
    instead of its own, until the returned callable puts the stance back
    (``torch.compiler.set_stance("default", force_backend=...)``, torch >= 2.6): each compiles
    once more per backend, kept beside its own compiled code. ``None`` where it cannot be set."""
    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    if set_stance is None:
        return None
    try:
        stance = set_stance("default", force_backend=backend)
    except (RuntimeError, TypeError):
        return None
    return lambda: stance.__exit__(None, None, None)


def aot_eager_with(fw_compiler, bw_compiler):
    """Dynamo's registered ``aot_eager`` backend with these forward and backward compilers in
    place of its ``boxed_nop`` (``torch._dynamo.backends.debugging.aot_eager``, torch 2.2+: it
    takes them as keyword arguments)."""
    from torch._dynamo.backends.debugging import aot_eager

    def backend(gm, example_inputs, **kwargs):
        return aot_eager(gm, example_inputs, fw_compiler=fw_compiler, bw_compiler=bw_compiler, **kwargs)

    return backend


def aot_backend_parts(backend):
    """The keyword arguments of a backend made by ``torch._dynamo.backends.common.aot_autograd``
    (an ``AotAutograd`` object's ``kwargs``: ``fw_compiler``, ``bw_compiler``, ...), or ``None``
    for any other backend. Read by type name: no Dynamo import."""
    if type(backend).__name__ != "AotAutograd":
        return None
    kwargs = getattr(backend, "kwargs", None)
    return dict(kwargs) if isinstance(kwargs, dict) and "fw_compiler" in kwargs else None


def aot_backend_with(parts: dict):
    """A backend made by ``aot_autograd(**parts)`` (torch 2.0+)."""
    from torch._dynamo.backends.common import aot_autograd

    return aot_autograd(**parts)


def inductor_with_inner(wrap):
    """TorchInductor as a Dynamo backend, each of its compiled graphs (the forward and the
    backward one after AOTAutograd) passed through ``wrap(graph_module, compiled)``, which
    returns what runs instead (``compile_fx(..., inner_compile=...)``, torch 2.0+; the result of
    ``compile_fx_inner`` is called with one list of inputs), with the FX graph and AOTAutograd
    caches off (``torch._inductor.config.fx_graph_cache``, ``torch._functorch.config.
    enable_autograd_cache``, torch 2.2+/2.5+): a cache hit would not pass through ``wrap``."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner(gm, example_inputs, **kwargs):
        return wrap(gm, compile_fx_inner(gm, example_inputs, **kwargs))

    def backend(gm, example_inputs):
        # No cache: a graph found in inductor's or AOTAutograd's cache skips inner_compile.
        from torch._functorch import config as functorch_config
        from torch._inductor import config as inductor_config

        with functorch_config.patch(enable_autograd_cache=False), inductor_config.patch(fx_graph_cache=False):
            return compile_fx(gm, example_inputs, inner_compile=inner)

    return backend


def graph_module_behind(compiled):
    """The ``torch.fx.GraphModule`` a compiler's result runs as it is: the module itself, its
    bound ``forward`` (``_lazy_forward`` before a lazy module's first call), or ``make_boxed_func`` around either (AOTAutograd's ``boxed_nop``: a
    closure over ``gm.forward``, torch 2.0+); ``None`` for anything else (an inductor graph)."""
    for _ in range(3):
        if isinstance(compiled, torch.fx.GraphModule):
            return compiled
        owner = getattr(compiled, "__self__", None)
        if isinstance(owner, torch.fx.GraphModule) and getattr(compiled, "__name__", "").endswith(("forward", "__call__")):
            return owner
        cells = getattr(compiled, "__closure__", None) or ()
        if not getattr(compiled, "_boxed_call", False) or len(cells) != 1:
            return None
        (cell,) = cells
        compiled = cell.cell_contents
    return None


def dtensor_shard(tensor):
    """``(local shard, placements, global shape, mesh size)`` of a ``DTensor`` on a 1-D mesh,
    placements as ``("S", dim)``, ``("R", -1)`` or ``("P", -1)``; ``None`` for any other tensor
    (or a mesh of more dimensions). The shard is ``DTensor._local_tensor`` (torch 2.4+: reading
    it dispatches no op, where ``to_local()`` would run an autograd function)."""
    if type(tensor).__name__ != "DTensor":
        return None
    local = getattr(tensor, "_local_tensor", None)
    try:
        placements = tuple(tensor.placements)
        mesh = tensor.device_mesh
    except Exception:
        return None
    if local is None or len(placements) != 1 or mesh.ndim != 1:
        return None
    (placement,) = placements
    if placement.is_shard():
        kind = ("S", placement.dim)
    elif placement.is_replicate():
        kind = ("R", -1)
    elif placement.is_partial():
        kind = ("P", -1)
    else:
        return None
    return local, (kind,), tuple(tensor.shape), mesh.size()


def module_class_name(module) -> str:
    """A module's class name as the program wrote it: FSDP2's ``fully_shard`` swaps a module's
    class for ``FSDP<Name>``, a subclass of ``FSDPModule`` and of the class. Read by the bases'
    names: no import of torch.distributed."""
    kind = type(module)
    name = kind.__name__
    if name.startswith("FSDP") and any(base.__name__ == "FSDPModule" for base in kind.__bases__):
        return next((base.__name__ for base in kind.__bases__ if base.__name__ != "FSDPModule"), name)
    return name


def compiled_module_inner(module):
    """The module a ``torch.compile(module)`` wraps (``OptimizedModule._orig_mod``, torch 2.0+),
    or ``None`` for any other module. Read by type name: no Dynamo import."""
    if type(module).__name__ != "OptimizedModule":
        return None
    inner = module.__dict__.get("_modules", {}).get("_orig_mod")
    return inner if isinstance(inner, torch.nn.Module) else None


def _compile_wrapper_code(eval_frame):
    """The code object of the wrapper every ``torch.compile``d callable runs through
    (``compile_wrapper`` inside ``_TorchDynamoContext.__call__``, torch 2.6-2.13), or ``None``."""
    call = getattr(getattr(eval_frame, "_TorchDynamoContext", None), "__call__", None)
    for constant in getattr(getattr(call, "__code__", None), "co_consts", ()):
        if getattr(constant, "co_name", None) in ("compile_wrapper", "_fn"):
            return constant
    return None


_ENTERING: dict = {}  # the wrapper's code -> its offsets (read once: dis takes milliseconds)


def _entering_offsets(wrapper_code):
    """Where in Dynamo's wrapper the call that enters the compiled function lies: the wrapper
    calls ``_maybe_set_eval_frame(_callback_from_stance(...))`` entering, and the same global
    again leaving (``finally``, on each return path). ``(from, to)`` instruction offsets, or
    ``None``."""
    if wrapper_code in _ENTERING:
        return _ENTERING[wrapper_code]
    import dis

    loads = [(ins.offset, ins.argval) for ins in dis.get_instructions(wrapper_code) if ins.argval in ("_maybe_set_eval_frame", "_callback_from_stance")]
    stance_at = min((offset for offset, name in loads if name == "_callback_from_stance"), default=None)
    enter_from = enter_to = None
    if stance_at is not None:
        enter_from = max((offset for offset, name in loads if name == "_maybe_set_eval_frame" and offset < stance_at), default=None)
        enter_to = min((offset for offset, name in loads if name == "_maybe_set_eval_frame" and offset > stance_at), default=sys.maxsize)
    found = _ENTERING[wrapper_code] = None if enter_from is None else (enter_from, enter_to)
    return found


def count_compiled_calls(on_call):
    """Call ``on_call(fn)`` with the function behind each call of a ``torch.compile``d callable
    from now on (``fn``: the user's function, or the bound ``__call__`` of a compiled module).
    Dynamo's wrapper looks up ``torch._dynamo.eval_frame._maybe_set_eval_frame`` at each call,
    with the wrapper's frame as the caller: that global is wrapped here (torch 2.6-2.13).
    Returns the callable that unwraps it, or ``None`` where torch's wrapper is not as expected
    (no calls are counted then)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    original = getattr(eval_frame, "_maybe_set_eval_frame", None)
    wrapper_code = _compile_wrapper_code(eval_frame)
    if original is None or wrapper_code is None:
        return None
    entering = _entering_offsets(wrapper_code)
    if entering is None:
        return None
    enter_from, enter_to = entering
    get_frame = sys._getframe

    def set_eval_frame(callback):
        caller = get_frame(1)
        if caller.f_code is wrapper_code and enter_from <= caller.f_lasti < enter_to:
            fn = caller.f_locals.get("fn")
            if fn is not None:
                on_call(fn)
        return original(callback)

    eval_frame._maybe_set_eval_frame = set_eval_frame

    def undo():
        if eval_frame._maybe_set_eval_frame is set_eval_frame:
            eval_frame._maybe_set_eval_frame = original

    return undo


def op_kernel(func):
    """The C++ op behind an ``OpOverload`` (``OpOverload._op``, torch 2.0+): calling it skips
    the Python frame of ``OpOverload.__call__``. Fallback: the overload itself."""
    return getattr(func, "_op", func)


# The sequence number of an autograd node (``Node._sequence_nr()``, torch 1.x+): the same number
# its forward op read from the thread's counter. A C-level caller: this runs per backward op.
autograd_sequence_nr = operator.methodcaller("_sequence_nr")


# torch's error when a backward unpacks a saved tensor written in place since it was saved.
MODIFIED_SAVED_TENSOR = "modified by an inplace operation"


def modified_saved_tensors(roots, *, limit: int = 200_000) -> list:
    """``(node, name, first line of the error)`` of each saved tensor (``Node._saved_<name>``,
    torch 1.x+) of the autograd graph under ``roots`` (tensors) whose unpack raises torch's
    "modified by an inplace operation" error, the same error a backward raises for it, the
    newest node first (the backward meets it first). Nodes whose saved tensors a backward freed
    raise another error and are passed. Slow: called once a backward raised that error, over at
    most ``limit`` nodes."""
    stack = [root.grad_fn for root in roots if getattr(root, "grad_fn", None) is not None]
    seen, found = set(), []
    while stack and len(seen) < limit:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(function for function, _ in node.next_functions)
        for attribute in dir(node):
            if not attribute.startswith("_saved_"):
                continue
            try:
                getattr(node, attribute)
            except RuntimeError as error:
                text = str(error)
                if MODIFIED_SAVED_TENSOR in text:
                    message, _, _ = text.partition(" Hint:")
                    found.append((node, attribute.removeprefix("_saved_"), message))
    return sorted(found, key=_newest_node_first)


def _newest_node_first(item: tuple) -> int:
    node, _, _ = item
    return -autograd_sequence_nr(node)


def tensor_base(tensor):
    """The tensor a view was made from (``Tensor._base``), ``None`` for a tensor that is no
    view."""
    return tensor._base


def pack_padded_sequence_function():
    """The function ``nn.utils.rnn.pack_padded_sequence`` hands its tensors to
    (``torch._pack_padded_sequence``, torch 1.x+, through ``_VF``): a ``TorchFunctionMode`` sees
    that call, not the Python wrapper, which has no ``__torch_function__`` of its own.
    ``None`` where it is missing (the pre-dispatch check then leaves the call alone)."""
    return getattr(torch, "_pack_padded_sequence", None)


def _never_zerotensor(tensor) -> bool:
    return False


# Whether a tensor is a ZeroTensor (autograd's lazy zeros, which hold no memory to reduce):
# ``Tensor._is_zerotensor``, torch >= 1.11, called unbound as a C-level method. Fallback: none is.
is_zerotensor = getattr(torch.Tensor, "_is_zerotensor", _never_zerotensor)


def hooks_dict_of(handle):
    """The hooks dict a ``torch.utils.hooks.RemovableHandle`` removes from: torch keeps a weak
    reference to it in ``handle.hooks_dict_ref`` (torch >= 1.0, still in 2.13). Fallback:
    ``None`` (the module tracker then leaves the global hooks' order alone and stops checking
    whether its exit hook is still the last)."""
    ref = getattr(handle, "hooks_dict_ref", None)
    return ref() if ref is not None else None


def dtensor_class():
    """``torch.distributed.tensor.DTensor`` once that module is loaded (public since 2.5), else
    ``None``: no DTensor exists before it is, and opwatch never imports it itself."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def python_made_collective_wrapper():
    """``AsyncCollectiveTensor`` where torch wraps a functional collective's output in it from
    Python, with no op the mode sees (torch 2.6: ``_c10d_functional._wrap_tensor_autograd``,
    which opwatch follows on newer torch, does not exist there); ``None`` where that op exists
    or before ``torch.distributed._functional_collectives`` is loaded (no wrapper exists then)."""
    global _python_made_wrapper
    if _python_made_wrapper is _NOT_LOADED:
        module = sys.modules.get("torch.distributed._functional_collectives")
        wrapper = getattr(module, "AsyncCollectiveTensor", None)
        if wrapper is None:
            return None
        # The module defines the wrap op where torch has it: asked once it is loaded.
        namespace = getattr(torch.ops, "_c10d_functional", None)
        _python_made_wrapper = None if hasattr(namespace, "_wrap_tensor_autograd") else wrapper
    return _python_made_wrapper


_NOT_LOADED = object()
_python_made_wrapper = _NOT_LOADED  # the class or None, once the module is loaded


def collective_wrapper_inner(wrapper):
    """The tensor an ``AsyncCollectiveTensor`` wraps (its ``elem``), or ``None``."""
    return getattr(wrapper, "elem", None)


def dtensor_parts(tensor) -> tuple:
    """``(local shard, placements, device mesh)`` of a DTensor, read without running an op:
    ``DTensor._local_tensor`` and ``DTensor._spec`` (private, torch 2.0+, still in 2.13). The
    public ``to_local()`` is an autograd function (a node per call, on the hot path); where the
    private names are gone, it and ``placements`` / ``device_mesh`` are the fallback."""
    local = getattr(tensor, "_local_tensor", None)
    spec = getattr(tensor, "_spec", None)
    if local is None or spec is None:
        return tensor.to_local(), tensor.placements, tensor.device_mesh
    return local, spec.placements, spec.mesh


# -- narrowing a compiled-only nan/inf (opwatch.runners.guarded.narrow) -----------------------


def _innermost_backend(backend):
    """A backend without Dynamo's wrappers (``_torchdynamo_orig_backend`` chain, torch 2.x)."""
    for _ in range(8):
        inner = getattr(backend, "_torchdynamo_orig_backend", None)
        if inner is None:
            break
        backend = inner
    return backend


def frame_backends() -> list:
    """Called from inside a backend while Dynamo compiles a frame: the backends of that frame's
    code's cache entries, most recently used first (``InstructionTranslator.current_tx()`` and
    ``_debug_get_cache_entry_list``, torch 2.6-2.14; ``CacheEntry.backend``, which torch 2.6
    does not show to Python, 2.13 and 2.14 do): one of them is the backend the frame was
    compiled with by ``torch.compile``. For a copy of a code object made by
    :func:`compiled_code_set_aside`, those of the program's code object. Where the entries do
    not name their backend, the backends ``torch.compile`` was given in this process, newest
    first (Dynamo's ``eval_frame.cached_backends``): the frame's own when the program compiles
    with one backend. ``[]`` where torch has none of this."""
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
        from torch._dynamo.symbolic_convert import InstructionTranslator

        code = InstructionTranslator.current_tx().f_code
        code = _PROGRAM_CODE.get(id(code), code)  # a copy run by compiled_code_set_aside: the program's entries
        entries = _debug_get_cache_entry_list(code)
    except Exception:
        return []
    if not all(hasattr(entry, "backend") for entry in entries):
        given = getattr(sys.modules.get("torch._dynamo.eval_frame"), "cached_backends", None)
        return [_innermost_backend(backend) for backend in reversed(list((given or {}).values())) if callable(backend)]
    return [_innermost_backend(entry.backend) for entry in entries]


# id(copy) -> the program's code object, for each copy compiled_code_set_aside has handed out
# and not yet taken back (frame_backends reads the program's cache entries through it).
_PROGRAM_CODE: dict = {}


def compiled_code_set_aside():
    """A reusable context manager under which Dynamo's compiles land beside the program's
    compiled code, never in it: every function whose code object holds Dynamo's cache entries
    runs a fresh copy of that code object (``code.replace()``: the same code, no cache entries),
    so that a frame compiled in the block is compiled for the copy, with its own recompile
    budget; on leaving, each function gets its own code object back and every cache entry the
    block made is dropped (``reset_code`` of each copy, and of each code object Dynamo first
    compiled in the block, such as the resume function of a graph break in a copy). The
    program's code objects, their cache entries, their order and their frame counters are never
    touched. Each ``with`` hands out fresh copies (one block at a time).

    Reads Dynamo's list of the code objects it converted (``convert_frame.input_codes``),
    their cache entries (``torch._C._dynamo.eval_frame._debug_get_cache_entry_list``) and drops
    a code object's entries with ``reset_code`` (all three in torch 2.6, 2.13 and 2.14, the
    versions tested; 2.5 has them too); a copy also gets its original's
    ``always_optimize_code_objects`` flag and ``code_context`` (skipped where missing). The
    functions are found once, when it is made (``gc.get_referrers``, one pass over the
    process's objects): a function made later from a compiled code object (a closure made anew
    on each call) runs the program's code object, and what a block compiles for it stays.
    ``None`` where torch lacks one of the three (a block would then compile into the program's
    code objects: callers do not run one)."""
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list, reset_code
        from torch._dynamo import convert_frame

        tracker = convert_frame.input_codes
    except (ImportError, AttributeError):
        return None
    if not isinstance(getattr(tracker, "seen", None), list):
        return None
    return _CodeSetAside(tracker, _debug_get_cache_entry_list, reset_code)


def _converted_codes(tracker) -> list:
    return [code for code in (ref() for ref in list(tracker.seen)) if code is not None]


def _copy_code(original):
    """A code object equal to ``original`` with no cache entries, and the flags Dynamo keeps per
    code object (compile it even without a torch global; its code context)."""
    copy = original.replace()
    always = getattr(sys.modules.get("torch._dynamo.eval_frame"), "always_optimize_code_objects", None)
    try:
        if always is not None and original in always:
            always[copy] = always[original]
    except Exception:
        pass
    contexts = getattr(sys.modules.get("torch._dynamo.code_context"), "code_context", None)
    try:
        if contexts is not None and contexts.has_context(original):
            contexts.get_context(copy).update(contexts.get_context(original))
    except Exception:
        pass
    return copy


class _CodeSetAside:
    """:func:`compiled_code_set_aside`'s context manager."""

    def __init__(self, tracker, entries_of, reset_code):
        self._tracker, self._entries_of, self._reset_code = tracker, entries_of, reset_code
        compiled = {id(code): code for code in _converted_codes(tracker) if entries_of(code)}
        referrers = gc.get_referrers(*compiled.values()) if compiled else ()
        self._functions = [function for function in referrers
                           if isinstance(function, types.FunctionType) and compiled.get(id(function.__code__)) is function.__code__]
        self._before: list = []
        self._copies: dict = {}  # id(the program's code) -> its copy
        self._swapped: list = []  # (function, the program's code, its copy)

    def __enter__(self):
        self._before = _converted_codes(self._tracker)
        try:
            for function in self._functions:
                original = function.__code__
                if not self._entries_of(original):
                    continue
                copy = self._copies.get(id(original))
                if copy is None:
                    copy = self._copies[id(original)] = _copy_code(original)
                    _PROGRAM_CODE[id(copy)] = original
                function.__code__ = copy
                self._swapped.append((function, original, copy))
        except BaseException:
            self.__exit__(None, None, None)  # no function left on a copy
            raise
        return self

    def __exit__(self, *exc_info):
        for function, original, copy in self._swapped:
            if function.__code__ is copy:
                function.__code__ = original
        for copy in self._copies.values():
            _PROGRAM_CODE.pop(id(copy), None)
            self._reset_code(copy)
        known = {id(code) for code in self._before}
        for code in _converted_codes(self._tracker):
            if id(code) not in known and self._entries_of(code):
                self._reset_code(code)
        self._before, self._copies, self._swapped = [], {}, []
        return False


def registered_backend(name: str):
    """Dynamo's registered backend ``name`` (``torch._dynamo.lookup_backend``, torch 2.0+) as a
    callable ``(gm, example_inputs) -> compiled``."""
    from torch._dynamo import lookup_backend

    return lookup_backend(name)


def backend_identity(backend) -> tuple:
    """``(name, fn)`` of a backend as Dynamo keeps it: ``torch.compile``'s wrappers
    (``_TorchCompileInductorWrapper``: ``("inductor", None)``; ``_TorchCompileWrapper``: its
    ``compiler_name`` and ``compiler_fn``, torch 2.0-2.13); else ``(None, backend)``. A name is
    given only where it is a registered backend's (``torch.compiler.list_backends``)."""
    backend = _innermost_backend(backend)
    kind = type(backend).__name__
    if kind == "_TorchCompileInductorWrapper":
        return "inductor", None
    if kind == "_TorchCompileWrapper":
        name = getattr(backend, "compiler_name", None)
        try:
            registered = set(torch.compiler.list_backends(exclude_tags=()))
        except Exception:
            registered = set()
        return (name if name in registered else None), getattr(backend, "compiler_fn", backend)
    return None, backend


def is_inductor(backend) -> bool:
    """Whether ``backend`` is inductor: ``torch.compile``'s default (its wrapper), or the
    registered ``"inductor"`` backend itself."""
    name, fn = backend_identity(backend)
    if name == "inductor":
        return True
    try:
        return fn is registered_backend("inductor")
    except Exception:
        return False


def inductor_settings(**settings):
    """A context manager that sets inductor's config (``torch._inductor.config.patch``, torch
    2.0+) for its block, e.g. ``emulate_precision_casts=True``; ``None`` where a setting is
    missing in this torch."""
    try:
        from torch._inductor import config
    except Exception:
        return None
    if not all(hasattr(config, name) for name in settings):
        return None
    return config.patch(**settings)


# The stack trace Dynamo records on each FX node: the user's frames, innermost last, as
# ``traceback`` formats them (torch 2.0+; empty where Dynamo kept none).
NODE_STACK_TRACE = "stack_trace"
