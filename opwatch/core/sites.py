"""Where an op came from: the user's frame, its line and the sub-expression that issued the op.

The hot path stores only ``(code object, instruction offset)``; line numbers, source text and
column ranges are derived from them when somebody reads a record.
"""

from __future__ import annotations

import ast
import linecache
import os
import sys
import sysconfig
import types
import warnings
from functools import lru_cache
from typing import NamedTuple

import torch

from .compat import engine_entry_code

__all__ = ["display_path", "file_line", "location", "USER", "INTERNAL", "ENGINE", "classify_code", "user_frame", "Position", "position_of", "source_line", "lone_call", "UserLine", "user_line", "warn_at_user"]

# How a code object is classified by the frame walk (cached per code object).
INTERNAL = 0  # torch, opwatch or the interpreter's own machinery: keep walking outwards
USER = 1  # the innermost frame of this kind is the op's source
ENGINE = 2  # torch.autograd's entry into the C++ engine: ops beneath it are backward ops

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
# The standard library (multiprocessing rebuilding a DataLoader batch, contextlib, functools)
# is nobody's own code either; third-party packages (transformers, ...) are.
_STDLIB_DIRS = tuple(
    {os.path.join(sysconfig.get_paths()[key], "") for key in ("stdlib", "platstdlib")}
)
_SITE_PACKAGES = "site-packages"
# Installed packages whose only code on an op's path is a pass-through wrapper: a decorator
# that warns (``typing_extensions.deprecated``, which torch puts on ``quantize_dynamic`` and
# others; ``deprecated``, ``deprecation``) or forwards the call with the signature preserved
# (``wrapt``, ``decorator``). Their frames are nobody's line: the op belongs to the caller above.
# (``functools`` and ``contextlib`` shims are in the standard library, internal already.)
# Model code in other packages (a transformers modeling file) stays the user's.
WRAPPER_PACKAGES = frozenset({"typing_extensions", "wrapt", "decorator", "deprecated", "deprecation"})
_PACKAGE_DIRS = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)
_OPWATCH_DIR = os.path.dirname(os.path.dirname(__file__)) + os.sep  # opwatch/
# The demo's scripts ship inside the package but are user code.
_EXAMPLES_DIR = _OPWATCH_DIR + "examples" + os.sep


_ENGINE_CODE = engine_entry_code()


def classify_code(code: types.CodeType) -> int:
    """Whether frames running ``code`` belong to the user (``USER``) or to torch/opwatch, the
    standard library or a wrapper-only package (``INTERNAL``, see ``WRAPPER_PACKAGES``)."""
    if code is _ENGINE_CODE:
        return ENGINE
    filename = code.co_filename
    if filename.startswith(_EXAMPLES_DIR):
        return USER
    if filename.startswith(_TORCH_DIR) or filename.startswith(_OPWATCH_DIR):
        return INTERNAL
    if filename.startswith("<frozen "):
        return INTERNAL
    if filename.startswith(_STDLIB_DIRS) and _SITE_PACKAGES not in filename and "dist-packages" not in filename:
        return INTERNAL
    if _top_level_package(filename) in WRAPPER_PACKAGES:
        return INTERNAL
    return USER


def _top_level_package(filename: str) -> str | None:
    """``typing_extensions`` for ``.../site-packages/typing_extensions.py``, ``wrapt`` for
    ``.../site-packages/wrapt/wrappers.py``; ``None`` outside an installed-packages folder."""
    for marker in _PACKAGE_DIRS:
        at = filename.rfind(marker)
        if at >= 0:
            top = filename[at + len(marker) :].split(os.sep, 1)[0]
            return top[:-3] if top.endswith(".py") else top
    return None


# The "is this frame user code?" answer, per code object (a pure function of the code object),
# keyed by id: hashing a code object hashes its bytecode and constants each time. The code
# objects are kept in ``_known_codes`` so that their ids stay theirs. Bounded: a process that
# runs many short watches over ever new functions (a test suite, generated code) must not keep
# every function it ever saw; past the limit both start afresh (classifying is cheap).
CODE_CACHE_LIMIT = 2048
_code_kinds: dict = {}
_known_codes: list = []


