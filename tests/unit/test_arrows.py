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
* The client -- ``fabricd/__init__.py``, ``fabricd/client/`` and every module they import, at
  any depth -- loads no event loop and nothing above it: no asyncio, uvloop, daemon, transports
  or CLI (every training script imports it).  Checked on the source, ``TYPE_CHECKING`` imports
  included as for the engines, and by importing ``fabricd`` in a fresh interpreter.
* No import circle between modules under ``fabricd/``: ``from pkg import name`` counts as an
  import of ``pkg.name`` where that is a module, imports inside functions count (a circle hidden
  in a function is still two modules that need each other), ``TYPE_CHECKING`` imports do not:
  they never run, so they cannot leave a module half-initialised, and two classes that name
  each other's types (a node and the view that reads its counters) are no circle of code.  A
  package's ``__init__`` is not counted as imported by its submodules: Python runs it first,
  and a registry in ``__init__`` that imports its own submodules is how packages are built.

Each rule is a small ast visitor; the ``*_catches_*`` tests feed each one a bad snippet, so a
rule that silently stopped matching would fail here rather than pass vacuously.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

import fabricd

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

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
#: what the client, and whatever it imports, may never import
CLIENT_FORBIDDEN = (
    "asyncio",
    "uvloop",
    "fabricd.daemon",
    "fabricd.transports",
    "fabricd.cli",
    "transports",
    "cli",
)
#: the one-liner of issue 21: what `import fabricd` loads of the event loop, daemon, transports
CLIENT_LOADS = (
    "import fabricd, sys; print(sorted(m for m in sys.modules if m.startswith(('asyncio', "
    "'uvloop', 'fabricd.daemon', 'fabricd.transports'))))"
)
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


@dataclass(frozen=True)
class Module:
    """One module's source, as the import graph reads it."""

    source: str
    is_package: bool = False


def package_modules() -> dict[str, Module]:
    """Every module under ``fabricd/`` (transports and cli through their symlinks), by name."""
    return {
        module_name(path): Module(path.read_text(), path.name == "__init__.py")
        for path in python_files(PACKAGE)
    }


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """The ids of every node under an ``if TYPE_CHECKING:`` (its body; never run)."""
    hidden: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            for statement in node.body:
                hidden.update(id(inner) for inner in ast.walk(statement))
    return hidden


def module_imports(
    name: str, module: Module, known: Iterable[str], *, type_checking: bool
) -> set[str]:
    """The modules of ``known`` that ``name`` imports: ``from pkg import x`` is ``pkg.x`` where
    that is a module, else ``pkg``; relative imports resolved; imports inside functions count,
    ``TYPE_CHECKING`` ones only with ``type_checking``."""
    known = set(known)
    tree = ast.parse(module.source)
    hidden = set() if type_checking else _type_checking_nodes(tree)
    package = name if module.is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")
                parent = parent[: len(parent) - (node.level - 1)]
                base = ".".join(filter(None, [*parent, base]))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {target for target in found if target in known and target != name}


def import_graph(modules: Mapping[str, Module], *, type_checking: bool) -> dict[str, set[str]]:
    """module -> the modules it imports, among ``modules``."""
    return {
        name: module_imports(name, module, modules, type_checking=type_checking)
        for name, module in modules.items()
    }


def reachable(graph: Mapping[str, set[str]], roots: Iterable[str]) -> set[str]:
    """``roots`` and every module they import, at any depth, each with the packages above it
    (importing ``a.b.c`` runs ``a`` and ``a.b`` first)."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += graph.get(name, set())
            todo += [parent for parent in _parents(name) if parent in graph]
    return seen


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def client_findings(modules: Mapping[str, Module]) -> list[Finding]:
    """What the client, and every module it imports (``TYPE_CHECKING`` included), imports of
    :data:`CLIENT_FORBIDDEN`: each at the line that imports it, not inside it."""
    graph = import_graph(modules, type_checking=True)
    forbidden = {name for name in graph if is_under(name, CLIENT_FORBIDDEN)}
    client = {name: targets - forbidden for name, targets in graph.items()}
    roots = [name for name in modules if name == "fabricd" or is_under(name, ("fabricd.client",))]
    findings: list[Finding] = []
    for name in sorted(reachable(client, roots)):
        module = modules[name]
        where = name.replace(".", "/") + ("/__init__.py" if module.is_package else ".py")
        findings += forbidden_imports(module.source, name, CLIENT_FORBIDDEN, where)
    return findings


def import_cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """One circle through each group of modules that import each other (Tarjan's strongly
    connected components), as a path that starts and ends at the same module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(name: str) -> None:  # recursion depth is the longest import chain: a few dozen
        index[name] = low[name] = len(index)
        stack.append(name)
        for target in sorted(graph[name]):
            if target not in index:
                visit(target)
                low[name] = min(low[name], low[target])
            elif target in stack:
                low[name] = min(low[name], index[target])
        if low[name] == index[name]:
            group = {stack.pop()}
            while name not in group:
                group.add(stack.pop())
            if len(group) > 1:
                groups.append(group)

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return [_circle(graph, group) for group in groups]


