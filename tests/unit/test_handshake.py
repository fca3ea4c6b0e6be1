"""The peer handshake: two real :class:`Handshake` engines wired together through the wire codec.

Every frame goes through :func:`fabricd.wire.encode` and a :class:`~fabricd.wire.Decoder` under
:data:`HANDSHAKE_LIMITS`, exactly as a link does before it is authenticated, so these tests also
show that the handshake fits the limits an unauthenticated peer is held to.  Frames reach an
engine as the peering service hands them over: parsed by
:func:`fabricd.frames.link.parse_handshake`.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgpack
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from fabricd.engines.link.handshake import (
    HANDSHAKE_LIMITS,
    MAX_NAME,
    AuthenticationFailed,
    Channel,
    Handshake,
    PeerIdentity,
    Role,
)
from fabricd.errors import RemoteProtocolError
from fabricd.frames import link as link_frames
from fabricd.frames.link import NONCE_SIZE
from fabricd.wire import PROTOCOL_VERSION, Decoder, Frame, FrameHead, Kind, Meta, encode

if TYPE_CHECKING:
    from fabricd.engines.actions import Answer

SECRET = b"correct horse battery staple"
FABRIC = 4


def initiator(
    *,
    secret: bytes = SECRET,
    node: int = 0,
    incarnation: int = 7,
    nonce: bytes = b"i" * NONCE_SIZE,
    channel: Channel = Channel.CONTROL,
    expected: int = 1,
    sealed_data: bool = False,
    name: str = "alpha",
) -> Handshake:
    return Handshake(
        role=Role.INITIATOR,
        secret=secret,
        node=node,
        name=name,
        incarnation=incarnation,
        nonce=nonce,
        fabric_size=FABRIC,
        channel=channel,
        expected_node=expected,
        sealed_data=sealed_data,
    )


def acceptor(
    *,
    secret: bytes = SECRET,
    node: int = 1,
    incarnation: int = 9,
    nonce: bytes = b"a" * NONCE_SIZE,
    sealed_data: bool = False,
    name: str = "beta",
) -> Handshake:
    return Handshake(
        role=Role.ACCEPTOR,
        secret=secret,
        node=node,
        name=name,
        incarnation=incarnation,
        nonce=nonce,
        fabric_size=FABRIC,
        sealed_data=sealed_data,
    )


def transmit(out: Answer) -> tuple[Kind, Meta]:
    """Send one handshake frame through the codec as an unauthenticated link would."""
    decoder = Decoder(HANDSHAKE_LIMITS)
    decoder.feed(encode(out.frame.KIND, out.frame.to_meta()))
    head = decoder.next_event()
    frame = decoder.next_event()
    assert isinstance(head, FrameHead)
    assert isinstance(frame, Frame)
    assert frame.payload.nbytes == 0
    return frame.kind, frame.meta


def receive(shake: Handshake, kind: Kind, meta: Meta) -> list[Answer]:
    """Hand one received frame to ``shake`` as the peering service does: parsed first."""
    return shake.on_frame(link_frames.parse_handshake(kind, meta))


@dataclass
class Transcript:
    """Every frame each side sent, in order, as the other side decoded it."""

    by_initiator: list[tuple[Kind, Meta]]
    by_acceptor: list[tuple[Kind, Meta]]


def run(init: Handshake, acc: Handshake) -> Transcript:
    """Drive both engines until neither has anything to send; errors propagate."""
    log = Transcript([], [])
    assert acc.start() == []
    to_acceptor = [transmit(o) for o in init.start()]
    while to_acceptor:
        log.by_initiator += to_acceptor
        to_initiator = [transmit(o) for k, m in to_acceptor for o in receive(acc, k, m)]
        log.by_acceptor += to_initiator
        to_acceptor = [transmit(o) for k, m in to_initiator for o in receive(init, k, m)]
    return log


def assert_dead(shake: Handshake) -> None:
    """After a refusal the machine accepts nothing more, well-formed or not, and names no peer."""
    assert shake.peer is None
    well_formed: list[link_frames.HandshakeFrame] = [
        link_frames.Hello(node=2, incarnation=1, nonce=b"n" * NONCE_SIZE, channel="control"),
        link_frames.Auth(mac=b"m" * 32),
    ]
    for frame in well_formed:
        with pytest.raises(RemoteProtocolError, match="unexpected"):
            shake.on_frame(frame)


# -- success ----------------------------------------------------------------------------------
@pytest.mark.parametrize("channel", list(Channel))
def test_both_sides_agree_on_who_is_on_the_other_end(channel: Channel) -> None:
    init, acc = initiator(channel=channel), acceptor()
    log = run(init, acc)

    assert [k for k, _ in log.by_initiator] == [Kind.HELLO, Kind.AUTH]
    assert [k for k, _ in log.by_acceptor] == [Kind.HELLO]
    assert init.peer == PeerIdentity(node=1, incarnation=9, channel=channel, name="beta")
    assert acc.peer == PeerIdentity(node=0, incarnation=7, channel=channel, name="alpha")


def test_frames_keep_their_wire_layout() -> None:
    """The same keys, values and order as every release of protocol 16 sends: peers
    interoperate."""
    init, acc = initiator(), acceptor()
    acc.start()
    (hello,) = init.start()
    (answer,) = receive(acc, *transmit(hello))
    (auth,) = receive(init, *transmit(answer))
    sent = [encode(a.frame.KIND, a.frame.to_meta()) for a in (hello, answer, auth)]

    i_nonce, a_nonce = b"i" * NONCE_SIZE, b"a" * NONCE_SIZE
    assert isinstance(answer.frame, link_frames.Hello)
    assert isinstance(auth.frame, link_frames.Auth)
    ids = {"v": 16, "node": 0, "inc": 7, "nonce": i_nonce, "sealed_data": False, "name": "alpha"}
    assert sent == [
        encode(Kind.HELLO, {**ids, "channel": "control"}),
        encode(
            Kind.HELLO,
            {"v": 16, "node": 1, "inc": 9, "nonce": a_nonce, "sealed_data": False}
            | {"name": "beta", "mac": answer.frame.mac},
        ),
        encode(Kind.AUTH, {"mac": auth.frame.mac}),
    ]


@pytest.mark.parametrize("initiator_seals", [True, False])
def test_nodes_that_disagree_on_data_integrity_are_told_so_in_the_handshake(
    initiator_seals: bool,
) -> None:
    # otherwise the link comes up and every DATA frame one of them sends fails the other's check
    init, acc = initiator(sealed_data=initiator_seals), acceptor(sealed_data=not initiator_seals)
    acc.start()
    (hello,) = init.start()
    theirs, ours = ("mac", "none") if initiator_seals else ("none", "mac")
    refusal = f"node 0 has data_integrity = '{theirs}', this node '{ours}'"
    with pytest.raises(RemoteProtocolError, match=refusal):
        receive(acc, *transmit(hello))
    assert acc.peer is None


def test_an_initiator_checks_the_acceptors_data_integrity_too() -> None:
    init = initiator(sealed_data=False)
    init.start()
    answer = link_frames.Hello(
        node=1, incarnation=9, nonce=b"a" * NONCE_SIZE, mac=b"m" * 32, sealed_data=True
    )
    with pytest.raises(RemoteProtocolError, match="node 1 has data_integrity = 'mac', this node"):
        receive(init, Kind.HELLO, answer.to_meta())
    assert init.peer is None


def test_a_hello_whose_sealed_data_is_no_bool_is_refused() -> None:
    meta = link_frames.Hello(node=0, incarnation=1, nonce=b"n" * NONCE_SIZE).to_meta()
    meta["sealed_data"] = 1
    with pytest.raises(RemoteProtocolError, match="'sealed_data' must be true or false"):
        link_frames.Hello.from_meta(meta)


def test_peer_is_unknown_until_the_handshake_is_done() -> None:
    init, acc = initiator(), acceptor()
    acc.start()
    (hello,) = init.start()
    assert init.peer is None
    (answer,) = receive(acc, *transmit(hello))
    assert acc.peer is None  # the initiator has not proved itself yet
    (auth,) = receive(init, *transmit(answer))
    assert init.peer is not None
    assert receive(acc, *transmit(auth)) == []
    assert acc.peer is not None


def test_start_twice_is_a_local_bug() -> None:
    init = initiator()
    init.start()
    with pytest.raises(RuntimeError, match="already started"):
        init.start()


def test_done_handshake_refuses_more_frames() -> None:
    init, acc = initiator(), acceptor()
    log = run(init, acc)
    with pytest.raises(RemoteProtocolError, match="unexpected HELLO"):
        receive(acc, *log.by_initiator[0])
    with pytest.raises(RemoteProtocolError, match="unexpected AUTH"):
        receive(init, Kind.AUTH, log.by_initiator[1][1])


def test_constructor_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match=f"{NONCE_SIZE} bytes"):
        acceptor(nonce=b"short")
    with pytest.raises(ValueError, match="initiator must name"):
        Handshake(
            role=Role.INITIATOR, secret=SECRET, node=0, incarnation=1,
            nonce=b"n" * NONCE_SIZE, fabric_size=FABRIC,
        )  # fmt: skip


# -- wrong secret -----------------------------------------------------------------------------
def test_acceptor_with_another_secret_is_refused_by_the_initiator() -> None:
    init, acc = initiator(), acceptor(secret=b"another secret")
    with pytest.raises(AuthenticationFailed, match="same secret") as info:
        run(init, acc)
    assert isinstance(info.value, RemoteProtocolError)
    assert_dead(init)


def proof(secret: bytes, role: Role, hello: Meta, answer: Meta) -> bytes:
    """A MAC computed independently of the engine, from the module docstring's formula."""
    transcript = msgpack.packb(
        [hello["nonce"], answer["nonce"], hello["node"], hello["inc"], hello["name"],
         answer["node"], answer["inc"], answer["name"], hello["channel"]]
    )  # fmt: skip
    label = b"fabricd-v1-" + role.value.encode()
    key = hashlib.sha256(b"fabricd-v1-key\0" + secret).digest()
    return hmac.new(key, label + transcript, hashlib.sha256).digest()


