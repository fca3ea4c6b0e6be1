"""Typed views of peer and handshake frame metadata: what each kind carries, read at the edge."""

from __future__ import annotations

from typing import Any, get_args

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fabricd.engines.link.handshake import HANDSHAKE_LIMITS
from fabricd.errors import RemoteProtocolError
from fabricd.frames import fields as fields_frames
from fabricd.frames import link as link_frames
from fabricd.frames import membership as membership_frames
from fabricd.frames import monitor as monitor_frames
from fabricd.frames import p2p as p2p_frames
from fabricd.frames import ps as ps_frames
from fabricd.frames import registry
from fabricd.wire import (
    BULK_KINDS,
    DEFAULT_LIMITS,
    PROTOCOL_VERSION,
    Decoder,
    Frame,
    Kind,
    Meta,
    encode,
)

#: a parameter server's spec, as PUSH, PULL and REPLICATE carry it
PS_SPEC: Meta = {
    "n": 4,
    "size": 10_000,
    "dtype": "float32",
    "servers": [0, 1],
    "replicas": [],
    "consistency": "bsp",
    "staleness": 0,
    "delay_bound": 8,
    "chunk": 16,
    "scheduling": "arrival",
    "aggregation": False,
    "replication": "chain",
    "divergence_bound": None,
    "distribution": "direct",
}
#: the fields every parameter-server frame has
SHARD: Meta = {"job": "j", "name": "ps", "shard": 1, "server": 1}

EXAMPLES: list[registry.PeerFrame] = [
    link_frames.Heartbeat(),
    monitor_frames.Report(up=1.25e9, down=2.5e9, rtt=1e-4, age=0.1, source="configured"),
    monitor_frames.Report(
        up=0.0, down=12.5e9, rtt=0.0, age=0.0, source="default", paths=((0, 1e9), (2, 3.5e8))
    ),
    link_frames.Bye(),
    membership_frames.Announce(job="j", rank=3, size=4, present=True, owner=1000),
    membership_frames.Announce(job="j", rank=3, size=4, present=False, owner=0),
    p2p_frames.Rts(msg=1, job="j", src=0, dst=3, tag=7, nbytes=64, dtype="float32"),
    p2p_frames.Cts(msg=1),
    p2p_frames.Data(msg=1, off=4096),
    p2p_frames.Done(msg=1),
    p2p_frames.Done(msg=1, code="mismatch", error="sizes differ"),
    p2p_frames.Cancel(msg=9),
    ps_frames.Push(**SHARD, worker=3, iteration=7, base=6, epoch=0, spec=PS_SPEC),
    ps_frames.Push(
        **SHARD,
        worker=0,
        iteration=0,
        base=0,
        epoch=2,
        spec={**PS_SPEC, "replicas": [1, 0], "consistency": "async", "delay_bound": None},
    ),
    ps_frames.Pull(**SHARD, worker=3, clock=8, since=6, epoch=0, spec=PS_SPEC),
    ps_frames.Pushed(**SHARD, worker=3, iteration=7, version=9, epoch=0),
    ps_frames.Pushed(**SHARD, worker=3, iteration=7, version=9, epoch=0, dropped="delay 9 > 8"),
    ps_frames.Pulled(**SHARD, worker=3, clock=8, version=9, epoch=0),
    ps_frames.Pulled(
        **SHARD, worker=3, clock=8, version=9, epoch=1, error="not this epoch's server"
    ),
    ps_frames.Replicate(
        **SHARD, replica=0, index=1, entry="push", worker=3, iteration=7, base=6, spec=PS_SPEC
    ),
    ps_frames.Replicate(
        **{**SHARD, "server": 0},
        replica=1,
        index=2**40,
        entry="lose",
        worker=2,
        iteration=5,
        base=4,
        reason="worker lost",
        spec=PS_SPEC,
    ),
    ps_frames.Replicated(**SHARD, replica=0, index=1),
    ps_frames.Join(**SHARD, replica=0, epoch=3, spec=PS_SPEC),
    ps_frames.Opened(job="j", name="ps", rank=3, spec=PS_SPEC),
    ps_frames.Opened(job="j", name="ps", rank=0, spec=PS_SPEC, answer=True),
    ps_frames.Replicate(
        **SHARD,
        replica=1,
        index=0,
        entry="snapshot",
        worker=0,
        iteration=0,
        base=0,
        spec=PS_SPEC,
    ),
]


