"""What a parameter server's ``ps_open`` request says: the spec every rank of the model opens
it with (:func:`spec_of`), checked for what its values mean (:func:`check_spec`), and the
filter settings (:func:`settings_of`).  Split from ``ps.py`` (the house's size limit for a
service module); the size of a shard against ``max_payload`` stays there, with the config.
"""

from __future__ import annotations

from typing import Any, Final

from fabricd.dtypes import FLOAT_DTYPES as DTYPES
from fabricd.engines.ps.bounded import DivergenceBound
from fabricd.engines.ps.consistency import CONSISTENCIES
from fabricd.engines.ps.filters import FilterSettings
from fabricd.errors import UsageError
from fabricd.frames.fields import MAX_RANK, get_bool
from fabricd.frames.ps import DISTRIBUTIONS, REPLICATIONS, SCHEDULINGS
from fabricd.wire import Meta, get_int, get_str

_MAX_SERVERS: Final = 4096
_FILTER_FIELDS: Final = tuple(FilterSettings.__dataclass_fields__)


def check_spec(spec: Meta) -> None:
    """Refuse a spec whose values mean nothing to the service (``frames/ps.py`` checked the
    types and ranges): ranks, dtype, consistency and the options each model takes.

    Raises:
        UsageError: which field, and why.
    """
    servers, replicas, n = spec["servers"], spec["replicas"], spec["n"]
    ranks = [*servers, *replicas]
    if not servers or len(servers) > _MAX_SERVERS:
        raise UsageError(f"a parameter server has 1 to {_MAX_SERVERS} server ranks")
    if replicas and len(replicas) != len(servers):
        raise UsageError("replicas: none, or one rank per server (shard)")
    if len(set(ranks)) != len(ranks) or not all(0 <= r < n for r in ranks):
        raise UsageError(f"servers and replicas are distinct ranks of the job's 0..{n - 1}")
    if len(ranks) >= n:
        raise UsageError("a parameter server needs at least one worker rank")
    if spec["dtype"] not in DTYPES:
        raise UsageError(f"dtype {spec['dtype']!r}: one of {', '.join(DTYPES)}")
    if spec["consistency"] not in CONSISTENCIES:
        raise UsageError(f"consistency {spec['consistency']!r}: one of {', '.join(CONSISTENCIES)}")
    if spec["staleness"] and spec["consistency"] != "ssp":
        raise UsageError("staleness belongs to consistency='ssp'")
    if spec["delay_bound"] is not None and spec["consistency"] != "async":
        raise UsageError("delay_bound belongs to consistency='async'")
    if spec["scheduling"] not in SCHEDULINGS:
        raise UsageError(f"scheduling {spec['scheduling']!r}: one of {', '.join(SCHEDULINGS)}")
    if spec["scheduling"] == "mlfabric" and spec["consistency"] == "ssp":
        raise UsageError(
            "scheduling='mlfabric' schedules async (MLfabric-A, §5) or bsp (MLfabric-S, §6) "
            "models, not ssp"
        )
    if spec["aggregation"] and spec["scheduling"] != "mlfabric":
        raise UsageError("aggregation=True needs scheduling='mlfabric' (MLfabric §5.2)")
    if spec["distribution"] not in DISTRIBUTIONS:
        raise UsageError(
            f"distribution {spec['distribution']!r}: one of {', '.join(DISTRIBUTIONS)}"
        )
    if spec["distribution"] == "tree" and spec["scheduling"] != "mlfabric":
        raise UsageError(
            "distribution='tree' needs scheduling='mlfabric': its scheduler batches the pulls "
            "and plans the trees over the monitor's figures (MLfabric §10.3)"
        )
    _check_replication(spec)


def _check_replication(spec: Meta) -> None:
    """``replication`` and ``divergence_bound`` (fabricd/engines/ps/bounded.py)."""
    if spec["replication"] not in REPLICATIONS:
        raise UsageError(f"replication {spec['replication']!r}: one of {', '.join(REPLICATIONS)}")
    bound = spec["divergence_bound"]
    if spec["replication"] == "chain":
        if bound is not None:
            raise UsageError("divergence_bound belongs to replication='bounded'")
        return
    if not spec["replicas"]:
        raise UsageError("replication='bounded' needs replicas")
    if spec["consistency"] != "async":
        raise UsageError(
            "replication='bounded' takes consistency='async': a promoted replica may be behind "
            "(MLfabric §3.3), and under bsp or ssp its workers would wait for ever for the "
            "iterations it lost"
        )
    if bound is None:
        raise UsageError(
            "replication='bounded' needs a divergence_bound (a norm, updates, or both)"
        )
    DivergenceBound.from_spec(bound)


def spec_of(meta: Meta, n: int) -> Meta:
    """The spec every rank of a model opens it with, from a request."""
    servers, replicas = meta.get("servers"), meta.get("replicas", [])
    for what, ranks in (("servers", servers), ("replicas", replicas)):
        if not isinstance(ranks, list) or not all(
            type(r) is int and 0 <= r < MAX_RANK for r in ranks
        ):
            raise UsageError(f"{what}: a list of ranks")
    delay_bound = meta.get("delay_bound")
    return {
        "n": n,
        "size": get_int(meta, "size", lo=1),
        "dtype": get_str(meta, "dtype"),
        "servers": list(servers),  # type: ignore[arg-type]
        "replicas": list(replicas),
        "consistency": get_str(meta, "consistency"),
        "staleness": get_int(meta, "staleness"),
        "delay_bound": None if delay_bound is None else get_int(meta, "delay_bound"),
        "chunk": get_int(meta, "chunk", lo=1),
        "scheduling": get_str(meta, "scheduling") if "scheduling" in meta else "arrival",
        "aggregation": get_bool(meta, "aggregation") if "aggregation" in meta else False,
        "replication": get_str(meta, "replication") if "replication" in meta else "chain",
        "divergence_bound": _bound_of(meta.get("divergence_bound")),
        "distribution": get_str(meta, "distribution") if "distribution" in meta else "direct",
    }


def _bound_of(value: object) -> list[Any] | None:
    """A request's ``divergence_bound`` (None or ``[norm, updates]``) as a spec holds it: the
    norm a float."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 2:
        raise UsageError(f"divergence_bound: None or [norm, updates], not {value!r}")
    bound = DivergenceBound.from_spec(value)
    return [None if bound.norm is None else float(bound.norm), bound.updates]


def settings_of(filters: Any) -> FilterSettings:
    if filters is None:
        return FilterSettings()
    if not isinstance(filters, dict) or not set(filters) <= set(_FILTER_FIELDS):
        raise UsageError(f"filters: a map of {', '.join(_FILTER_FIELDS)}")
    return FilterSettings(**filters)
