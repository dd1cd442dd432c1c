"""The written rules of CONTRIBUTING, kept true by parsing the package (no import, no torch):

- arrows one way: a module imports only modules of its own layer or below (``FLOORS``: the folders,
  in ``tests/support/floors.py``), and no
  import cycle, counting imports inside functions;
- private torch APIs only in ``opwatch/core/compat.py``;
- the hot path keeps its size: ``OpInterceptor`` at most 230 code lines, its
  ``__torch_dispatch__`` at most 80; nothing outside its module reads its private attributes;
- every sentence a user reads is built in ``opwatch/render/``: no prose literal elsewhere,
  except where the rule says why (errors for bad arguments, raised where they are validated;
  command-line help).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent.parent / "opwatch"

from support.floors import FLOORS, floor_of as layer_of  # noqa: E402  the floors, bottom to top


def test_every_folder_is_a_floor():
    folders = {f"opwatch.{path.name}" for path in PACKAGE.iterdir() if path.is_dir() and (path / "__init__.py").exists()}
    files = {f"opwatch.{path.stem}" for path in PACKAGE.glob("*.py") if path.stem != "__init__"}
    placed = set().union(*FLOORS)
    assert folders | files <= placed, f"not on a floor of tests/unit/test_rules.py: {sorted((folders | files) - placed)}"
    assert not (placed - folders - files - {"opwatch"}), f"floors naming no folder: {sorted(placed - folders - files - {'opwatch'})}"


# Private torch modules that are the documented way to extend torch.
PUBLIC_PRIVATE_MODULES = {"torch.utils._python_dispatch"}
# Private attributes every torch op tool reads (torch's own flop_counter and DebugMode do).
TOLERATED_ATTRIBUTES = {"_schema", "_overloadname", "_get_current_dispatch_mode_stack"}
PRIVATE_OBJECT_ATTRIBUTES = {"_base", "_op", "_sequence_nr", "unbox", "_version", "_type", "_per_optimizer_states", "hooks_dict_ref", "_local_tensor", "_spec"}


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _resolve(name: str, path: pathlib.Path, node: ast.ImportFrom) -> list[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    if node.level:
        base = package.split(".")
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    targets = [target]
    # ``from . import x`` / ``from .checks import nonfinite``: the submodule itself
    targets += [f"{target}.{alias.name}" for alias in node.names]
    return targets


def imports() -> dict[str, set[str]]:
    """module -> the opwatch modules it imports (at the top or inside functions)."""
    known = modules()
    graph = {}
    for name, path in known.items():
        tree = ast.parse(path.read_text())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for target in _resolve(name, path, node):
                    if target in known and target != name:
                        found.add(target)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in known and alias.name != name:
                        found.add(alias.name)
        graph[name] = found
    return graph


def test_every_import_points_down_or_sideways():
    wrong = []
    for name, targets in imports().items():
        for target in targets:
            if layer_of(target) > layer_of(name) and not name.startswith(target + "."):
                wrong.append(f"{name} (layer {layer_of(name)}) imports {target} (layer {layer_of(target)})")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_cycle():
    graph = imports()

    def parent_packages(name):  # importing a module imports its packages: not an arrow of its own
        parts = name.split(".")
        return {".".join(parts[:i]) for i in range(1, len(parts))}

    edges = {name: {t for t in targets if t not in parent_packages(name)} for name, targets in graph.items()}
    # A package's __init__ importing its own children is how packages re-export: not a cycle.
    edges = {name: {t for t in targets if not t.startswith(name + ".")} for name, targets in edges.items()}
    cycles = []
    state: dict = {}

    def visit(node, stack):
        state[node] = 1
        stack.append(node)
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                cycles.append(" -> ".join(stack[stack.index(target):] + [target]))
            elif target not in state:
                visit(target, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [])
    assert not cycles, "\n".join(cycles)


def _dotted(node) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def private_torch_uses(path: pathlib.Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            if isinstance(node, ast.ImportFrom):
                names += [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                if name.startswith("torch") and any(part.startswith("_") for part in name.split(".")):
                    if not any(name == m or name.startswith(m + ".") for m in PUBLIC_PRIVATE_MODULES):
                        found.append(f"{path.name}:{node.lineno} imports {name}")
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if dotted and dotted.startswith("torch.") and any(
                part.startswith("_") and not part.startswith("__") and part not in TOLERATED_ATTRIBUTES
                for part in dotted.split(".")[1:]
            ):
                found.append(f"{path.name}:{node.lineno} {dotted}")
            elif node.attr in PRIVATE_OBJECT_ATTRIBUTES:
                found.append(f"{path.name}:{node.lineno} .{node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2:
            name = node.args[1]
            if isinstance(name, ast.Constant) and name.value in PRIVATE_OBJECT_ATTRIBUTES:
                found.append(f"{path.name}:{node.lineno} {node.func.id}(..., {name.value!r})")
    return found


def test_private_torch_apis_only_in_compat():
    found = []
    for name, path in modules().items():
        if name != "opwatch.core.compat":
            found += private_torch_uses(path)
    assert not found, "\n".join(found)


# -- prose --------------------------------------------------------------------------------


_HELP_KEYWORDS = {"help", "description", "epilog", "usage", "metavar", "prog"}
# Calls whose text is command-line or ini help, or a usage error (like ``raise``).
_HELP_CALLS = {"addinivalue_line", "addini", "addoption", "getgroup", "add_argument", "add_parser", "error", "fail", "UsageError"}


def prose_literals(path: pathlib.Path) -> list[tuple[int, str]]:
    """String literals and f-strings of three words or more that are not docstrings, not in a
    ``raise``, ``parser.error`` or ``pytest.fail`` (errors for bad arguments are written where
    the argument is validated), not command-line or ini help, not a ``__repr__``."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                skip.add(id(body[0].value))
        if isinstance(node, ast.Raise) or (isinstance(node, ast.FunctionDef) and node.name == "__repr__"):
            skip.update(id(inner) for inner in ast.walk(node))
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in _HELP_CALLS:
            skip.update(id(inner) for inner in ast.walk(node))
        if isinstance(node, ast.keyword) and node.arg in _HELP_KEYWORDS:
            skip.update(id(inner) for inner in ast.walk(node.value))
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            skip.update(id(v) for v in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        else:
            continue
        words = [w for w in text.replace("{}", " ").split() if any(c.isalpha() for c in w)]
        if len(words) >= 3 and not text.lstrip().startswith(("import ", "from ", "def ", "#!")):
            found.append((node.lineno, text))
    return found


def prose_outside_render() -> dict[str, list]:
    return {
        name: found
        for name, path in modules().items()
        if not name.startswith(("opwatch.render", "opwatch.examples")) and (found := prose_literals(path))
    }


# Modules that write text a user reads for a reason the render package cannot serve.
PROSE_ALLOWED = {
    # The one-op repro script opwatch writes is Python source, not a message.
    "opwatch.runners.guarded.repro": "writes a Python script",
    "opwatch.runners.guarded.graph_repro": "writes a Python script (a compiled graph's repro)",
}


# Single literals allowed outside render, with why.
LITERALS_ALLOWED = {
    # Where a pytest setting came from, named in its usage error: the plugin must not import
    # the render package (and torch with it) while a test run does not use opwatch.
    ("opwatch.runners.pytest_plugin", "the ini file"),
    ("opwatch.runners.pytest_plugin", "the command line"),
    # What the Chrome trace's timestamps are, in its metadata for the trace viewers.
    ("opwatch.storage.chrome_trace", "perf_counter_ns around each kernel"),
    ("opwatch.storage.chrome_trace", "synthetic: op index, 1 us per op"),
    # The label of a site with no line (a name, stored in the log like a file name).
    ("opwatch.modes.reducer", "{}end of backward"),
    # torch's own error text, matched to tell its in-place error of a backward: not opwatch's prose.
    ("opwatch.core.compat", "modified by an inplace operation"),
}


def test_user_facing_prose_only_in_render():
    found = {
        name: [(lineno, text) for lineno, text in items if (name, text) not in LITERALS_ALLOWED]
        for name, items in prose_outside_render().items()
        if name not in PROSE_ALLOWED
    }
    found = {name: items for name, items in found.items() if items}
    lines = [f"{name}:{lineno}: {text[:70]!r}" for name, items in sorted(found.items()) for lineno, text in items]
    assert not lines, f"{len(lines)} prose literal(s) outside opwatch/render:\n" + "\n".join(lines)


@pytest.mark.parametrize(
    "source, count",
    [
        ('def f():\n    """A docstring of many words."""\n    return 1\n', 0),
        ('def f(x):\n    raise ValueError(f"x must be one of a, b, got {x!r}")\n', 0),
        ('p.add_argument("--x", help="what this option does")\n', 0),
        ('message = f"first nan here: {op} made it"\n', 1),
        ('fix = "clamp the input first"\n', 1),
        ('name = "aten::add"\n', 0),
    ],
)
def test_the_prose_detector_itself(tmp_path, source, count):
    path = tmp_path / "m.py"
    path.write_text(source)
    assert len(prose_literals(path)) == count


# == named indices: tuples of facts are read by name, not by position ==========================

# Integer-constant subscripts (``x[0]``, ``x[-1]``) left in each module: the first or last of a
# sequence (``shape[0]``, ``entries[-1]``, ``sys.argv[1]``), a split string's parts, an op's own
# arguments (``args[0]`` of ``aten.expand``). A tuple of facts read back by position gets names
# instead: a ``typing.NamedTuple`` read as ``.field`` (registered with ``fact_tuples.fact_tuple``
# when a finding carries it, so the export keeps its class), or, on the hot path where a plain
# tuple is cheaper, named index constants (``entry[E_SITE]``, ``meta[M_DEVICE]``). A module's
# count may not grow; lower it here when you remove one.
CONSTANT_SUBSCRIPTS_ALLOWED = {
    "opwatch.render.table": 2,  # the first and last row of a run
    "opwatch.render.summary": 3,  # the first line of a message
    "opwatch.runners.cli": 5,  # sys.argv[0], string parts, the user's last frame
    "opwatch.findings.allow": 2,
    "opwatch.checks.broadcast": 13,  # the last entry logged (entries[-1]) for a broadcast_tensors pair
    "opwatch.checks.device": 13,
    "opwatch.checks.dtype": 8,
    "opwatch.checks.fingerprints": 2,
    "opwatch.checks.module_calls": 3,
    "opwatch.checks.nonfinite.collectives": 8,
    "opwatch.checks.nonfinite.replay": 3,  # an op's first input fed (fed[0], twice) and its state
    "opwatch.checks.provenance": 1,  # an op's first input (inputs[0])
    "opwatch.checks.nonfinite.tracker": 1,
    "opwatch.checks.pre_dispatch": 3,
    "opwatch.core.collective_ops": 2,
    "opwatch.runners.divergence": 2,  # the first input, the first record
    "opwatch.examples.device_mix": 1,
    "opwatch.storage.jsonl": 3,  # the first/last line, a version string's part
    "opwatch.storage.chrome_trace": 2,  # the first record: the trace's time origin
    "opwatch.runners.guarded": 1,
    "opwatch.runners.policy.calls": 1,  # the first allowed nan/inf anomaly
    "opwatch.core.finite": 1,  # the first checked tensor: the device of the flags
    "opwatch.runners.guarded.replay": 3,
    "opwatch.runners.guarded.repro": 5,
    "opwatch.runners.trainers": 3,
    "opwatch.runners.transformers": 1,
    "opwatch.runners.leave_on": 6,
    "opwatch.modes.interceptor": 6,  # the first and last tensor argument; the first item of a list argument
    "opwatch.modes.modules": 6,  # the innermost module call (self._stack[-1], 4); sys.exc_info()[0] (2)
    "opwatch.modes.reducer": 1,
    "opwatch.core.ops": 3,
    "opwatch.checks.accumulation": 8,  # self is an op's first tensor; the first odd operand
    "opwatch.runners.pytest_plugin": 3,
    "opwatch.core.records": 3,  # the oldest entry; the last entry (twice: OpLog.complete)
    "opwatch.render.broadcast": 2,
    "opwatch.render.dtype": 5,
    "opwatch.render.guard": 4,
    "opwatch.render.notices": 1,
    "opwatch.render.ranks": 12,
    "opwatch.core.sites": 1,
}
# Names (variables, attributes, facts keys) that hold one tuple of facts: never read by position.
FACT_TUPLE_NAMES = {
    "made", "made_a", "made_b", "factory", "failure", "note", "repro_note", "raised", "context", "meta",
    "entry", "print_a", "print_b", "fingerprint", "place", "where",
}


def constant_subscripts(source: str) -> list[tuple[int, str, str | None]]:
    """``(line, expression, name read)`` of each integer-constant subscript in ``source``; the
    name is the variable, attribute or string key subscripted (``None`` for anything else)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Subscript):
            continue
        index = node.slice.operand if isinstance(node.slice, ast.UnaryOp) and isinstance(node.slice.op, ast.USub) else node.slice
        if not (isinstance(index, ast.Constant) and type(index.value) is int):
            continue
        value = node.value
        if isinstance(value, ast.Name):
            name = value.id
        elif isinstance(value, ast.Attribute):
            name = value.attr
        elif isinstance(value, ast.Subscript) and isinstance(value.slice, ast.Constant) and isinstance(value.slice.value, str):
            name = value.slice.value  # facts["metas"][0]
        else:
            name = None
        found.append((node.lineno, ast.unparse(node), name))
    return found


def test_tuples_of_facts_are_read_by_name():
    grown, by_position = [], []
    for name, path in sorted(modules().items()):
        found = constant_subscripts(path.read_text())
        allowed = CONSTANT_SUBSCRIPTS_ALLOWED.get(name, 0)
        if len(found) > allowed:
            shown = ", ".join(f"{text} (line {line})" for line, text, _ in found)
            grown.append(f"{name}: {len(found)} integer-constant subscripts, {allowed} allowed: {shown}")
        by_position += [f"{name}:{line}: {text}" for line, text, read in found if read in FACT_TUPLE_NAMES]
    assert not by_position, "tuples of facts read by position (give them names):\n" + "\n".join(by_position)
    assert not grown, (
        "read tuples of facts by name (a NamedTuple's fields; named index constants on the hot path); "
        "raise CONSTANT_SUBSCRIPTS_ALLOWED only for the first/last of a sequence or a string's parts:\n" + "\n".join(grown)
    )


@pytest.mark.parametrize(
    "source, names",
    [
        ("x = shape[0] + entries[-1][E_INDEX]\n", ["shape", "entries"]),
        ('odd = facts["metas"][0]\nhow = finding.made[0][0]\n', ["metas", None, "made"]),
        ("x = entry[E_SITE] + made.step + pair[1:]\n", []),
    ],
)
def test_the_subscript_detector_itself(source, names):
    assert [name for _, _, name in constant_subscripts(source)] == names


def test_the_private_torch_detector_sees_getattr_by_name(tmp_path):
    source = tmp_path / "m.py"
    source.write_text('ref = getattr(handle, "hooks_dict_ref", None)\nok = getattr(handle, "id", None)\n')
    assert private_torch_uses(source) == ["m.py:1 getattr(..., 'hooks_dict_ref')"]


# -- sizes of the hot path ----------------------------------------------------------------------

# The interceptor's class and its per-op function, in code lines (no docstring, comment or blank
# line). The function is STYLE.md's ~80 (past it, a function holds two jobs). The class holds the
# per-op work, its plans, the head of an entry, the rare paths (a finding, a failed kernel) and
# check points: 230, room for a few lines; 235 since it also tells the function mode where profiler
# regions start and end (issue 40: the mode stands aside for an optimizer step until its region
# ends, an op only the interceptor sees). Its siblings (the function mode, module calls,
# compiled graphs) log through OpLog.log_call, never through it.
HOT_PATH_LIMITS = {("opwatch.modes.interceptor", "OpInterceptor"): 235, ("opwatch.modes.interceptor", "OpInterceptor.__torch_dispatch__"): 80}


def code_lines(source: str, node: ast.AST) -> int:
    """The lines of ``node`` holding code: docstrings (of the module, classes, functions),
    comments and blank lines left out."""
    tree = ast.parse(source)
    docstrings = set()
    for owner in ast.walk(tree):
        if isinstance(owner, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and owner.body:
            first = owner.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    lines = source.splitlines()
    counted = 0
    for number in range(node.lineno, node.end_lineno + 1):
        text = lines[number - 1].strip()
        if text and not text.startswith("#") and number not in docstrings:
            counted += 1
    return counted


def _unit(tree: ast.Module, dotted: str) -> ast.AST:
    scope = tree
    for name in dotted.split("."):
        scope = next(node for node in scope.body if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == name)
    return scope


@pytest.mark.parametrize("module, unit", list(HOT_PATH_LIMITS))
def test_the_hot_path_keeps_its_size(module, unit):
    source = modules()[module].read_text()
    lines = code_lines(source, _unit(ast.parse(source), unit))
    assert lines <= HOT_PATH_LIMITS[module, unit], f"{module}.{unit}: {lines} code lines, at most {HOT_PATH_LIMITS[module, unit]}"


# The runners keep only their trigger (issue 37): the decision of a step is the one policy's
# (opwatch.runners.policy), so the call wrapper and the optimizer-hook runner stay small.
TRIGGER_LIMITS = {("opwatch.runners.guarded", "Guarded"): 200, ("opwatch.runners.leave_on", "LeaveOn"): 200}


@pytest.mark.parametrize("module, unit", list(TRIGGER_LIMITS))
def test_the_runners_keep_only_their_trigger(module, unit):
    source = modules()[module].read_text()
    lines = code_lines(source, _unit(ast.parse(source), unit))
    assert lines <= TRIGGER_LIMITS[module, unit], f"{module}.{unit}: {lines} code lines, at most {TRIGGER_LIMITS[module, unit]}"


def test_the_poisoned_weights_check_exists_once():
    """One check of whether the weights themselves hold nan/inf: the policy's."""
    found = {name for name, path in modules().items() if "def poisoned(" in path.read_text() and name.startswith("opwatch.runners")}
    assert found == {"opwatch.runners.policy"}, found
    for name in ("opwatch.runners.guarded", "opwatch.runners.leave_on", "opwatch.runners.lightning", "opwatch.runners.transformers"):
        assert "nonfinite_kind(local(param" not in modules()[name].read_text(), name


def _interceptor_privates() -> set[str]:
    """The private attributes and methods ``OpInterceptor`` sets or calls on ``self``."""
    source = modules()["opwatch.modes.interceptor"].read_text()
    cls = _unit(ast.parse(source), "OpInterceptor")
    return {
        node.attr
        for node in ast.walk(cls)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
        and node.attr.startswith("_") and not node.attr.startswith("__")
    }


def reaches_into(source: str, privates: set[str]) -> list[str]:
    """``x._log`` and the like: a name of ``privates`` read on anything but ``self``/``cls``."""
    return [
        f"{node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute) and node.attr in privates and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
    ]


def test_nothing_outside_the_interceptor_touches_its_privates():
    """The log numbers ops and builds entries (OpLog.log_call): the modes beside the interceptor
    use its public face (log, inert, findings, internal_error), never its insides."""
    privates = _interceptor_privates()
    assert {"_log", "_checks", "_head"} <= privates  # the detector reads the class
    found = {
        name: hits
        for name, path in modules().items()
        if name != "opwatch.modes.interceptor" and (hits := reaches_into(path.read_text(), privates))
    }
    assert not found, found


def test_the_reach_detector_itself():
    source = "a = interceptor._log\nb = self._log\nc = cls._checks\nd = recording.log\ne = w._checks.prints\n"
    assert reaches_into(source, {"_log", "_checks"}) == ["1: interceptor._log", "5: w._checks"]


def test_the_code_line_counter_itself():
    source = 'class A:\n    """Doc\n    string."""\n\n    # a comment\n    def f(self):\n        """Doc."""\n        return 1  # counted\n'
    tree = ast.parse(source)
    assert code_lines(source, _unit(tree, "A")) == 3  # class A, def f, return 1
    assert code_lines(source, _unit(tree, "A.f")) == 2


def test_the_interceptor_names_no_check():
    """Findings leave the hot path by one exit (opwatch.findings.pipeline): the interceptor imports
    no check and names none of their modules or internals."""
    checks = {path.stem for path in (PACKAGE / "checks").iterdir() if path.stem != "__init__" and (path.suffix == ".py" or path.is_dir())}
    checks -= {"pipeline", "finding", "__pycache__"}
    path = modules()["opwatch.modes.interceptor"]
    assert not {target for target in imports()["opwatch.modes.interceptor"] if target.startswith("opwatch.checks")}
    # ``device`` and ``dtype`` are a tensor's too (its fields, a local variable); the checks'
    # state and verdicts are theirs alone.
    modules_named = checks - {"device", "dtype"}
    internals = modules_named | {"matters", "handshakes", "prints", "waits_for_use", "where_made", "with_provenance"}
    named = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name) and node.id in modules_named:
            named.add(node.id)
        elif isinstance(node, ast.Attribute) and node.attr in internals:
            named.add(node.attr)
    assert not named, f"the interceptor names checks: {sorted(named)}"
    assert {"broadcast", "promotions", "nonfinite"} <= checks  # the detector sees the checks