NONCE = b"n" * link_frames.NONCE_SIZE
HANDSHAKE_EXAMPLES: list[link_frames.HandshakeFrame] = [
    link_frames.Hello(node=0, incarnation=7, nonce=NONCE, channel="control"),  # the initiator's
    link_frames.Hello(node=1, incarnation=9, nonce=NONCE, mac=b"m" * 32),  # the acceptor's
    link_frames.Auth(mac=b"m" * 32),
]
#: a well-formed HELLO's metadata, for the malformed ones below
HELLO_META: Meta = {"v": PROTOCOL_VERSION, "node": 0, "inc": 1, "nonce": NONCE, "name": ""}


def without(meta: Meta, key: str) -> Meta:
    return {k: v for k, v in meta.items() if k != key}


def over_the_wire(frame: registry.PeerFrame) -> registry.PeerFrame:
    decoder = Decoder(DEFAULT_LIMITS)
    decoder.feed(encode(frame.KIND, frame.to_meta()))
    decoder.next_event()
    decoded = decoder.next_event()
    assert isinstance(decoded, Frame)
    return registry.parse(decoded.kind, decoded.meta)


@pytest.mark.parametrize("frame", EXAMPLES, ids=lambda f: type(f).__name__)
def test_every_view_survives_the_wire(frame: registry.PeerFrame) -> None:
    assert over_the_wire(frame) == frame


def handshake_over_the_wire(frame: link_frames.HandshakeFrame) -> link_frames.HandshakeFrame:
    """Through the codec under the limits of a link not yet authenticated, then parsed."""
    decoder = Decoder(HANDSHAKE_LIMITS)
    decoder.feed(encode(frame.KIND, frame.to_meta()))
    decoder.next_event()
    decoded = decoder.next_event()
    assert isinstance(decoded, Frame)
    return link_frames.parse_handshake(decoded.kind, decoded.meta)


@pytest.mark.parametrize("frame", HANDSHAKE_EXAMPLES, ids=["hello-i", "hello-a", "auth"])
def test_every_handshake_view_survives_the_wire(frame: link_frames.HandshakeFrame) -> None:
    assert handshake_over_the_wire(frame) == frame


def test_every_peer_kind_but_the_handshake_has_a_view() -> None:
    peer_kinds = {k for k in Kind if k < Kind.REQUEST} - {Kind.HELLO, Kind.AUTH}
    assert peer_kinds == registry.PEER_KINDS


def test_handshake_kinds_are_read_apart_from_the_peer_kinds() -> None:
    assert {Kind.HELLO, Kind.AUTH} == link_frames.HANDSHAKE_KINDS
    assert not link_frames.HANDSHAKE_KINDS & registry.PEER_KINDS


@pytest.mark.parametrize("kind", sorted(registry.PEER_KINDS | {Kind.REQUEST, Kind.REPLY}))
def test_parse_handshake_refuses_every_other_kind(kind: Kind) -> None:
    with pytest.raises(RemoteProtocolError, match="not a handshake frame"):
        link_frames.parse_handshake(kind, {})


def test_a_hello_of_another_protocol_version_names_both() -> None:
    meta = link_frames.Hello(
        version=PROTOCOL_VERSION + 1, node=0, incarnation=1, nonce=NONCE
    ).to_meta()
    with pytest.raises(RemoteProtocolError, match=f"protocol {PROTOCOL_VERSION + 1}, this daemon"):
        link_frames.parse_handshake(Kind.HELLO, meta)


