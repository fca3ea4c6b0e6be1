"""The COLL frame's NOTICE notes (ledger.py): written only when there are some, read back
alike, and refused with a reason when malformed."""

from __future__ import annotations

from typing import Any

import pytest

from fabricd.errors import RemoteProtocolError
from fabricd.frames.collectives import MAX_NOTES, Coll

BASE = {
    "job": "j",
    "name": "grad",
    "r": 0,
    "t": 7,
    "off": 0,
    "lost": [2],
    "b": 3,
    "spec": {"kind": "allreduce"},
}


def test_notes_round_trip_and_are_absent_when_empty() -> None:
    plain = Coll.from_meta(dict(BASE))
    assert plain.notes == ()
    assert "n" not in plain.to_meta()
    notes = (((), 0, 2), ((2,), 3, -1))
    frame = Coll.from_meta({**BASE, "n": [[[], 0, 2], [[2], 3, -1]]})
    assert frame.notes == notes
    assert Coll.from_meta(frame.to_meta()) == frame


@pytest.mark.parametrize(
    ("notes", "why"),
    [
        ({"a": 1}, "field 'n' must be a list"),
        ([[[], 0, 0]] * (MAX_NOTES + 1), "at most"),
        ([[[], 0]], r"\[lost, base, last\]"),
        ([[5, 0, 0]], r"\[lost, base, last\]"),
        ([[["x"], 0, 0]], "node ids"),
        ([[[], -1, 0]], "base and last round"),
        ([[[], 0, -2]], "base and last round"),
        ([[[], 0, True]], "base and last round"),
    ],
)
def test_a_malformed_note_is_a_protocol_error(notes: Any, why: str) -> None:
    with pytest.raises(RemoteProtocolError, match=why):
        Coll.from_meta({**BASE, "n": notes})
