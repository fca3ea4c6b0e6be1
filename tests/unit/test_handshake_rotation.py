"""The handshake during a secret rotation: a node holding two secrets accepts either.

Each case runs two real :class:`Handshake` engines through the wire codec (the helpers of
tests/unit/test_handshake.py), as the peering service would.
"""

from __future__ import annotations

import pytest

from fabricd.engines.link.handshake import AuthenticationFailed, Channel, Handshake, Role
from fabricd.frames.link import NONCE_SIZE
from tests.unit.test_handshake import run

S1 = b"the secret every node starts with"
S2 = b"the secret they all move to"


def shake(role: Role, held: tuple[bytes, ...]) -> Handshake:
    """A handshake of node 0 (initiator) or 1 (acceptor) holding ``held``, the older first."""
    initiator = role is Role.INITIATOR
    return Handshake(
        role=role,
        secret=held[-1],
        older_secret=held[0] if len(held) > 1 else None,
        node=0 if initiator else 1,
        incarnation=7,
        nonce=(b"i" if initiator else b"a") * NONCE_SIZE,
        fabric_size=2,
        channel=Channel.CONTROL if initiator else None,
        expected_node=1 if initiator else None,
    )


def link_secret(init_held: tuple[bytes, ...], acc_held: tuple[bytes, ...]) -> bytes:
    """Run the handshake; return which secret the link's keys come from (checked on both
    sides: each side's keys are what the same handshake with that one secret gives)."""
    init, acc = shake(Role.INITIATOR, init_held), shake(Role.ACCEPTOR, acc_held)
    run(init, acc)
    keys = init.session_keys()
    assert acc.session_keys().receive == keys.send
    assert acc.session_keys().send == keys.receive
    for secret in {*init_held, *acc_held}:
        one_i, one_a = shake(Role.INITIATOR, (secret,)), shake(Role.ACCEPTOR, (secret,))
        try:
            run(one_i, one_a)
        except AuthenticationFailed:
            continue
        if one_i.session_keys() == keys:
            return secret
    raise AssertionError("the link's keys come from no secret either side holds")


@pytest.mark.parametrize(
    ("init_held", "acc_held", "used"),
    [
        ((S1,), (S1, S2), S1),  # the acceptor moved first
        ((S1, S2), (S1,), S1),  # the initiator moved first
        ((S1, S2), (S1, S2), S2),  # both moved: the newer
        ((S2,), (S1, S2), S2),  # the initiator dropped S1 first
        ((S1, S2), (S2,), S2),  # the acceptor dropped S1 first
    ],
)
def test_every_step_of_a_rolling_rotation_links(
    init_held: tuple[bytes, ...], acc_held: tuple[bytes, ...], used: bytes
) -> None:
    assert link_secret(init_held, acc_held) == used


@pytest.mark.parametrize(
    ("init_held", "acc_held"),
    [((S1,), (S2,)), ((S2,), (S1,)), ((S1,), (S2, b"a third secret, never S1"))],
)
def test_nodes_that_share_no_secret_are_refused(
    init_held: tuple[bytes, ...], acc_held: tuple[bytes, ...]
) -> None:
    with pytest.raises(AuthenticationFailed, match="does not hold the same secret"):
        run(shake(Role.INITIATOR, init_held), shake(Role.ACCEPTOR, acc_held))


def test_an_acceptor_holding_two_secrets_names_both_in_its_refusal() -> None:
    """S2-only dialling an acceptor of {S1, S3}: the acceptor's two proofs both fail."""
    with pytest.raises(AuthenticationFailed, match="neither of the 2"):
        run(shake(Role.INITIATOR, (S1, S2)), shake(Role.ACCEPTOR, (b"x" * 20, b"y" * 20)))


def test_older_mac_travels_only_during_a_rotation() -> None:
    """With one secret the acceptor's HELLO is what it always was (no ``older_mac``)."""
    one = run(shake(Role.INITIATOR, (S1,)), shake(Role.ACCEPTOR, (S1,)))
    two = run(shake(Role.INITIATOR, (S1,)), shake(Role.ACCEPTOR, (S1, S2)))
    assert "older_mac" not in one.by_acceptor[0][1]
    assert len(two.by_acceptor[0][1]["older_mac"]) == 32


def test_each_side_knows_whether_the_older_secret_was_used() -> None:
    init, acc = shake(Role.INITIATOR, (S1,)), shake(Role.ACCEPTOR, (S1, S2))
    run(init, acc)
    assert not init.used_older_secret  # its only secret
    assert acc.used_older_secret
    both_i, both_a = shake(Role.INITIATOR, (S1, S2)), shake(Role.ACCEPTOR, (S1, S2))
    run(both_i, both_a)
    assert not both_i.used_older_secret
    assert not both_a.used_older_secret