def user_frame(frame, stop_frame=None, stop_answer=None):
    """The innermost user frame from ``frame`` outwards: ``(code, lasti, reached_engine)``.

    ``reached_engine`` is true when the walk met autograd's engine entry before any user frame:
    the op is run by the engine, not by user code such as a backward hook. Meeting
    ``stop_frame`` (where the innermost running module was called) ends the walk with
    ``stop_answer``, the answer already worked out for that call: walks stay a few frames long
    however deep the module nesting.
    """
    kinds = _code_kinds
    while frame is not None:
        if frame is stop_frame:
            return stop_answer
        code = frame.f_code
        kind = kinds.get(id(code))
        if kind is None:
            if len(_known_codes) >= CODE_CACHE_LIMIT:
                kinds.clear()
                _known_codes.clear()
            kind = kinds[id(code)] = classify_code(code)
            _known_codes.append(code)
        if kind == USER:
            return code, frame.f_lasti, False
        if kind == ENGINE:
            return None, 0, True
        frame = frame.f_back
    return None, 0, False


def program_line(frame) -> str | None:
    """``file:line`` of the innermost frame, from ``frame`` outwards, that runs the program's
    own code (not torch, opwatch, the standard library or an installed package), or ``None``."""
    while frame is not None:
        code = frame.f_code
        if classify_code(code) == USER and _top_level_package(code.co_filename) is None:
            return f"{display_path(code.co_filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return None


class UserLine(NamedTuple):
    """The line a warning is issued at (:func:`user_line`), kept after its frame returned."""

    filename: str
    lineno: int
    module_globals: dict  # the module's: its name, its warning registry, its loader


def user_line(frame=None) -> UserLine:
    """The user's line, the way Python shows its own warnings: the innermost frame from
    ``frame`` (the caller's by default) outwards that runs the program's own code, not torch,
    opwatch, the standard library or an installed package (a trainer's ``call.py``,
    ``torch/optim/optimizer.py``); when there is none, the innermost user frame as ops are
    attributed (:func:`classify_code`), else the caller."""
    start = frame if frame is not None else sys._getframe(1)
    found = fallback = None
    walk = start
    while walk is not None:
        code = walk.f_code
        if classify_code(code) == USER:
            if _top_level_package(code.co_filename) is None:
                found = walk
                break
            fallback = fallback or walk
        walk = walk.f_back
    at = found or fallback or start
    try:
        return UserLine(at.f_code.co_filename, at.f_lineno, at.f_globals)
    finally:
        del start, walk, at, found, fallback


def attributed_line(frame) -> UserLine | None:
    """The line an op run from ``frame`` is attributed to: the innermost user frame from it
    outwards (:func:`classify_code`), an installed package's included (a Hugging Face model's
    line); ``None`` where there is none (a backward op on a device's autograd thread)."""
    while frame is not None:
        code = frame.f_code
        if classify_code(code) == USER:
            return UserLine(code.co_filename, frame.f_lineno, frame.f_globals)
        frame = frame.f_back
    return None


def warn_at_user(warning: Warning, *, frame=None, line: UserLine | None = None) -> None:
    """Issue ``warning`` at the user's line (:func:`user_line` from ``frame``, the caller's by
    default), or at ``line``, kept from an earlier moment (a run that ended after a failed
    step: the step's line, not opwatch's own). Python's once-per-location filters then apply
    to that line."""
    if line is None:
        line = user_line(frame if frame is not None else sys._getframe(1))
    context = line.module_globals
    registry = context.setdefault("__warningregistry__", {})
    place = (warning, type(warning), line.filename, line.lineno)
    module = context.get("__name__", "<string>")
    try:
        warnings.warn_explicit(*place, module=module, registry=registry, module_globals=context)
    except (ImportError, OSError, IndexError):
        # The module's loader cannot give its source by that name: a script run with
        # ``python -m package.main`` is ``__main__`` to its loader's ``package.main``; or
        # gives a source shorter than the line: code run by exec(open(path).read()) in a
        # script's globals, whose loader holds the script. Python reads the line from the file
        # instead (nothing was warned yet).
        warnings.warn_explicit(*place, module=module, registry=registry)


