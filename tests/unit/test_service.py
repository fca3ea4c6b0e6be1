"""The service contract's routing rule: one owner per frame kind and per request op."""

from __future__ import annotations

import pytest

from fabricd.daemon.service import BaseService, Host, check_claims
from fabricd.wire import Kind


def service(name: str, kinds: set[Kind] = set(), ops: set[str] = set()) -> BaseService:  # noqa: B006
    s = BaseService()
    s.name, s.kinds, s.ops = name, frozenset(kinds), frozenset(ops)
    return s


def test_disjoint_claims_are_accepted() -> None:
    check_claims([service("a", {Kind.RTS}, {"send"}), service("b", {Kind.CTS}, {"recv"})])


def test_two_services_claiming_one_kind_are_refused() -> None:
    with pytest.raises(ValueError, match="'a' and 'b' both claim RTS frames"):
        check_claims([service("a", {Kind.RTS}), service("b", {Kind.RTS, Kind.CTS})])


def test_two_services_claiming_one_op_are_refused() -> None:
    with pytest.raises(ValueError, match="'a' and 'b' both claim op 'send'"):
        check_claims([service("a", ops={"send"}), service("b", ops={"send"})])


def test_the_base_service_refuses_what_it_did_not_claim() -> None:
    base = BaseService()
    assert base.next_deadline() is None
    assert base.in_flight() == 0
    assert base.statistics() == {}
    with pytest.raises(NotImplementedError):
        base.on_frame(1, None, 0.0)  # type: ignore[arg-type]


def test_a_service_cannot_reset_a_peer_behind_the_peers_engine() -> None:
    """A reset the peers engine did not decide leaves it believing both links are up: the
    dialler would not redial until the peer was called down (down_after).  A service that
    must drop a peer raises RemoteProtocolError from on_frame; the node closes the link and
    the engine resets the peer."""
    assert not hasattr(Host, "reset_peer")