@pytest.mark.parametrize(("secret", "accepted"), [(SECRET, True), (b"a guess", False)])
def test_acceptor_checks_the_initiators_proof(secret: bytes, accepted: bool) -> None:
    """A rogue initiator that ignores the acceptor's MAC still has to prove the secret."""
    acc = acceptor()
    acc.start()
    (hello,) = initiator().start()
    hello_meta = transmit(hello)[1]
    (answer,) = receive(acc, Kind.HELLO, hello_meta)
    answer_meta = transmit(answer)[1]
    assert answer_meta["mac"] == proof(SECRET, Role.ACCEPTOR, hello_meta, answer_meta)

    auth = {"mac": proof(secret, Role.INITIATOR, hello_meta, answer_meta)}
    if accepted:
        assert receive(acc, Kind.AUTH, auth) == []
        assert acc.peer == PeerIdentity(
            node=0, incarnation=7, channel=Channel.CONTROL, name="alpha"
        )
    else:
        with pytest.raises(AuthenticationFailed, match="same secret"):
            receive(acc, Kind.AUTH, auth)
        assert_dead(acc)


# -- replay and reflection --------------------------------------------------------------------
def test_auth_replayed_from_an_earlier_session_is_refused() -> None:
    earlier = run(initiator(nonce=b"1" * NONCE_SIZE), acceptor(nonce=b"2" * NONCE_SIZE))
    recorded_hello, recorded_auth = earlier.by_initiator

    victim = acceptor(nonce=b"3" * NONCE_SIZE)  # a fresh nonce, as every acceptor draws
    victim.start()
    receive(victim, *recorded_hello)  # the attacker replays the recorded HELLO …
    with pytest.raises(AuthenticationFailed):
        receive(victim, *recorded_auth)  # … and the recorded AUTH, made over other nonces
    assert_dead(victim)