@pytest.mark.parametrize(
    ("kind", "meta", "message"),
    [
        (Kind.HELLO, without(HELLO_META, "nonce"), "'nonce'"),
        (Kind.HELLO, {**HELLO_META, "nonce": b"short"}, "nonce has the wrong size"),
        (Kind.HELLO, {**HELLO_META, "node": -1}, "'node'"),
        (Kind.HELLO, without(HELLO_META, "inc"), "'inc'"),
        (Kind.HELLO, without(HELLO_META, "v"), "'v'"),
        (Kind.HELLO, without(HELLO_META, "name"), "'name'"),
        (Kind.HELLO, {**HELLO_META, "name": 7}, "'name'"),
        (Kind.HELLO, {**HELLO_META, "channel": 1}, "'channel'"),
        (Kind.HELLO, {**HELLO_META, "mac": "m"}, "'mac'"),
        (Kind.AUTH, {}, "'mac'"),
        (Kind.AUTH, {"mac": "not bytes"}, "'mac'"),
    ],
)
def test_a_bad_handshake_field_is_a_remote_protocol_error_naming_it(
    kind: Kind, meta: Meta, message: str
) -> None:
    with pytest.raises(RemoteProtocolError, match=message):
        link_frames.parse_handshake(kind, meta)


@pytest.mark.parametrize("kind", [Kind.HELLO, Kind.AUTH, Kind.REQUEST, Kind.REPLY, Kind.EVENT])
def test_kinds_a_peer_may_not_send_are_refused(kind: Kind) -> None:
    with pytest.raises(RemoteProtocolError, match="not a frame a peer may send"):
        registry.parse(kind, {})


@pytest.mark.parametrize(
    ("kind", "meta", "field"),
    [
        (Kind.RTS, {"msg": 1, "job": "j", "src": 0, "dst": 1, "tag": 0, "nbytes": 4}, "dtype"),
        (Kind.RTS, {"msg": -1, "job": "j", "src": 0, "dst": 1, "tag": 0, "nbytes": 4}, "msg"),
        (Kind.ANNOUNCE, {"job": "j", "rank": 0, "size": 0, "present": True}, "size"),
        (Kind.ANNOUNCE, {"job": 5, "rank": 0, "size": 1}, "job"),
        (Kind.CTS, {"msg": "1"}, "msg"),
        (Kind.DATA, {"msg": 1}, "off"),
        (Kind.DONE, {"msg": 1, "code": "x"}, "error"),
        (Kind.CANCEL, {}, "msg"),
        (Kind.MONITOR, {"down": 1.0, "rtt": 0.0, "age": 0.0, "src": "measured"}, "up"),
        (Kind.MONITOR, {"up": True, "down": 1, "rtt": 0, "age": 0, "src": "measured"}, "up"),
        (Kind.MONITOR, {"up": 1, "down": "1", "rtt": 0, "age": 0, "src": "measured"}, "down"),
        (Kind.MONITOR, {"up": 1, "down": 1, "rtt": 0, "age": 0, "src": 3}, "src"),
        (Kind.MONITOR, {"up": 1, "down": 1, "rtt": 0, "age": 0, "src": "x", "paths": 1}, "paths"),
        (
            Kind.MONITOR,
            {"up": 1, "down": 1, "rtt": 0, "age": 0, "src": "x", "paths": [[0]]},
            "paths",
        ),
        (
            Kind.MONITOR,
            {"up": 1, "down": 1, "rtt": 0, "age": 0, "src": "x", "paths": [[0, 1.0]] * 65},
            "paths",
        ),
    ],
)
def test_a_bad_field_is_a_remote_protocol_error_naming_it(
    kind: Kind, meta: dict, field: str
) -> None:
    with pytest.raises(RemoteProtocolError, match=field):
        registry.parse(kind, meta)


def test_a_done_carries_code_and_error_together() -> None:
    with pytest.raises(ValueError, match="both"):
        p2p_frames.Done(msg=1, code="mismatch")


@given(st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=8), max_size=8))
def test_parse_gives_a_view_of_its_kind_or_a_remote_protocol_error(meta: dict) -> None:
    for kind in registry.PEER_KINDS:
        try:
            view: registry.PeerFrame | None = registry.parse(kind, meta)
        except RemoteProtocolError:
            view = None
        assert view is None or view.KIND is kind