def _circle(graph: Mapping[str, set[str]], group: set[str]) -> list[str]:
    """A shortest import path from the group's first module back to itself, within the group."""
    start = min(group)
    paths = {start: [start]}
    todo = [start]
    while todo:
        name = todo.pop(0)
        for target in sorted(graph[name] & group):
            if target == start:
                return [*paths[name], start]
            if target not in paths:
                paths[target] = [*paths[name], target]
                todo.append(target)
    raise AssertionError(f"{sorted(group)} is no circle")


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


def test_the_client_loads_no_event_loop_daemon_or_transport() -> None:
    findings = client_findings(package_modules())
    assert not findings, (
        "the client and what it imports must not import asyncio, uvloop, the daemon, the "
        "transports or the CLI (training scripts import it):\n" + report(findings)
    )


def test_importing_fabricd_loads_no_event_loop_daemon_or_transport() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CLIENT_LOADS], capture_output=True, text=True, check=True
    )
    assert done.stdout == "[]\n", done.stdout


def test_no_import_circle_between_modules() -> None:
    cycles = import_cycles(import_graph(package_modules(), type_checking=False))
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


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
        "import asyncio",
        "from asyncio import get_running_loop",
        "import uvloop",
        "from fabricd.daemon.ipc_server import IpcServer",
        "from fabricd import daemon",
        "from ..daemon import logs",  # as fabricd/client/x.py
        "from fabricd.transports import batch",
        "import fabricd.cli.ctl",
        "def f():\n    import asyncio",
        "if TYPE_CHECKING:\n    from fabricd.daemon.config import Config",
    ],
)
def test_client_rule_catches(source: str) -> None:
    assert forbidden_imports(source, "fabricd.client.x", CLIENT_FORBIDDEN, "x.py")


@pytest.mark.parametrize(
    "source",
    [
        "import socket",
        "import threading",
        "import numpy as np",
        "from fabricd.ipc import REPLY_LIMITS",
        "from fabricd.engines.ps.filters import FilterSettings",
        "from . import checks",
    ],
)
def test_client_rule_allows(source: str) -> None:
    assert forbidden_imports(source, "fabricd.client.x", CLIENT_FORBIDDEN, "x.py") == []


def test_client_rule_catches_what_the_client_imports_through_other_modules() -> None:
    modules = {
        "fabricd": Module("from fabricd.client import connect", is_package=True),
        "fabricd.client": Module("from fabricd.client import checks", is_package=True),
        "fabricd.client.checks": Module("from fabricd.vocabulary import LIMIT"),
        "fabricd.vocabulary": Module("from fabricd.daemon.logs import RateLimitedLog"),
        "fabricd.daemon.logs": Module("import asyncio"),  # the daemon's own: not the client's
        "fabricd.client.ps": Module("from fabricd.frames.fields import MAX_NAME"),
        "fabricd.frames": Module("from .fields import MAX_NAME\nimport uvloop", is_package=True),
        "fabricd.frames.fields": Module("MAX_NAME = 200"),
    }
    found = {f.where for f in client_findings(modules)}
    assert found == {"fabricd/vocabulary.py:1", "fabricd/frames/__init__.py:2"}


@pytest.mark.parametrize(
    ("modules", "circle"),
    [
        (
            {"fabricd.a": Module("import fabricd.b"), "fabricd.b": Module("from fabricd import a")},
            ["fabricd.a", "fabricd.b", "fabricd.a"],
        ),
        (  # relative, three long, and one of them a package; imports inside a function count
            {
                "fabricd.p": Module("from .q import x", is_package=True),
                "fabricd.p.q": Module("def f():\n    from fabricd.r import y"),
                "fabricd.r": Module("from fabricd.p import z"),
            },
            ["fabricd.p", "fabricd.p.q", "fabricd.r", "fabricd.p"],
        ),
    ],
)
def test_cycle_rule_catches(modules: dict[str, Module], circle: list[str]) -> None:
    assert import_cycles(import_graph(modules, type_checking=False)) == [circle]


def test_cycle_rule_leaves_out_type_checking_and_a_package_under_its_submodules() -> None:
    modules = {
        "fabricd.wire": Module("from fabricd.integrity import TRAILER"),
        "fabricd.integrity": Module(
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fabricd.wire import Kind"
        ),
        "fabricd.frames": Module("from fabricd.frames.p2p import Data", is_package=True),
        "fabricd.frames.p2p": Module("from fabricd.frames.fields import MAX"),  # no edge to ...
        "fabricd.frames.fields": Module("from fabricd.wire import get_int"),  # ... fabricd.frames
    }
    assert import_cycles(import_graph(modules, type_checking=False)) == []
    with_types = import_graph(modules, type_checking=True)
    assert import_cycles(with_types) == [["fabricd.integrity", "fabricd.wire", "fabricd.integrity"]]


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