def test_acceptor_mac_reflected_as_the_initiators_auth_is_refused() -> None:
    """An attacker who replays the acceptor's own proof back to it gains nothing."""
    acc = acceptor()
    acc.start()
    attacker = initiator(secret=b"unknown to the attacker")
    (hello,) = attacker.start()
    (answer,) = receive(acc, *transmit(hello))
    _, answer_meta = transmit(answer)
    with pytest.raises(AuthenticationFailed):
        receive(acc, Kind.AUTH, {"mac": answer_meta["mac"]})
    assert_dead(acc)


# -- identity ---------------------------------------------------------------------------------
def test_initiator_refuses_a_node_it_did_not_dial() -> None:
    init, impostor = initiator(expected=2), acceptor(node=3)
    with pytest.raises(AuthenticationFailed, match="dialled node 2 but node 3 answered"):
        run(init, impostor)
    assert_dead(init)


@pytest.mark.parametrize("role", list(Role))
def test_peer_claiming_our_own_node_id_is_refused(role: Role) -> None:
    if role is Role.ACCEPTOR:
        init, acc = initiator(node=1), acceptor(node=1)
        with pytest.raises(AuthenticationFailed, match="claims to be this node"):
            run(init, acc)
        assert_dead(acc)
    else:
        init, acc = initiator(node=0), acceptor(node=1)
        acc.start()
        (hello,) = init.start()
        (answer,) = receive(acc, *transmit(hello))
        forged = {**transmit(answer)[1], "node": 0}  # the answer claims to be node 0, i.e. us
        with pytest.raises(AuthenticationFailed, match=r"claims to be this node \(0\)"):
            receive(init, Kind.HELLO, forged)
        assert_dead(init)