#: well-formed metadata of each parameter-server frame kind, for the malformed ones below
PS_META: dict[Kind, Meta] = {
    Kind.PUSH: {
        "job": "j",
        "name": "ps",
        "sh": 1,
        "srv": 1,
        "w": 3,
        "it": 7,
        "b": 6,
        "ep": 0,
        "spec": PS_SPEC,
    },
    Kind.PULL: {
        "job": "j",
        "name": "ps",
        "sh": 1,
        "srv": 1,
        "w": 3,
        "c": 8,
        "since": 6,
        "ep": 0,
        "spec": PS_SPEC,
    },
    Kind.PUSHED: {"job": "j", "name": "ps", "sh": 1, "srv": 1, "w": 3, "it": 7, "ver": 9, "ep": 0},
    Kind.PULLED: {"job": "j", "name": "ps", "sh": 1, "srv": 1, "w": 3, "c": 8, "ver": 9, "ep": 0},
    Kind.REPLICATE: {
        "job": "j",
        "name": "ps",
        "sh": 1,
        "srv": 1,
        "rep": 0,
        "ix": 1,
        "entry": "push",
        "w": 3,
        "it": 7,
        "b": 6,
        "spec": PS_SPEC,
    },
    Kind.REPLICATED: {"job": "j", "name": "ps", "sh": 1, "srv": 1, "rep": 0, "ix": 1},
    Kind.JOIN: {"job": "j", "name": "ps", "sh": 1, "srv": 1, "rep": 0, "ep": 0, "spec": PS_SPEC},
    Kind.OPENED: {"job": "j", "name": "ps", "r": 3, "spec": PS_SPEC},
}
LONG = "x" * (ps_frames.MAX_PS_REASON + 1)
#: a spec whose ``n`` is keyed by bytes (msgpack allows such keys in a nested map)
BYTES_KEYED_SPEC: dict[Any, Any] = {**without(PS_SPEC, "n"), b"n": 4}


@pytest.mark.parametrize("kind", sorted(PS_META))
def test_the_parameter_server_examples_are_well_formed(kind: Kind) -> None:
    view = registry.parse(kind, PS_META[kind])
    assert view.KIND is kind
    assert view.to_meta() == PS_META[kind]


def changed(kind: Kind, **fields: object) -> Meta:
    """``kind``'s well-formed metadata with ``fields`` set (None: removed)."""
    meta = {**PS_META[kind], **fields}
    return {k: v for k, v in meta.items() if v is not None}


def spec_with(**fields: object) -> Meta:
    """A PUSH whose spec has ``fields`` set."""
    return changed(Kind.PUSH, spec={**PS_SPEC, **fields})


