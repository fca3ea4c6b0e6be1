"""Imports point only down the layers, checked on the source; no pickle, eval or exec.

* ``fabricd/engines/*.py``, ``fabricd/wire.py``, ``fabricd/frames.py`` and
  ``fabricd/integrity.py`` are sans-IO: no
  event loop, sockets, clock, daemon, transports, CLI or prometheus-client (the daemon reads
  their counters and exports them).  Imports under ``TYPE_CHECKING``
  count too: an engine that needs a transport's type has its arrow pointing the wrong way.
* ``transports/`` knows frames, never engines, the daemon or the CLI.
* Nothing under ``fabricd/`` (``transports/`` and ``cli/`` included, through their symlinks)
  uses pickle, ``eval`` or ``exec``.
* Engines take randomness and time as arguments: no module-level ``random`` functions, no RNG
  they make themselves, no ``secrets``/``os.urandom``, no wall clock.

Each rule is a small ast visitor; the ``*_catches_*`` tests feed each one a bad snippet, so a
rule that silently stopped matching would fail here rather than pass vacuously.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

import fabricd

PACKAGE = Path(fabricd.__file__).resolve().parent
ENGINES = PACKAGE / "engines"
TRANSPORTS = PACKAGE / "transports"

#: what a sans-IO module may never import (bare ``transports``/``cli`` too: never installed)
SANS_IO_FORBIDDEN = (
    "asyncio",
    "socket",
    "selectors",
    "time",
    "uvloop",
    "prometheus_client",  # the daemon reads engines' counters; engines never export
    "fabricd.daemon",
    "fabricd.transports",
    "fabricd.cli",
    "transports",
    "cli",
)
TRANSPORT_FORBIDDEN = ("fabricd.engines", "fabricd.daemon", "fabricd.cli", "engines", "daemon")
UNSAFE_MODULES = ("pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "marshal")
UNSAFE_CALLS = ("eval", "exec")
NONDETERMINISTIC_MODULES = ("secrets",)


@dataclass(frozen=True)
class Finding:
    where: str
    what: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


def python_files(folder: Path) -> list[Path]:
    """Every .py file below ``folder``, following symlinked folders (fabricd/transports, cli)."""
    found = []
    for root, _, files in os.walk(folder, followlinks=True):
        found += [Path(root, name) for name in files if name.endswith(".py")]
    return sorted(found)


def module_name(path: Path) -> str:
    """The dotted name a file has inside the installed package (through the symlinks)."""
    relative = Path(os.path.relpath(path, PACKAGE.parent)).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(tree: ast.AST, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, dotted name) of everything imported, relative imports resolved, ``from x import
    y`` counted as both ``x`` and ``x.y`` (y may be a submodule)."""
    names: list[tuple[int, str]] = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")
                parent = parent[: len(parent) - (node.level - 1)]
                base = ".".join(filter(None, [*parent, base]))
            names.append((node.lineno, base))
            names += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return names


def is_under(name: str, roots: tuple[str, ...]) -> str | None:
    return next((root for root in roots if name == root or name.startswith(root + ".")), None)


def forbidden_imports(
    source: str, module: str, roots: tuple[str, ...], where: str
) -> list[Finding]:
    tree = ast.parse(source)
    is_package = where.endswith("__init__.py")
    return [
        Finding(f"{where}:{line}", f"imports {name} ({root} is forbidden here)")
        for line, name in imported_modules(tree, module, is_package)
        if (root := is_under(name, roots)) is not None
    ]


