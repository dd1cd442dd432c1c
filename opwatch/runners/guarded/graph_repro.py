"""A one-file repro of a compiled-only failure: the FX graph Dynamo captured of the failing
compiled function (its code, as ``GraphModule.code``), its saved inputs beside it
(``inputs.pt``), run eagerly and through the failing backend, its outputs and the gradients of
its inputs checked for nan/inf. Its exit status is 1 when the compiled graph makes nan/inf
where eager does not, 0 otherwise, so it is a test script for torch's
``python -m torch._inductor.compiler_bisector run python repro.py`` (which names the backend
to try in ``$TORCH_COMPILE_BACKEND``, read by the script). The conventions of :mod:`.repro`'s
one-op repros: a new folder a repro (``repro_dir``, or the system's temporary folder), a
docstring saying what was found and with which versions, ``python repro.py`` to run it.
"""

from __future__ import annotations

import builtins
import inspect
import os
import platform
import re
import tempfile

import torch

from ...core.compat import backend_identity
from ...render import guard as words

__all__ = ["write_graph_repro", "backend_spec"]

# Names the graph's code may use that the script imports itself.
_PROVIDED = {"torch", "device", "inf", "nan", "math", "operator", "builtins"}


def backend_spec(backend) -> str:
    """How the script names ``backend``: a registered backend's name (``"inductor"``), else
    ``module:qualname`` of its function (or of its class, for an instance; built again with
    no arguments by the script)."""
    name, fn = backend_identity(backend)
    if name:
        return name
    target = fn if inspect.isfunction(fn) or inspect.isclass(fn) else type(fn)
    return f"{target.__module__}:{target.__qualname__}"


def write_graph_repro(captured, backend: str, folder, *, node=None, graphs: int = 1) -> str:
    """Write ``repro.py`` and ``inputs.pt`` for ``captured`` (a :class:`~.narrow.Captured`
    with its inputs) into a new folder (in ``folder``, or in the system's temporary folder);
    return the script's path. ``backend``: :func:`backend_spec`'s name of the failing backend."""
    if folder is not None:
        os.makedirs(folder, exist_ok=True)
    target = os.path.abspath(tempfile.mkdtemp(prefix="opwatch-compiled-repro-", dir=folder))
    gm = captured.graph
    code = gm.graph.python_code(root_module="self")
    used = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", code.src))
    imports, missing = _imports({name: value for name, value in code.globals.items() if name in used})
    attributes = {str(n.target): _attribute(gm, str(n.target)) for n in gm.graph.nodes if n.op == "get_attr"}
    attributes = {name: value for name, value in attributes.items() if isinstance(value, torch.Tensor)}
    torch.save({"inputs": list(captured.inputs), "rng": captured.rng, "attributes": attributes}, os.path.join(target, "inputs.pt"))
    from ..._version import __version__

    about = words.graph_repro_about(node, backend, graphs, missing)
    about.append(f"made with opwatch {__version__}, torch {torch.__version__}, Python {platform.python_version()}, "
                 f"{platform.system()} {platform.machine()}")
    script = os.path.join(target, "repro.py")
    with open(script, "w") as out:
        out.write(_script(about, imports, code.src, backend))
    return script


def _attribute(gm, dotted: str):
    value = gm
    for part in dotted.split("."):
        value = getattr(value, part)
    return value.detach() if isinstance(value, torch.Tensor) else value


def _imports(names: dict) -> tuple[list[str], list[str]]:
    """Import lines for the globals the graph's code uses, and the names that cannot be
    imported (defined in ``__main__`` or nowhere importable)."""
    lines, missing = [], []
    for name, value in sorted(names.items()):
        if name in _PROVIDED or getattr(builtins, name, None) is value:
            continue
        module = getattr(value, "__module__", None)
        qualname = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
        if not module or not qualname or module in ("__main__", "builtins") or "<" in qualname:
            missing.append(name)
            continue
        head, _, rest = qualname.partition(".")
        lines.append(f"from {module} import {head} as {name}" if not rest else f"from {module} import {head} as _{name}_owner\n{name} = _{name}_owner.{rest}")
    return lines, missing