@pytest.mark.parametrize("claimed", [FABRIC, FABRIC + 1, 2**40])
def test_node_id_outside_the_fabric_is_refused(claimed: int) -> None:
    acc = acceptor()
    acc.start()
    (hello,) = initiator().start()
    _, meta = transmit(hello)
    with pytest.raises(RemoteProtocolError, match="'node'"):
        receive(acc, Kind.HELLO, {**meta, "node": claimed})
    assert_dead(acc)


def test_acceptor_node_id_outside_the_fabric_is_refused_by_the_initiator() -> None:
    init = initiator()
    (hello,) = init.start()
    answer = {**transmit(hello)[1], "node": FABRIC, "mac": b"x" * 32}
    with pytest.raises(RemoteProtocolError, match="'node'"):
        receive(init, Kind.HELLO, answer)
    assert_dead(init)


# -- malformed or out-of-order frames ---------------------------------------------------------
# A frame that is malformed (a field missing, of the wrong type or size, another protocol
# version) is refused by link_frames.parse_handshake before any engine sees it, and the peering
# service closes the link; what a well-formed frame may still get wrong, the engine refuses.
@pytest.mark.parametrize("role", list(Role))
def test_protocol_version_mismatch_names_both_versions(role: Role) -> None:
    newer = PROTOCOL_VERSION + 1
    init, acc = initiator(), acceptor()
    acc.start()
    (hello,) = init.start()
    _, meta = transmit(hello)
    if role is Role.ACCEPTOR:
        target, frame = acc, {**meta, "v": newer}
    else:
        (answer,) = receive(acc, Kind.HELLO, meta)
        target, frame = init, {**transmit(answer)[1], "v": newer}
    with pytest.raises(RemoteProtocolError) as info:
        receive(target, Kind.HELLO, frame)
    assert f"protocol {newer}" in str(info.value)
    assert f"this daemon {PROTOCOL_VERSION}" in str(info.value)


@pytest.mark.parametrize("channel", ["bulk", "Control", "data "])
def test_unknown_channel_is_refused(channel: str) -> None:
    acc = acceptor()
    acc.start()
    (hello,) = initiator().start()
    meta = {**transmit(hello)[1], "channel": channel}
    with pytest.raises(RemoteProtocolError, match="unknown channel"):
        receive(acc, Kind.HELLO, meta)
    assert_dead(acc)


def test_initiator_hello_without_a_channel_is_refused() -> None:
    acc = acceptor()
    acc.start()
    (hello,) = initiator().start()
    meta = {k: v for k, v in transmit(hello)[1].items() if k != "channel"}
    with pytest.raises(RemoteProtocolError, match="names no channel"):
        receive(acc, Kind.HELLO, meta)
    assert_dead(acc)


def test_acceptor_hello_without_a_mac_is_refused() -> None:
    init, acc = initiator(), acceptor()
    acc.start()
    (hello,) = init.start()
    (answer,) = receive(acc, *transmit(hello))
    meta = {k: v for k, v in transmit(answer)[1].items() if k != "mac"}
    with pytest.raises(RemoteProtocolError, match="carries no 'mac'"):
        receive(init, Kind.HELLO, meta)
    assert_dead(init)