class Position:
    """Line and column range of one instruction, as CPython reports it (columns from 3.11)."""

    __slots__ = ("filename", "lineno", "end_lineno", "col", "end_col")

    def __init__(self, filename, lineno, end_lineno=None, col=None, end_col=None):
        self.filename = filename
        self.lineno = lineno
        self.end_lineno = end_lineno
        self.col = col
        self.end_col = end_col

    def line_text(self) -> str:
        """The source line, without its indentation or newline ('' when unavailable)."""
        return source_line(self.filename, self.lineno).strip()

    def expression(self) -> str | None:
        """The sub-expression that issued the op, e.g. ``y - pred``, when columns are known
        and it fits on one line; ``None`` otherwise."""
        if self.col is None or self.end_col is None or self.end_lineno != self.lineno:
            return None
        line = source_line(self.filename, self.lineno)
        # co_positions counts columns in UTF-8 bytes.
        raw = line.encode("utf-8")
        text = raw[self.col : self.end_col].decode("utf-8", errors="replace").strip()
        return text or None

    def caret_lines(self) -> list[str]:
        """The source line and a ``^^^`` marker under the sub-expression, ready to print."""
        line = source_line(self.filename, self.lineno).rstrip("\n")
        if not line:
            return []
        stripped = line.lstrip()
        indent = len(line) - len(stripped)
        lines = [stripped]
        if self.col is not None and self.end_col is not None and self.end_lineno == self.lineno:
            raw = line.encode("utf-8")
            start = len(raw[: self.col].decode("utf-8", errors="replace")) - indent
            width = len(raw[self.col : self.end_col].decode("utf-8", errors="replace"))
            if start >= 0 and width > 0 and width < len(stripped):
                lines.append(" " * start + "^" * width)
        return lines


def source_line(filename: str | None, lineno: int | None) -> str:
    if not filename or not lineno:
        return ""
    return linecache.getline(filename, lineno)


@lru_cache(maxsize=256)
def lone_call(filename: str | None, lineno: int | None, names: frozenset) -> str | None:
    """The source text of the one call on line ``lineno`` whose callee's last name is in
    ``names`` (``torch.tensor(0.0)`` for ``{"tensor"}``); ``None`` where the line holds none or
    several, or does not parse alone. Stands in for a sub-expression where Python (3.10) has no
    column positions."""
    line = source_line(filename, lineno).strip()
    try:
        tree = ast.parse(line)
    except SyntaxError:
        return None
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
             and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) in names]
    if len(calls) != 1:
        return None
    (call,) = calls
    return ast.get_source_segment(line, call)


@lru_cache(maxsize=4096)
def _positions(code: types.CodeType) -> tuple:
    if sys.version_info >= (3, 11):
        return tuple(code.co_positions())
    # Python 3.10: no columns; map byte offsets to lines.
    lines = {}
    for start, end, line in code.co_lines():
        for offset in range(start, end, 2):
            lines[offset // 2] = (line, line, None, None)
    return tuple(lines.get(i, (None, None, None, None)) for i in range(len(code.co_code) // 2))


def position_of(code: types.CodeType | None, lasti: int) -> Position:
    """The source position of the instruction at byte offset ``lasti`` in ``code``."""
    if code is None:
        return Position(None, None)
    positions = _positions(code)
    index = lasti // 2
    if 0 <= index < len(positions):
        lineno, end_lineno, col, end_col = positions[index]
        if lineno is not None:
            return Position(code.co_filename, lineno, end_lineno, col, end_col)
    return Position(code.co_filename, code.co_firstlineno)


# -- the one location format ----------------------------------------------------------


def file_line(code: types.CodeType | None, lasti: int) -> str | None:
    """``train.py:8``: the line at ``(code, offset)`` (a call site), ``None`` if unknown."""
    if code is None:
        return None
    position = position_of(code, lasti)
    return f"{display_path(position.filename)}:{position.lineno}"


def display_path(filename: str | None) -> str:
    """How a source file is shown everywhere: relative to the working directory when it lies
    below it; else relative to the ``sys.path`` entry it was imported from (``site-packages``:
    ``transformers/models/gpt2/modeling_gpt2.py``); else as given."""
    if not filename:
        return "?"
    try:
        relative = os.path.relpath(filename)
    except ValueError:  # another drive on Windows
        relative = ".."
    if not relative.startswith(".."):
        return relative
    best = None
    for entry in sys.path:
        if entry and filename.startswith(os.path.join(entry, "")) and (best is None or len(entry) > len(best)):
            best = entry
    if best is not None and ("site-packages" in best or "dist-packages" in best):
        return os.path.relpath(filename, best)
    return filename


def location(record) -> str:
    """``train.py:23``; the name of a place without a source line where one is known (the DDP
    reducer's ops: ``DDP bucket [fc2.bias, fc2.weight]``); ``autograd`` for backward ops
    autograd ran without a forward line (gradient accumulation); ``?`` when no user frame was
    found."""
    position = record.position
    if position.filename is None:
        label = getattr(record, "label", None)
        if label:
            return label
        return "autograd" if record.phase == "backward" else "?"
    return f"{display_path(position.filename)}:{position.lineno}"