def _script(about: list[str], imports: list[str], source: str, backend: str) -> str:
    head = ['"""One-graph repro made by opwatch.guard: a graph of the failing compiled step, on its saved inputs.', ""]
    head += ["  " + line for line in about]
    head += [
        "",
        "Run it with:  python repro.py   (exit status 1: the compiled graph makes nan/inf where eager does not)",
        "Another backend:  TORCH_COMPILE_BACKEND=aot_eager python repro.py   (a name, or module:function)",
        "Bisect inductor's passes:  python -m torch._inductor.compiler_bisector run python repro.py",
        '"""',
        "",
        "import builtins",
        "import importlib",
        "import math",
        "import operator",
        "import os",
        "import sys",
        "",
        "import torch",
        "from torch import device, inf, nan",
        "",
    ]
    head += imports
    body = "\n".join("    " + line if line.strip() else "" for line in source.strip("\n").splitlines())
    tail = [
        "",
        f"BACKEND = {backend!r}",
        "_HERE = os.path.dirname(os.path.abspath(__file__))",
        '_SAVED = torch.load(os.path.join(_HERE, "inputs.pt"), weights_only=True)',
        "",
        "",
        "class Repro(torch.nn.Module):",
        "    def __init__(self):",
        "        super().__init__()",
        '        for dotted, value in _SAVED["attributes"].items():',
        "            owner = self",
        '            *path, name = dotted.split(".")',
        "            for part in path:",
        "                if not hasattr(owner, part):",
        "                    setattr(owner, part, torch.nn.Module())",
        "                owner = getattr(owner, part)",
        "            setattr(owner, name, value)",
        "",
        body,
        "",
        "",
        "def backend():",
        '    name = os.environ.get("TORCH_COMPILE_BACKEND") or BACKEND',
        '    if ":" not in name:',
        "        return name",
        '    module, _, qualname = name.partition(":")',
        "    sys.path.insert(0, os.getcwd())",
        "    found = importlib.import_module(module)",
        '    for part in qualname.split("."):',
        "        found = getattr(found, part)",
        "    return found() if isinstance(found, type) else found",
        "",
        "",
        "def run(fn):",
        '    """Outputs and the gradients of the inputs (backward of the outputs\' sum), from the saved RNG state."""',
        '    torch.set_rng_state(_SAVED["rng"])',
        '    inputs = [value.detach().clone().requires_grad_(value.requires_grad) if isinstance(value, torch.Tensor) else value for value in _SAVED["inputs"]]',
        "    out = fn(*inputs)",
        "    outputs = [value for value in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(value, torch.Tensor)]",
        "    trained = [value for value in outputs if value.requires_grad and value.is_floating_point()]",
        "    if trained:",
        "        torch.autograd.backward(trained, [torch.ones_like(value) for value in trained])",
        "    grads = [value.grad for value in inputs if isinstance(value, torch.Tensor) and value.grad is not None]",
        "    return [value.detach() for value in outputs], grads",
        "",
        "",
        "def state(tensors):",
        "    bad = [i for i, value in enumerate(tensors) if value.is_floating_point() and not bool(torch.isfinite(value).all())]",
        '    return "finite" if not bad else "nan/inf in " + ", ".join(map(str, bad))',
        "",
        "",
        "def worse(eager, compiled):",
        "    return any(bool((torch.isfinite(a) & ~torch.isfinite(b)).any()) for a, b in zip(eager, compiled)",
        "               if a.is_floating_point() and a.shape == b.shape)",
        "",
        "",
        'if __name__ == "__main__":',
        '    chosen, name = backend(), os.environ.get("TORCH_COMPILE_BACKEND") or BACKEND',
        "    eager_outputs, eager_grads = run(Repro())",
        "    compiled_outputs, compiled_grads = run(torch.compile(Repro(), backend=chosen, fullgraph=True))",
        '    print(f"eager:    outputs {state(eager_outputs)}; input gradients {state(eager_grads)}")',
        '    print(f"compiled ({name}): outputs {state(compiled_outputs)}; input gradients {state(compiled_grads)}")',
        "    reproduced = worse(eager_outputs, compiled_outputs) or worse(eager_grads, compiled_grads)",
        '    print("reproduced: the compiled graph makes nan/inf where eager does not" if reproduced else "not reproduced")',
        "    sys.exit(1 if reproduced else 0)",
        "",
    ]
    return "\n".join(head + tail)
