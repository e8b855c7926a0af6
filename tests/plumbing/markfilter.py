"""Leave out, before importing it, a test module that a ``-m`` expression deselects whole.

pytest applies ``-m`` after collection, so ``make unit`` used to import every process, netns and k8s test module
(schemathesis loading the OpenAPI document, kopf, the openai client) only to deselect all of their tests: about
half of its CPU time. A module is left out only when its marks are known from its source (``pytestmark`` and
plain ``@pytest.mark.<name>`` decorators on top-level ``test_*`` functions) and the expression is false for every
test whatever other marks it may get at run time; anything else (classes, other decorators, ``pytest.param``
marks) is imported as before, so the selected tests are exactly pytest's own selection.
"""

from __future__ import annotations

import ast
import itertools
import re
from collections.abc import Iterable
from pathlib import Path

from _pytest.mark.expression import Expression

# Plugins that only the fuzz tests use (process tier): ``make unit`` and the suite's own inner pytest runs turn them
# off, since loading them costs each process about 1.5 s of CPU, and pytester's in-process runs reload them every
# time (it restores ``sys.modules`` after each run).
UNUSED_IN_UNIT_PLUGINS = ("-p", "no:schemathesis", "-p", "no:hypothesispytest")

_NAME = re.compile(r"[A-Za-z_][\w.\-:\[\]]*")
_CALL = re.compile(r"([A-Za-z_][\w.\-:]*)\s*\(")
_KEYWORDS = {"and", "or", "not", "True", "False", "None"}


def _mark_name(node: ast.expr) -> str | None:
    """``pytest.mark.<name>`` or ``pytest.mark.<name>(...)`` -> name; anything else -> None."""
    if isinstance(node, ast.Call):
        node = node.func
    match node:
        case ast.Attribute(value=ast.Attribute(value=ast.Name(id="pytest"), attr="mark"), attr=name):
            return name
    return None


def _module_marks(tree: ast.Module) -> set[str] | None:
    marks: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            values = node.value.elts if isinstance(node.value, ast.List | ast.Tuple) else [node.value]
            names = [_mark_name(v) for v in values]
            if None in names:
                return None
            marks |= {n for n in names if n}
    return marks


def _test_marks(tree: ast.Module) -> list[set[str]] | None:
    """The static marks of each top-level test function, or None when a test's marks cannot be known here."""
    module = _module_marks(tree)
    if module is None:
        return None
    tests: list[set[str]] = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            return None
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
            names = [_mark_name(d) for d in node.decorator_list]
            if None in names or any(_has_param_marks(d) for d in node.decorator_list):
                return None
            tests.append(module | {n for n in names if n})
    return tests


def _has_param_marks(node: ast.expr) -> bool:
    return any(isinstance(n, ast.keyword) and n.arg == "marks" for n in ast.walk(node))


def _never_true(expression: Expression, free: Iterable[str], marks: set[str]) -> bool:
    """False for every assignment of the names the test's source does not fix (marks added at run time)."""
    unknown = sorted(set(free) - marks)
    for values in itertools.product((False, True), repeat=len(unknown)):
        extra = {n for n, v in zip(unknown, values, strict=True) if v}
        if expression.evaluate(lambda name, /, _m=marks | extra, **_kw: name in _m):
            return False
    return True


def deselected_whole(path: Path, markexpr: str) -> bool:
    """True when ``-m markexpr`` deselects every test of the module at ``path``, judged from its source."""
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return False
    if any(m.group(1) not in _KEYWORDS for m in _CALL.finditer(markexpr)):
        return False  # marks matched with arguments (-m "timeout(seconds=30)"): left to pytest
    expression = Expression.compile(markexpr)
    free = {n for n in _NAME.findall(markexpr) if n not in _KEYWORDS}
    module = _module_marks(tree)
    if module is not None and _never_true(expression, free, module):
        return True  # every test has at least the module's marks
    tests = _test_marks(tree)
    return tests is not None and bool(tests) and all(_never_true(expression, free, marks) for marks in tests)