@pytest.mark.parametrize(
    ("kind", "meta", "message"),
    [
        # the fields every parameter-server frame has
        (Kind.PUSH, changed(Kind.PUSH, job=None), "'job'"),
        (Kind.PULL, changed(Kind.PULL, job=7), "'job'"),
        (Kind.PUSHED, changed(Kind.PUSHED, name=""), "'name'"),
        (Kind.PULLED, changed(Kind.PULLED, name="n" * 201), "name of 201 characters"),
        (Kind.REPLICATE, changed(Kind.REPLICATE, sh=-1), "'sh'"),
        (Kind.REPLICATED, changed(Kind.REPLICATED, sh="1"), "'sh'"),
        (Kind.PUSH, changed(Kind.PUSH, srv=fields_frames.MAX_RANK + 1), "'srv'"),
        (Kind.PULL, changed(Kind.PULL, srv=True), "'srv'"),
        # each kind's own fields: wrong type, out of range, missing
        (Kind.PUSH, changed(Kind.PUSH, w=-1), "'w'"),
        (Kind.PUSH, changed(Kind.PUSH, it="7"), "'it'"),
        (Kind.PUSH, changed(Kind.PUSH, b=-1), "'b'"),
        (Kind.PUSH, changed(Kind.PUSH, ep=1.0), "'ep'"),
        (Kind.PULL, changed(Kind.PULL, w=fields_frames.MAX_RANK + 1), "'w'"),
        (Kind.PULL, changed(Kind.PULL, c=-1), "'c'"),
        (Kind.PULL, changed(Kind.PULL, since=None), "'since'"),
        (Kind.PULL, changed(Kind.PULL, ep=False), "'ep'"),
        (Kind.PUSHED, changed(Kind.PUSHED, it=-1), "'it'"),
        (Kind.PUSHED, changed(Kind.PUSHED, ver=None), "'ver'"),
        (Kind.PUSHED, changed(Kind.PUSHED, ep=2**63), "'ep'"),
        (Kind.PULLED, changed(Kind.PULLED, w=None), "'w'"),
        (Kind.PULLED, changed(Kind.PULLED, c="8"), "'c'"),
        (Kind.PULLED, changed(Kind.PULLED, ver=-1), "'ver'"),
        (Kind.REPLICATE, changed(Kind.REPLICATE, rep=-1), "'rep'"),
        (Kind.REPLICATE, changed(Kind.REPLICATE, ix=0), "'ix'"),
        (Kind.REPLICATE, changed(Kind.REPLICATE, w=None), "'w'"),
        (Kind.REPLICATE, changed(Kind.REPLICATE, it=-1), "'it'"),
        (Kind.REPLICATE, changed(Kind.REPLICATE, b="6"), "'b'"),
        (Kind.REPLICATED, changed(Kind.REPLICATED, rep=None), "'rep'"),
        (Kind.REPLICATED, changed(Kind.REPLICATED, ix=0), "'ix'"),
        (Kind.JOIN, changed(Kind.JOIN, ep=-1), "'ep'"),
        (Kind.JOIN, changed(Kind.JOIN, rep="0"), "'rep'"),
        (Kind.JOIN, changed(Kind.JOIN, spec=None), "'spec'"),
        (Kind.OPENED, changed(Kind.OPENED, r=-1), "'r'"),
        (Kind.OPENED, changed(Kind.OPENED, r=None), "'r'"),
        (Kind.OPENED, changed(Kind.OPENED, name=""), "'name'"),
        (Kind.OPENED, changed(Kind.OPENED, spec=None), "'spec'"),
        (Kind.OPENED, changed(Kind.OPENED, ans=1), "'ans'"),
        (Kind.OPENED, {**PS_META[Kind.OPENED], "ans": None}, "'ans'"),
        # a log entry of a kind the log does not hold
        (Kind.REPLICATE, changed(Kind.REPLICATE, entry="apply"), "'entry'"),
        (Kind.REPLICATE, changed(Kind.REPLICATE, entry=b"push"), "'entry'"),
        (Kind.REPLICATE, changed(Kind.REPLICATE, entry=None), "'entry'"),
        # reasons: a non-empty str, at most MAX_PS_REASON characters, absent rather than nil
        (Kind.PUSHED, {**PS_META[Kind.PUSHED], "drop": LONG}, "'drop' of 1025 characters"),
        (Kind.PUSHED, {**PS_META[Kind.PUSHED], "drop": None}, "'drop'"),
        (Kind.PULLED, {**PS_META[Kind.PULLED], "error": LONG}, "'error' of 1025 characters"),
        (Kind.PULLED, {**PS_META[Kind.PULLED], "error": ""}, "'error'"),
        (Kind.REPLICATE, changed(Kind.REPLICATE, why=LONG), "'why' of 1025 characters"),
        (Kind.REPLICATE, changed(Kind.REPLICATE, why=3), "'why'"),
        # the spec: exactly its fields, each of its type and range
        (Kind.PUSH, changed(Kind.PUSH, spec=None), "'spec' must be a map of n, size"),
        (Kind.PULL, changed(Kind.PULL, spec=[PS_SPEC]), "'spec' must be a map"),
        (
            Kind.REPLICATE,
            changed(Kind.REPLICATE, spec=without(PS_SPEC, "chunk")),
            "'spec' must be a map",
        ),
        (Kind.PUSH, spec_with(extra=1), "'spec' must be a map"),
        (
            Kind.PUSH,
            changed(Kind.PUSH, spec=BYTES_KEYED_SPEC),
            "'spec' must be a map",
        ),
        (Kind.PUSH, spec_with(n=0), "'n'"),
        (Kind.PUSH, spec_with(n=fields_frames.MAX_RANK + 1), "'n'"),
        (Kind.PUSH, spec_with(size=0), "'size'"),
        (Kind.PUSH, spec_with(size=1.5), "'size'"),
        (Kind.PUSH, spec_with(dtype=""), "'dtype'"),
        (Kind.PUSH, spec_with(dtype=None), "'dtype'"),
        (Kind.PUSH, spec_with(servers=[]), "servers must be a list of 1 to 4096 ranks"),
        (Kind.PUSH, spec_with(servers=[0] * 4097), "servers must be a list"),
        (Kind.PUSH, spec_with(servers=[0, -1]), "servers must be a list"),
        (Kind.PUSH, spec_with(servers=[0, True]), "servers must be a list"),
        (Kind.PUSH, spec_with(servers=[fields_frames.MAX_RANK + 1]), "servers must be a list"),
        (Kind.PUSH, spec_with(servers=3), "servers must be a list"),
        (Kind.PUSH, spec_with(servers=None), "servers must be a list"),
        (Kind.PUSH, spec_with(replicas=[1]), "replicas must be a list of ranks, none or one"),
        (Kind.PUSH, spec_with(replicas=[1, 0, 2]), "replicas must be a list"),
        (Kind.PUSH, spec_with(replicas=[1, None]), "replicas must be a list"),
        (Kind.PUSH, spec_with(replicas=None), "replicas must be a list"),
        (Kind.PUSH, spec_with(consistency=1), "'consistency'"),
        (Kind.PUSH, spec_with(staleness=-1), "'staleness'"),
        (Kind.PUSH, spec_with(delay_bound=-1), "'delay_bound'"),
        (Kind.PUSH, spec_with(delay_bound="8"), "'delay_bound'"),
        (Kind.PUSH, spec_with(chunk=0), "'chunk'"),
        (Kind.PULL, changed(Kind.PULL, spec={**PS_SPEC, "chunk": None}), "'chunk'"),
        (Kind.REPLICATE, changed(Kind.REPLICATE, spec={**PS_SPEC, "n": "4"}), "'n'"),
    ],
)
def test_a_bad_parameter_server_field_is_a_remote_protocol_error(
    kind: Kind, meta: Meta, message: str
) -> None:
    with pytest.raises(RemoteProtocolError, match=message):
        registry.parse(kind, meta)


