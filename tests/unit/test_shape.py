"""The house's shape, checked on the source: no module of ``fabricd/`` (``cli/`` and
``transports/`` included, through their symlinks) over :data:`MAX_MODULE_LINES` lines, no
function over :data:`MAX_FUNCTION_LINES`, and no service module over
:data:`MAX_SERVICE_LINES` (issue 21: a file that keeps growing is a capability that wants its
own package, and a long function a decision that wants a name).

The limits are the issue's; a module that must grow past them splits along its concepts
first (docs/architecture.md, "Adding a capability").  Each rule has a test that feeds it a bad
snippet, so a rule that stopped matching fails here rather than passing vacuously.
"""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING

from tests.unit.test_arrows import PACKAGE, Finding, python_files, report

if TYPE_CHECKING:
    from pathlib import Path

MAX_MODULE_LINES = 1000
MAX_SERVICE_LINES = 800
MAX_FUNCTION_LINES = 80
SERVICES = PACKAGE / "daemon" / "services"


def long_module(source: str, where: str, limit: int) -> list[Finding]:
    lines = len(source.splitlines())
    return [Finding(where, f"{lines} lines (at most {limit})")] if lines > limit else []


def long_functions(source: str, where: str) -> list[Finding]:
    """Functions whose code (their docstring aside: saying what and why is never too long)
    runs over :data:`MAX_FUNCTION_LINES` lines."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert node.end_lineno is not None
            lines = node.end_lineno - node.lineno + 1
            if ast.get_docstring(node, clean=False) is not None:
                doc = node.body[0]
                assert doc.end_lineno is not None
                lines -= doc.end_lineno - doc.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                what = f"{node.name}() is {lines} lines (at most {MAX_FUNCTION_LINES})"
                found.append(Finding(f"{where}:{node.lineno}", what))
    return found


def _relative(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent))


def test_no_module_is_over_the_limit() -> None:
    findings = [
        finding
        for path in python_files(PACKAGE)
        for finding in long_module(path.read_text(), _relative(path), MAX_MODULE_LINES)
    ]
    assert not findings, report(findings)


def test_no_service_module_is_over_the_limit() -> None:
    paths = python_files(SERVICES)
    assert {p.name for p in paths} >= {"p2p.py", "collectives.py", "stochastic.py", "ps.py"}
    findings = [
        finding
        for path in paths
        for finding in long_module(path.read_text(), _relative(path), MAX_SERVICE_LINES)
    ]
    assert not findings, report(findings)


def test_no_function_is_over_the_limit() -> None:
    findings = [
        finding
        for path in python_files(PACKAGE)
        for finding in long_functions(path.read_text(), _relative(path))
    ]
    assert not findings, report(findings)


def test_module_rule_catches() -> None:
    source = "x = 1\n" * (MAX_MODULE_LINES + 1)
    assert long_module(source, "m.py", MAX_MODULE_LINES) == [
        Finding("m.py", f"{MAX_MODULE_LINES + 1} lines (at most {MAX_MODULE_LINES})")
    ]
    assert long_module("x = 1\n" * MAX_MODULE_LINES, "m.py", MAX_MODULE_LINES) == []


def test_function_rule_catches() -> None:
    body = "    x = 1\n" * MAX_FUNCTION_LINES
    (finding,) = long_functions(f"def f():\n{body}\n\nasync def g():\n    pass\n", "m.py")
    assert finding.where == "m.py:1"
    assert finding.what.startswith("f() is 81 lines")
    method = "class C:\n    def f(self):\n" + "        x = 1\n" * (MAX_FUNCTION_LINES - 1)
    assert long_functions(method, "m.py") == []
    documented = 'def f():\n    """' + "words\n" * 50 + '"""\n' + "    x = 1\n" * 60
    assert long_functions(documented, "m.py") == []