def unsafe_code(source: str, where: str) -> list[Finding]:
    """pickle-family imports and eval/exec calls: nothing received may become code."""
    tree = ast.parse(source)
    found = [
        Finding(f"{where}:{line}", f"imports {name}")
        for line, name in imported_modules(tree, "")
        if is_under(name, UNSAFE_MODULES)
    ]
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        builtin = isinstance(func, ast.Name) and func.id in UNSAFE_CALLS
        qualified = (
            isinstance(func, ast.Attribute)
            and func.attr in UNSAFE_CALLS
            and _is_builtins(func.value)  # not cursor.execute or some object's exec method
        )
        if builtin or qualified:
            name = func.id if isinstance(func, ast.Name) else ast.unparse(func)
            found.append(Finding(f"{where}:{node.lineno}", f"calls {name}()"))
    return found


def _is_builtins(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("builtins", "__builtins__")


def hidden_inputs(source: str, where: str) -> list[Finding]:
    """Randomness or wall-clock time that was not handed to the engine."""
    tree = ast.parse(source)
    found: list[Finding] = []
    random_names: set[str] = set()  # names bound to random-module functions
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "random":
            for alias in node.names:
                if alias.name != "Random":
                    found.append(Finding(f"{where}:{node.lineno}", f"imports random.{alias.name}"))
                else:
                    random_names.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for line, name in imported_modules(node, ""):
                if is_under(name, NONDETERMINISTIC_MODULES):
                    found.append(Finding(f"{where}:{line}", f"imports {name}"))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            owner, attr = func.value.id, func.attr
            if owner == "random":
                found.append(Finding(f"{where}:{node.lineno}", f"calls random.{attr}()"))
            elif (owner, attr) in {("os", "urandom"), ("uuid", "uuid1"), ("uuid", "uuid4")}:
                found.append(Finding(f"{where}:{node.lineno}", f"calls {owner}.{attr}()"))
            elif owner in ("datetime", "date") and attr in ("now", "utcnow", "today"):
                found.append(Finding(f"{where}:{node.lineno}", f"reads the clock ({owner}.{attr})"))
        elif isinstance(func, ast.Name) and func.id in random_names:
            found.append(Finding(f"{where}:{node.lineno}", f"makes its own {func.id}()"))
    return found


def check(paths: list[Path], rule: str) -> list[Finding]:
    findings: list[Finding] = []
    for path in paths:
        source = path.read_text()
        where = os.path.relpath(path, PACKAGE.parent)
        if rule == "sans-io":
            findings += forbidden_imports(source, module_name(path), SANS_IO_FORBIDDEN, where)
        elif rule == "transport":
            findings += forbidden_imports(source, module_name(path), TRANSPORT_FORBIDDEN, where)
        elif rule == "unsafe":
            findings += unsafe_code(source, where)
        else:
            findings += hidden_inputs(source, where)
    return findings


def report(findings: list[Finding]) -> str:
    return "\n".join(map(str, findings))


# -- the rules on the real tree ---------------------------------------------------------------
def test_the_tree_is_where_the_rules_expect_it() -> None:
    engines = python_files(ENGINES)
    names = {str(p.relative_to(ENGINES)) for p in engines}
    assert names >= {"link/handshake.py", "link/peers.py", "membership.py", "p2p/matching.py"}
    assert {p.name for p in python_files(TRANSPORTS)} >= {"base.py", "framing.py", "tcp.py"}
    assert any(p.parent.name == "cli" for p in python_files(PACKAGE))  # the symlink is walked


def test_engines_are_sans_io() -> None:
    findings = check(python_files(ENGINES), "sans-io")
    assert not findings, "engines must not do I/O or know the layers above:\n" + report(findings)


def test_wire_and_frames_are_sans_io() -> None:
    findings = check(
        [PACKAGE / "wire.py", *python_files(PACKAGE / "frames"), PACKAGE / "integrity.py"],
        "sans-io",
    )
    assert not findings, report(findings)


def test_transports_know_frames_never_engines() -> None:
    findings = check(python_files(TRANSPORTS), "transport")
    assert not findings, "transports must not import engines or the daemon:\n" + report(findings)


def test_no_pickle_eval_or_exec_anywhere() -> None:
    findings = check(python_files(PACKAGE), "unsafe")
    assert not findings, "pickle, eval or exec:\n" + report(findings)


def test_engines_take_randomness_and_time_as_arguments() -> None:
    findings = check(python_files(ENGINES), "inputs")
    assert not findings, "inject a random.Random / nonce / now instead:\n" + report(findings)


# -- the rules catch what they are meant to catch ---------------------------------------------
@pytest.mark.parametrize(
    "source",
    [
        "import asyncio",
        "import time as clock",
        "from socket import socket",
        "import selectors",
        "import uvloop",
        "from fabricd.daemon import node",
        "from fabricd import daemon",
        "from fabricd import transports",
        "import fabricd.transports.tcp",
        "from transports import tcp",
        "import cli",
        "from ..daemon.node import Node",
        "from .. import cli",
        "if TYPE_CHECKING:\n    from fabricd.transports.base import Link",
        "import prometheus_client",
        "from prometheus_client.core import CounterMetricFamily",
        "from fabricd.daemon.metrics import counter",
    ],
)
def test_sans_io_rule_catches(source: str) -> None:
    assert forbidden_imports(source, "fabricd.engines.x", SANS_IO_FORBIDDEN, "x.py")


@pytest.mark.parametrize(
    "source",
    [
        "import random",
        "from fabricd.wire import Kind",
        "from . import membership",
        "from .membership import Membership",
        "import datetime",
        "from fabricd.errors import UsageError",
        "import timeit  # a different module that starts with 'time'",
    ],
)
def test_sans_io_rule_allows(source: str) -> None:
    assert forbidden_imports(source, "fabricd.engines.x", SANS_IO_FORBIDDEN, "x.py") == []


@pytest.mark.parametrize(
    "source",
    [
        "from fabricd.engines.p2p.matching import Messaging",
        "from fabricd import engines",
        "import fabricd.daemon.node",
        "from ..engines import peers",  # as fabricd/transports/x.py
    ],
)
def test_transport_rule_catches(source: str) -> None:
    assert forbidden_imports(source, "fabricd.transports.x", TRANSPORT_FORBIDDEN, "x.py")


@pytest.mark.parametrize(
    "source",
    [
        "import pickle",
        "from pickle import loads",
        "import marshal",
        "eval(data)",
        "exec(code, {})",
        "builtins.eval(data)",
    ],
)
def test_unsafe_rule_catches(source: str) -> None:
    assert unsafe_code(source, "x.py")


@pytest.mark.parametrize("source", ["cursor.execute(q)", "ast.literal_eval(s)", "self.exec(x)"])
def test_unsafe_rule_allows(source: str) -> None:
    assert unsafe_code(source, "x.py") == []


@pytest.mark.parametrize(
    "source",
    [
        "import random\nrandom.random()",
        "import random\nrandom.choice(xs)",
        "import random\nrng = random.Random()",
        "from random import shuffle",
        "from random import Random\nrng = Random(4)",
        "import secrets",
        "import os\nos.urandom(32)",
        "import uuid\nuuid.uuid4()",
        "from datetime import datetime\ndatetime.now()",
    ],
)
def test_inputs_rule_catches(source: str) -> None:
    assert hidden_inputs(source, "x.py")


@pytest.mark.parametrize(
    "source",
    [
        "import random\ndef f(rng: random.Random) -> int:\n    return rng.randrange(4)",
        "from random import Random\ndef f(rng: Random) -> float:\n    return rng.random()",
        "def f(now: float) -> float:\n    return now + 1",
    ],
)
def test_inputs_rule_allows(source: str) -> None:
    assert hidden_inputs(source, "x.py") == []


def test_module_names_follow_the_symlinks() -> None:
    assert module_name(TRANSPORTS / "tcp.py") == "fabricd.transports.tcp"
    assert module_name(ENGINES / "__init__.py") == "fabricd.engines"
    assert module_name(PACKAGE / "wire.py") == "fabricd.wire"
