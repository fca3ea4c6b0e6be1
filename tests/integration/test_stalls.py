"""Stall reports from real daemons: a rank waits for a send that never comes.

Two daemons on loopback with ``stall_after = 0.5``; rank 0 (node 0) posts a receive from
rank 1 (node 1), which joins but never sends.  The log line and ``fabricctl stalls`` must name
rank 1, say that no RTS came, and say that node 1 is up.  Timeouts here only guard against a
hang.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

from fabricd.client import connect
from fabricd.daemon.node import MAX_STALL_ROWS
from tests.integration.test_metrics import scrape

if TYPE_CHECKING:
    from collections.abc import Callable

STALL_AFTER = 0.5
HANG_GUARD = 30.0


def _until(check: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + HANG_GUARD
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.05)
    raise AssertionError(f"gave up waiting for {what}")


def _ctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fabricd.cli.ctl", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "COLUMNS": "250"},
    )


def test_a_receive_whose_sender_never_sends_is_reported_naming_the_missing_rank(make_cluster):
    cluster = make_cluster(2, stall_after=STALL_AFTER)
    sockets = [node.socket_path for node in cluster.nodes]
    with (
        connect(job="stuck", rank=0, size=2, socket_path=sockets[0]) as waiting,
        connect(job="stuck", rank=1, size=2, socket_path=sockets[1]),
    ):
        _until(lambda: len(waiting.status()["ranks"]) == 2, "rank 1 to be known on node 0")
        array = waiting.array("grad", (256,), "float32")
        handle = waiting.recv_async(array, src=1, tag=7)
        rows = _until(lambda: waiting.stalls()["stalls"], "a stall on node 0")
        log = _until(
            lambda: (
                "stalled: recv" in cluster.nodes[0].log_path.read_text()
                and cluster.nodes[0].log_path.read_text()
            ),
            "the stall's log line",
        )
        as_json = _ctl("stalls", "--json", "--socket", sockets[0])
        table = _ctl("stalls", "--socket", sockets[0])
        samples = scrape(waiting.status()["metrics_url"])
        assert not handle.done()
    [row] = rows
    assert (row["kind"], row["job"], row["rank"], row["peer"], row["tag"]) == (
        "recv",
        "stuck",
        0,
        1,
        7,
    )
    assert (row["waits"], row["peer_joined"], row["peer_posted"]) == ("rts", True, False)
    assert (row["peer_node"], row["peer_node_state"]) == (1, "up")
    assert row["peer_node_silent_for"] < HANG_GUARD
    assert row["pending_for"] >= STALL_AFTER
    assert row["nbytes"] == 1024
    assert samples["fabricd_stalled_operations", frozenset({("service", "p2p")})] == 1

    [line] = [line for line in log.splitlines() if "stalled: recv" in line]
    assert "recv of rank 0 from rank 1, job 'stuck', tag 7, 1024 B float32" in line
    assert "waits for rts: rank 1 on node 1 has sent nothing to rank 0 with tag 7" in line
    assert "rank 1 has not posted a match, on node 1: up, last heard" in line

    assert as_json.returncode == 0, as_json.stderr
    reported = json.loads(as_json.stdout)
    assert (reported["node"], reported["stall_after"]) == (0, STALL_AFTER)
    assert [(r["peer"], r["waits"], r["peer_node"]) for r in reported["stalls"]] == [(1, "rts", 1)]

    assert table.returncode == 0, table.stderr
    assert "stalled on node 0 (stall_after 0.5 s): 1" in table.stdout
    assert "rank 1 on node 1 has sent nothing to rank 0" in " ".join(table.stdout.split())
    assert "1 up, heard" in table.stdout


def test_a_daemon_without_stalls_says_so(make_cluster):
    cluster = make_cluster(1, stall_after=STALL_AFTER)
    result = _ctl("stalls", "--socket", cluster.nodes[0].socket_path)
    assert result.returncode == 0, result.stderr
    assert "node 0: no operation pending longer than stall_after 0.5 s" in result.stdout
    with connect(socket_path=cluster.nodes[0].socket_path) as control:
        answer = control.stalls()
    assert (answer["node"], answer["stall_after"], answer["stalls"]) == (0, STALL_AFTER, [])


def test_two_ranks_on_one_node_that_disagree_on_the_tag_are_both_named(make_cluster):
    cluster = make_cluster(1, stall_after=STALL_AFTER)
    socket = cluster.nodes[0].socket_path
    with (
        connect(job="tags", rank=0, size=2, socket_path=socket) as receiver,
        connect(job="tags", rank=1, size=2, socket_path=socket) as sender,
    ):
        receiver.recv_async(receiver.array("in", (4,), "int32"), src=1, tag=5)
        sender.send_async(sender.array("out", (4,), "int32"), to=0, tag=3)
        rows = _until(
            lambda: len(stalls := receiver.stalls()["stalls"]) == 2 and stalls, "both stalls"
        )
    by_kind = {row["kind"]: row for row in rows}
    recv, send = by_kind["recv"], by_kind["send"]
    assert (recv["peer"], recv["tag"], recv["waits"], recv["other_tags"]) == (1, 5, "match", [3])
    assert (send["peer"], send["tag"], send["waits"], send["other_tags"]) == (0, 3, "match", [5])
    assert recv["peer_node_state"] == send["peer_node_state"] == "local"
    assert "its sends to rank 0 with tags 3 wait here for their recvs" in recv["detail"]


def test_many_stalls_are_answered_oldest_first_up_to_a_bound(make_cluster):
    """16,000 stalled receives (a quarter of one client's max_ops_per_client) made a reply of
    4.8 MB, past the 4 MiB a reply may be: the daemon cut the asking client's connection off,
    and the operator could see no stall at all."""
    cluster = make_cluster(1, stall_after=STALL_AFTER)
    socket = cluster.nodes[0].socket_path
    count = 16000
    with (
        connect(job="many", rank=0, size=2, socket_path=socket) as waiting,
        connect(job="many", rank=1, size=2, socket_path=socket),
        connect(socket_path=socket) as control,
    ):
        array = waiting.array("in", (4,), "uint8")
        for tag in range(count):
            waiting.recv_async(array, src=1, tag=tag)
        answer = _until(
            lambda: (a := control.stalls())["left_out"] == count - MAX_STALL_ROWS and a,
            "every receive to be pending past stall_after",
        )
        assert control.status()["pending_ops"] == count  # the connection is still served
    rows = answer["stalls"]
    assert len(rows) == MAX_STALL_ROWS
    assert [row["tag"] for row in rows] == list(range(MAX_STALL_ROWS))  # the oldest first
    assert answer["hidden"] == {}


def _stall_lines(cluster: Any, node: int) -> list[str]:
    log = cluster.nodes[node].log_path.read_text()
    return [line for line in log.splitlines() if "stalled: allreduce" in line]


def _long_stalls(client: Any, count: int) -> list[dict[str, Any]]:
    """``client``'s daemon's ``count`` stall rows once each is pending four ``stall_after``
    (the timer that logs a stalled call has had three ``stall_after`` to log it again)."""
    return _until(
        lambda: (
            len(rows := client.stalls()["stalls"]) == count
            and all(row["pending_for"] >= 4 * STALL_AFTER for row in rows)
            and rows
        ),
        f"{count} calls pending four stall_after",
    )


def test_two_ranks_on_one_node_calling_different_names_each_log_one_line_naming_the_other(
    make_cluster,
):
    """Issue 23, item 4: a name mismatch made both ranks wait with no log line at all."""
    cluster = make_cluster(1, stall_after=STALL_AFTER)
    socket = cluster.nodes[0].socket_path
    with (
        connect(job="names", rank=0, size=2, socket_path=socket) as first,
        connect(job="names", rank=1, size=2, socket_path=socket) as second,
    ):
        calls = [
            first.allreduce_async(first.array("a", (4,), "float32"), name="grad"),
            second.allreduce_async(second.array("b", (4,), "float32"), name="grads"),
        ]
        rows = _long_stalls(first, 2)
        lines = _stall_lines(cluster, 0)
        assert not any(call.done() for call in calls)
    by_name = {row["tag"]: row for row in rows}
    grad, grads = by_name["grad"], by_name["grads"]
    assert (grad["rank"], grad["waits"], grad["not_called"], grad["other_names"]) == (
        0,
        "ranks",
        [1],
        ["grads"],
    )
    assert (grads["rank"], grads["not_called"], grads["other_names"]) == (1, [0], ["grad"])
    assert "rank 1 has not called 'grad'; it waits in 'grads'" in grad["detail"]
    assert "rank 0 has not called 'grads'; it waits in 'grad'" in grads["detail"]
    assert len(lines) == 2, lines  # one each, however long they wait
    [line0] = [line for line in lines if "of rank 0, 'grad', job 'names'" in line]
    [line1] = [line for line in lines if "of rank 1, 'grads', job 'names'" in line]
    assert "WARNING" in line0
    assert line0.endswith(grad["detail"])  # the row's words
    assert line1.endswith(grads["detail"])


def test_two_ranks_on_two_nodes_calling_different_names_each_log_what_their_node_knows(
    make_cluster,
):
    """Each node sees only its own rank's call; what it knows of the other is where that rank
    is and the name whose frames came from there with no call here."""
    cluster = make_cluster(2, stall_after=STALL_AFTER)
    sockets = [node.socket_path for node in cluster.nodes]
    with (
        connect(job="apart", rank=0, size=2, socket_path=sockets[0]) as first,
        connect(job="apart", rank=1, size=2, socket_path=sockets[1]) as second,
    ):
        calls = [
            first.allreduce_async(first.array("a", (4,), "float32"), name="grad"),
            second.allreduce_async(second.array("b", (4,), "float32"), name="grads"),
        ]
        [grad] = _long_stalls(first, 1)
        [grads] = _long_stalls(second, 1)
        lines = [_stall_lines(cluster, 0), _stall_lines(cluster, 1)]
        assert not any(call.done() for call in calls)
    assert (grad["tag"], grad["waits"], grad["peer_node"], grad["other_names"]) == (
        "grad",
        "messages",
        1,
        ["grads"],
    )
    assert (grads["tag"], grads["peer_node"], grads["other_names"]) == ("grads", 0, ["grad"])
    assert "rank 1 is on node 1, whose calls this node cannot see" in grad["detail"]
    assert "no rank on this node has called 'grads', which peer nodes run" in grad["detail"]
    assert "no rank on this node has called 'grad', which peer nodes run" in grads["detail"]
    [line0], [line1] = lines  # one on each node, however long they wait
    assert line0.endswith(grad["detail"])
    assert line1.endswith(grads["detail"])