def test_auth_before_hello_is_refused() -> None:
    acc = acceptor()
    acc.start()
    with pytest.raises(RemoteProtocolError, match="unexpected AUTH"):
        receive(acc, Kind.AUTH, {"mac": b"x" * 32})
    assert_dead(acc)


def test_initiator_refuses_auth_instead_of_hello() -> None:
    init = initiator()
    init.start()
    with pytest.raises(RemoteProtocolError, match="unexpected AUTH"):
        receive(init, Kind.AUTH, {"mac": b"x" * 32})
    assert_dead(init)


def test_hello_twice_is_refused() -> None:
    init, acc = initiator(), acceptor()
    acc.start()
    (hello,) = init.start()
    frame = transmit(hello)
    receive(acc, *frame)
    with pytest.raises(RemoteProtocolError, match="unexpected HELLO"):
        receive(acc, *frame)
    assert_dead(acc)


def test_frame_before_start_is_refused() -> None:
    acc = acceptor()
    (hello,) = initiator().start()
    with pytest.raises(RemoteProtocolError, match="unexpected HELLO"):
        receive(acc, *transmit(hello))


@pytest.mark.parametrize("size", [0, 1, NONCE_SIZE - 1, NONCE_SIZE + 1])
def test_nonce_of_the_wrong_length_is_refused(size: int) -> None:
    acc = acceptor()
    acc.start()
    (hello,) = initiator().start()
    meta = {**transmit(hello)[1], "nonce": b"n" * size}
    with pytest.raises(RemoteProtocolError, match="nonce has the wrong size"):
        receive(acc, Kind.HELLO, meta)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("nonce", "a text nonce"),
        ("inc", -1),
        ("inc", "1"),
        ("node", None),
        ("v", None),
        ("channel", ""),
        ("channel", 3),
        ("channel", None),
        ("mac", "not bytes"),
    ],
)
def test_fields_of_the_wrong_type_are_refused(field: str, value: object) -> None:
    acc = acceptor()
    acc.start()
    (hello,) = initiator().start()
    meta = {**transmit(hello)[1], field: value}
    with pytest.raises(RemoteProtocolError, match=f"'{field}'"):
        receive(acc, Kind.HELLO, meta)


def test_auth_without_a_binary_mac_is_refused() -> None:
    init, acc = initiator(), acceptor()
    acc.start()
    (hello,) = init.start()
    receive(acc, *transmit(hello))
    with pytest.raises(RemoteProtocolError, match="'mac'"):
        receive(acc, Kind.AUTH, {"mac": "not bytes"})


# -- property: the secret decides -------------------------------------------------------------
#: short and long secrets alike: the derived key keeps b"k" and b"k\0" apart
secret_bytes = st.binary(max_size=100)
nonces = st.binary(min_size=NONCE_SIZE, max_size=NONCE_SIZE)


@given(secret=secret_bytes, nonce_i=nonces, nonce_a=nonces)
def test_equal_secrets_always_authenticate(secret: bytes, nonce_i: bytes, nonce_a: bytes) -> None:
    init = initiator(secret=secret, nonce=nonce_i, channel=Channel.DATA)
    acc = acceptor(secret=secret, nonce=nonce_a)
    run(init, acc)
    assert init.peer == PeerIdentity(node=1, incarnation=9, channel=Channel.DATA, name="beta")
    assert acc.peer == PeerIdentity(node=0, incarnation=7, channel=Channel.DATA, name="alpha")


@given(mine=secret_bytes, theirs=secret_bytes, initiator_wrong=st.booleans())
def test_unequal_secrets_never_authenticate(
    mine: bytes, theirs: bytes, initiator_wrong: bool
) -> None:
    assume(mine != theirs)
    init = initiator(secret=theirs if initiator_wrong else mine)
    acc = acceptor(secret=mine if initiator_wrong else theirs)
    with pytest.raises(AuthenticationFailed):
        run(init, acc)
    assert init.peer is None
    assert acc.peer is None


@pytest.mark.parametrize(
    ("mine", "theirs"),
    [(b"k" * 16, b"k" * 16 + b"\0"), (b"s" * 80, hashlib.sha256(b"s" * 80).digest())],
)
def test_secrets_hmac_would_confuse_are_told_apart(mine: bytes, theirs: bytes) -> None:
    with pytest.raises(AuthenticationFailed):
        run(initiator(secret=mine), acceptor(secret=theirs))


