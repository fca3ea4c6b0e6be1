"""The client facade: each shortcut on :class:`fabricd.Client` is its facet's method under the
same signature, and every call that waits has an ``_async`` twin that returns a handle.

Read from the classes with :mod:`inspect`, so a shortcut that drifts from its facet (a new
keyword on one side only) or a blocking call added without its twin fails here.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import pytest
from fakedaemon import FakeDaemon

from fabricd.client import Client, ParameterServer, checks
from fabricd.client.ako import PartialExchange, PartialExchanges
from fabricd.client.collectives import Collectives
from fabricd.client.p2p import PointToPoint
from fabricd.client.stochastic import StochasticReduce

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

#: the client's facets, by the attribute that holds each
FACETS: dict[str, type] = {
    "p2p": PointToPoint,
    "collectives": Collectives,
    "stochastic": StochasticReduce,
    "ako": PartialExchanges,
}
#: the client's methods that are its own, not shortcuts to a facet
OWN = {"array", "parameter_server", "status", "stalls", "config", "poll", "close"}
#: calls that wait and have no ``_async`` twin, and why
NO_TWIN = {
    Client: {
        "parameter_server",  # opens a model: the calls on the model have twins
        "partial_exchange",  # opens an exchange: its step and flush have twins
        "status",  # the control queries: answered at once, from the daemon's memory
        "stalls",
        "config",
        "poll",  # the wait for events itself
    },
}


def public_methods(cls: type) -> dict[str, Callable[..., Any]]:
    return {
        name: value
        for name, value in vars(cls).items()
        if not name.startswith("_") and inspect.isfunction(value)
    }


@pytest.fixture
def fab() -> Iterator[Client]:
    daemon = FakeDaemon()
    client = daemon.client(checks.membership("j", 0, 2))
    yield client
    client.close()
    daemon.stop()


def test_the_facets_are_where_the_shortcuts_expect_them(fab: Client) -> None:
    assert {attribute: type(getattr(fab, attribute)) for attribute in FACETS} == FACETS


@pytest.mark.parametrize(
    ("facet", "name"),
    [(facet, name) for facet, cls in FACETS.items() for name in public_methods(cls)],
)
def test_each_shortcut_has_its_facets_signature(facet: str, name: str) -> None:
    shortcut = public_methods(Client).get(name)
    assert shortcut is not None, f"Client has no shortcut to {facet}.{name}"
    assert inspect.signature(shortcut) == inspect.signature(getattr(FACETS[facet], name))


def test_every_method_of_the_client_is_its_own_or_a_shortcut() -> None:
    shortcuts = {name for cls in FACETS.values() for name in public_methods(cls)}
    assert set(public_methods(Client)) == shortcuts | OWN


@pytest.mark.parametrize(
    "cls",
    # (the ako facet only opens exchanges: PartialExchange's step and flush wait)
    [
        Client,
        *(c for c in FACETS.values() if c is not PartialExchanges),
        ParameterServer,
        PartialExchange,
    ],
    ids=lambda c: c.__name__,
)
def test_every_call_that_waits_has_an_async_twin(cls: type) -> None:
    methods = public_methods(cls)
    waiting = {
        name
        for name, method in methods.items()
        if "timeout" in inspect.signature(method).parameters and name not in NO_TWIN.get(cls, set())
    }
    assert waiting  # every class checked has calls that wait
    for name in sorted(waiting):
        twin = methods.get(f"{name}_async")
        assert twin is not None, f"{cls.__name__}.{name} waits but has no {name}_async"
        blocking = inspect.signature(methods[name]).parameters
        assert list(inspect.signature(twin).parameters.values()) == [
            p for p in blocking.values() if p.name != "timeout"
        ], f"{cls.__name__}.{name}_async takes other arguments than {name} (timeout aside)"