def test_the_parameter_server_bounds_are_inclusive() -> None:
    """The longest reason, the most servers, the largest ranks: accepted."""
    most = list(range(ps_frames.MAX_PS_SERVERS))
    spec = {**PS_SPEC, "n": fields_frames.MAX_RANK, "servers": most, "replicas": most[::-1]}
    push = registry.parse(Kind.PUSH, changed(Kind.PUSH, w=fields_frames.MAX_RANK, spec=spec))
    assert isinstance(push, ps_frames.Push)
    assert push.worker == fields_frames.MAX_RANK
    assert push.spec == spec
    reason = "x" * ps_frames.MAX_PS_REASON
    pushed = registry.parse(Kind.PUSHED, {**PS_META[Kind.PUSHED], "drop": reason})
    assert isinstance(pushed, ps_frames.Pushed)
    assert pushed.dropped == reason


def test_a_parsed_spec_is_a_copy_of_its_fields() -> None:
    """The view's spec holds the checked fields only, in a map of its own."""
    meta = changed(Kind.PULL)
    view = registry.parse(Kind.PULL, meta)
    assert isinstance(view, ps_frames.Pull)
    assert view.spec == PS_SPEC
    assert view.spec is not meta["spec"]
    assert tuple(view.spec) == ps_frames.PS_SPEC_FIELDS


def test_payload_frames_are_routed_by_the_node_on_their_channel() -> None:
    """Every frame whose payload a service places has a channel at the node, every bulk kind
    but WRITE (which the transport handles) goes on the data link, and nothing else does."""
    from fabricd.daemon import node
    from fabricd.engines.link.handshake import Channel

    payload_kinds = {view.KIND for view in get_args(registry.PayloadFrame)}
    assert payload_kinds == set(node._PAYLOAD_CHANNEL)
    data = {kind for kind, channel in node._PAYLOAD_CHANNEL.items() if channel is Channel.DATA}
    assert data == node._DATA_KINDS == BULK_KINDS - {Kind.WRITE}