# -- session keys ---------------------------------------------------------------------------
@pytest.mark.parametrize("channel", list(Channel))
def test_each_direction_gets_its_own_key_and_both_sides_agree(channel: Channel) -> None:
    init, acc = initiator(channel=channel), acceptor()
    log = run(init, acc)
    i_keys, a_keys = init.session_keys(), acc.session_keys()
    assert i_keys.send == a_keys.receive
    assert a_keys.send == i_keys.receive
    assert i_keys.send != i_keys.receive
    assert len(i_keys.send) == 32
    frames_sent = log.by_initiator + log.by_acceptor
    sent = [v for _, meta in frames_sent for v in meta.values() if isinstance(v, bytes)]
    assert len(sent) == 4  # two nonces, two MACs
    assert not {i_keys.send, i_keys.receive} & set(sent), "a session key crossed the wire"


def test_every_link_gets_fresh_keys() -> None:
    """Control and data links (and a reconnection) run their own handshakes, with new nonces."""
    keys = set()
    for i, channel in enumerate([Channel.CONTROL, Channel.DATA, Channel.CONTROL]):
        init = initiator(channel=channel, nonce=bytes([i]) * NONCE_SIZE)
        acc = acceptor(nonce=bytes([100 + i]) * NONCE_SIZE)
        run(init, acc)
        keys |= {init.session_keys().send, init.session_keys().receive}
    assert len(keys) == 6


def test_keys_depend_on_the_secret_and_the_channel() -> None:
    def keys(secret: bytes, channel: Channel) -> bytes:
        init, acc = initiator(secret=secret, channel=channel), acceptor(secret=secret)
        run(init, acc)
        return init.session_keys().send

    assert keys(SECRET, Channel.CONTROL) != keys(SECRET + b"!", Channel.CONTROL)
    assert keys(SECRET, Channel.CONTROL) != keys(SECRET, Channel.DATA)


def test_no_session_keys_before_the_handshake_is_done() -> None:
    init, acc = initiator(), acceptor()
    acc.start()
    (hello,) = init.start()
    receive(acc, *transmit(hello))  # the acceptor waits for AUTH
    for shake in (init, acc):
        with pytest.raises(RuntimeError, match="before the handshake is done"):
            shake.session_keys()


# -- names ------------------------------------------------------------------------------------
def test_a_name_changed_on_the_way_fails_the_proof() -> None:
    """The names are in the transcript: one rewritten in the initiator's HELLO (to pass a
    holder check under membership from etcd) makes the acceptor's proof fail at the
    initiator, so a link never comes up under a name its sender did not send."""
    init, acc = initiator(), acceptor()
    acc.start()
    (hello,) = init.start()
    kind, meta = transmit(hello)
    (answer,) = receive(acc, kind, {**meta, "name": "mallory"})
    assert acc.peer is None  # (not done before AUTH)
    with pytest.raises(AuthenticationFailed, match="same secret"):
        receive(init, *transmit(answer))
    assert_dead(init)


def test_a_hello_without_a_name_is_refused() -> None:
    acc = acceptor()
    acc.start()
    (hello,) = initiator().start()
    kind, meta = transmit(hello)
    del meta["name"]
    with pytest.raises(RemoteProtocolError, match="'name'"):
        receive(acc, kind, meta)


def test_the_longest_name_fits_the_handshake_limits_and_an_empty_one_is_allowed() -> None:
    """A static list's node may have no name (``""``); an etcd name of MAX_NAME bytes, with
    every other field at its largest (an acceptor's two proofs), fits HANDSHAKE_LIMITS."""
    longest = "n" * MAX_NAME
    init = initiator(name="")
    acc = Handshake(
        role=Role.ACCEPTOR,
        secret=SECRET,
        older_secret=b"an older secret, still accepted",
        node=1,
        incarnation=2**63 - 1,
        nonce=b"a" * NONCE_SIZE,
        fabric_size=FABRIC,
        name=longest,
        sealed_data=False,
    )
    log = run(init, acc)
    assert "older_mac" in log.by_acceptor[0][1]
    assert init.peer is not None
    assert init.peer.name == longest
    assert acc.peer is not None
    assert acc.peer.name == ""
