"""The parameter server's numbers as an operator reads them (issue 12, item 6): the status rows,
the Prometheus families a scrape sees and the tables ``fabricctl status`` draws, from real
daemons whose traffic is known: bytes with and without filters, the share G-RP drops, the delay
histogram, and the updates dropped for exceeding tau_max (at the server and at the worker).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

import fabricd
from fabricd.engines.ps import push as ps_push
from fabricd.engines.ps import storage as ps_storage
from tests.integration.scrape import Samples, scrape
from tests.integration.test_cli import _ctl, _tables
from tests.integration.test_collectives import ranks
from tests.integration.test_ps import COUNT, open_all, step, wait

if TYPE_CHECKING:
    from fabricd.client import Client

pytestmark = pytest.mark.timeout(240)

ROUNDS = 3


def _sample(samples: Samples, name: str, **labels: str) -> float:
    return samples[name, frozenset({"service": "ps", **labels}.items())]


def _only(fab: Client, rows: str) -> dict[str, Any]:
    (row,) = [r for r in fab.status()[rows] if r["name"] == "m"]
    return row


def test_status_and_metrics_count_the_filtered_bytes_grp_share_and_delays(make_cluster) -> None:
    cluster = make_cluster(2)
    with ranks(cluster, (0, 1, 1), "ps-metrics") as fabs:
        filters = fabricd.FilterSettings(grp_drop=0.5, glnp=True, plnp=True)
        pss = open_all(fabs, [0], consistency="async", filters=filters)
        workers = [1, 2]
        models = {w: fabs[w].array("w", (COUNT,), "float64") for w in workers}
        updates = {w: fabs[w].array("u", (COUNT,), "float64") for w in workers}
        for w in workers:
            updates[w][:] = np.arange(COUNT) + w
        for _ in range(ROUNDS):
            # both push from the same version: one is applied to it (delay 0), the other to
            # the version the first made (delay 1)
            step(fabs, pss, workers, updates, models)
        server = _only(fabs[0], "ps_servers")
        rows = [r for r in fabs[1].status()["ps_workers"] if r["name"] == "m"]
        server_samples, worker_samples = (scrape(node.metrics_url) for node in cluster.nodes)
        human = _ctl("status", "--socket", cluster.nodes[0].socket_path, env={"COLUMNS": "300"})
        workers_human = _ctl(
            "status", "--socket", cluster.nodes[1].socket_path, env={"COLUMNS": "300"}
        )
        as_json = _ctl("status", "--json", "--socket", cluster.nodes[0].socket_path)

    # the workers' rows: G-RP picks exactly half of each push, G-LNP sends the rest as float16
    assert sorted(r["rank"] for r in rows) == workers
    for row in rows:
        assert row["considered"] == ROUNDS * COUNT
        assert row["rp_selected"] == row["considered"] // 2  # round(0.5 * 1000) per push
        assert row["pushed"] == row["considered"] - row["rp_selected"]  # G-RP alone decides
        # unfiltered: a dense push or answer, header included, every round
        dense_push = ROUNDS * (ps_push.HEADER.size + COUNT * 8)
        dense_pull = ROUNDS * (ps_storage.HEADER.size + COUNT * 8)
        assert row["push_bytes"] < row["push_dense_bytes"] == dense_push
        assert row["pull_bytes"] < row["pull_dense_bytes"] == dense_pull
        assert row["delay_dropped"] == 0
    # what the workers sent is what the server took, and what it answered what they got
    assert server["pushes"] == len(workers) * ROUNDS
    assert server["push_bytes"] == sum(r["push_bytes"] for r in rows)
    assert server["push_dense_bytes"] == sum(r["push_dense_bytes"] for r in rows)
    assert server["pull_bytes"] == sum(r["pull_bytes"] for r in rows)
    assert server["applied"] == len(workers) * ROUNDS
    assert sum(server["delays"]) == server["applied"]
    assert server["delays"][:2] == [ROUNDS, ROUNDS]  # delay 0, delay 1: one of each a round
    assert server["delay_sum"] == ROUNDS

    # the scrape of the workers' node: the same bytes, and G-RP's share from the counters
    pushed = {
        f: _sample(worker_samples, "fabricd_ps_push_bytes_total", filtered=f) for f in ("yes", "no")
    }
    assert pushed == {
        "yes": sum(r["push_bytes"] for r in rows),
        "no": sum(r["push_dense_bytes"] for r in rows),
    }
    assert pushed["yes"] < pushed["no"]
    pulled = {
        f: _sample(worker_samples, "fabricd_ps_pull_bytes_total", filtered=f) for f in ("yes", "no")
    }
    assert pulled["yes"] < pulled["no"]
    selected = {
        f: _sample(worker_samples, "fabricd_ps_gradients_selected_total", filter=f)
        for f in ("gsmp", "grp", "dropped", "considered")
    }
    assert selected["grp"] / selected["considered"] == 0.5
    assert selected["dropped"] == selected["grp"]
    assert selected["gsmp"] == 0
    # the scrape of the server's node: a histogram whose count is the updates applied
    histogram = "fabricd_ps_update_delay"
    assert _sample(server_samples, f"{histogram}_count") == server["applied"]
    assert _sample(server_samples, f"{histogram}_bucket", le="+Inf") == server["applied"]
    assert _sample(server_samples, f"{histogram}_bucket", le="0") == ROUNDS
    assert _sample(server_samples, f"{histogram}_bucket", le="1") == 2 * ROUNDS  # cumulative
    assert _sample(server_samples, f"{histogram}_sum") == ROUNDS
    assert _sample(server_samples, "fabricd_ps_shards", role="primary") == 1

    # fabricctl status: the tables, and --json with every field of the rows
    assert human.returncode == 0, human.stderr
    (servers,) = [t for t in _tables(human.stdout) if "consistency" in t]
    assert (servers["name"], servers["role"], servers["applied"]) == (["m"], ["primary"], ["6"])
    assert "% saved" in servers["push bytes"][0]
    assert servers["dropped tau_max"] == ["0"]
    assert workers_human.returncode == 0, workers_human.stderr
    (table,) = [t for t in _tables(workers_human.stdout) if "G-RP" in t]
    assert table["rank"] == ["1", "2"]
    assert table["G-RP"] == table["dropped"] == ["50.0%", "50.0%"]
    assert table["G-SMP"] == ["0%", "0%"]
    assert as_json.returncode == 0, as_json.stderr
    (shown,) = [r for r in json.loads(as_json.stdout)["ps_servers"] if r["name"] == "m"]
    assert shown.keys() == server.keys()


def test_updates_past_tau_max_are_dropped_and_counted_at_the_server_and_the_worker(
    make_cluster,
) -> None:
    cluster = make_cluster(2)
    with ranks(cluster, (0, 1, 1), "ps-tau") as fabs:
        pss = open_all(fabs, [0], consistency="async", delay_bound=0)
        updates = {w: fabs[w].array("u", (COUNT,), "float64") for w in (1, 2)}
        for w in (1, 2):
            updates[w][:] = w
        assert wait(pss[1].push_async(updates[1]), fabs).dropped == ()  # version 1
        # worker 2 computed from version 0 and has heard of no later one: its daemon sends
        # the update, and the server, at version 1, drops it (delay 1 > 0)
        late = wait(pss[2].push_async(updates[2]), fabs)
        assert len(late.dropped) == 1
        assert "delay 1 > bound 0" in late.dropped[0]
        # the answer told worker 2's daemon of version 1: it drops the next one at home
        again = wait(pss[2].push_async(updates[2]), fabs)
        assert len(again.dropped) == 1
        server = _only(fabs[0], "ps_servers")
        worker = next(r for r in fabs[1].status()["ps_workers"] if r["rank"] == 2)
        server_samples, worker_samples = (scrape(node.metrics_url) for node in cluster.nodes)

    assert (server["applied"], server["dropped_delay"], server["dropped_lost"]) == (1, 1, 0)
    assert (worker["delay_dropped"], worker["server_dropped"]) == (1, 1)
    dropped = "fabricd_ps_updates_dropped_total"
    assert _sample(server_samples, dropped, reason="delay_server") == 1
    assert _sample(worker_samples, dropped, reason="delay_worker") == 1
    assert _sample(worker_samples, dropped, reason="delay_server") == 0  # no server there
    assert _sample(server_samples, "fabricd_ps_update_delay_count") == 1  # the applied one
