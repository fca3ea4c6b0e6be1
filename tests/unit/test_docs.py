"""The docs stay true to the repository (issue 27, item 4): every relative link in docs/ and
the README resolves to a file inside the repository (and a ``#section`` to a heading there),
and the protocol version the docs state is ``wire.PROTOCOL_VERSION``.

docs/graphs.md once cited ``../shared/papers/...``, a folder no clone has, and operations.md
said "protocol version 2" four versions after it changed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fabricd.wire import PROTOCOL_VERSION

ROOT = Path(__file__).resolve().parents[2]
DOCS = [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]

#: ``[text](target)`` and ``![alt](target)``; ``[name]: target`` (a reference definition)
_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
#: a path in a code span that starts at a relative directory: ``../x``, ``./x``
_CODE_PATH = re.compile(r"`(\.\.?/[^`\s]+)`")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, mailto:, ...


def _text(doc: Path) -> str:
    """``doc`` without its fenced code blocks (commands and output, not links)."""
    return _FENCE.sub("", doc.read_text())


def relative_links(doc: Path) -> list[str]:
    """Every link in ``doc`` that is not external (``#section`` alone: one of ``doc``'s)."""
    text = _text(doc)
    found = _LINK.findall(text) + _REFERENCE.findall(text) + _CODE_PATH.findall(text)
    return [t for t in found if not _EXTERNAL.match(t)]


def anchors(doc: Path) -> set[str]:
    """The ``#section`` names of ``doc``'s headings, as GitHub makes them: lower case, only
    letters, digits, spaces, ``-`` and ``_`` kept, spaces made ``-``; repeats get ``-1``, ..."""
    seen: dict[str, int] = {}
    names = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", _text(doc), re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        names.add(slug if count == 0 else f"{slug}-{count}")
    return names


def broken(doc: Path, root: Path = ROOT) -> list[str]:
    """The relative links of ``doc`` that lead nowhere, or out of ``root`` (the repository)."""
    wrong = []
    for link in relative_links(doc):
        path, _, section = link.partition("#")
        target = (doc.parent / path).resolve() if path else doc
        if not target.is_relative_to(root):
            wrong.append(f"{link}: outside the repository")
        elif not target.exists():
            wrong.append(f"{link}: no such file")
        elif section and target.suffix == ".md" and section not in anchors(target):
            wrong.append(f"{link}: no heading makes #{section}")
    return wrong


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_relative_link_resolves_inside_the_repository(doc: Path) -> None:
    assert broken(doc) == []


#: the ways the docs state the version spoken now
_VERSION = re.compile(
    r"speaks protocol version (\d+)"
    r"|wire protocol, version (\d+)"
    r"|protocol version, must be (\d+)"
    r"|`(\d+)` \(`wire\.PROTOCOL_VERSION`"
    r"|the version is not (\d+)"
)


def stated_versions(text: str) -> list[int]:
    return [
        int(next(g for g in m.groups() if g)) for m in _VERSION.finditer(" ".join(text.split()))
    ]


def test_the_protocol_version_the_docs_state_is_the_wires() -> None:
    stated = {doc.name: stated_versions(doc.read_text()) for doc in DOCS}
    assert stated["operations.md"], "operations.md no longer says which version it speaks"
    assert len(stated["protocol.md"]) >= 3
    wrong = {name: v for name, v in stated.items() if any(n != PROTOCOL_VERSION for n in v)}
    assert wrong == {}, f"the wire speaks {PROTOCOL_VERSION}"


def test_the_checks_find_what_they_look_for(tmp_path: Path) -> None:
    """The checks themselves: a broken link of each form is found, a good one is not."""
    shared = _fake(tmp_path, "see `../shared/papers/x.txt`, run `./x` (not a link: `a/b`)")
    assert broken(shared, tmp_path) == [
        "../shared/papers/x.txt: outside the repository",
        "./x: no such file",
    ]
    links = _fake(tmp_path, "[a](operations.md#metrics) [b](https://x.org) [c](#y)\n## Why y")
    assert relative_links(links) == ["operations.md#metrics", "#y"]
    assert broken(links, tmp_path) == [
        "operations.md#metrics: no such file",
        "#y: no heading makes #y",
    ]
    assert broken(_fake(tmp_path, "[c](#why-y)\n## Why `y`?"), tmp_path) == []
    operations = anchors(ROOT / "docs" / "operations.md")
    assert {"limits", "status-counters", "fabricctl-top"} <= operations
    assert stated_versions("This release speaks protocol\nversion 2 (frames") == [2]


def _fake(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "doc.md"
    path.write_text(text)
    return path
