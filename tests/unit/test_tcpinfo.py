"""TCP_INFO read from real loopback sockets: the offsets of ``struct tcp_info`` agree with
what the sockets did (bytes sent and received), and the figures are sane."""

from __future__ import annotations

import asyncio
import socket

import pytest
import uvloop

from fabricd.transports import tcpinfo
from fabricd.transports.tcp import TcpTransport
from fabricd.wire import DEFAULT_LIMITS

pytestmark = pytest.mark.skipif(
    not hasattr(socket, "TCP_INFO"), reason="this platform has no TCP_INFO"
)
NBYTES = 4 << 20
CHUNK = 256 << 10


def test_the_fields_read_match_what_the_sockets_moved() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = socket.create_connection(server.getsockname(), timeout=20)
        receiver, _ = server.accept()
        receiver.settimeout(20)
        with sender, receiver:
            for _ in range(NBYTES // CHUNK):  # in turns: neither side's buffers fill up
                sender.sendall(bytes(CHUNK))
                got = 0
                while got < CHUNK:
                    got += len(receiver.recv(CHUNK))
            sender.sendall(b"x")  # its ack confirms the peer acknowledged the bulk before it
            assert receiver.recv(1) == b"x"
            sent, received = tcpinfo.read(sender), tcpinfo.read(receiver)
    if sent is None or received is None:
        pytest.skip("this kernel's struct tcp_info is shorter than the fields read")
    assert received.bytes_received == NBYTES + 1
    assert NBYTES <= sent.bytes_acked <= NBYTES + 2  # (the SYN counts one)
    assert sent.delivery_rate > 0
    assert 0 < sent.rtt < 60
    assert received.bytes_acked <= 1  # it sent nothing


def test_short_or_missing_info_is_none() -> None:
    assert tcpinfo.parse(bytes(tcpinfo.NEEDED - 1)) is None
    assert tcpinfo.read(None) is None
    unix_a, unix_b = socket.socketpair()
    with unix_a, unix_b:
        assert tcpinfo.read(unix_a) is None  # not TCP: the kernel refuses, nothing raises


@pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop])
def test_a_tcp_link_reports_its_path_on_either_loop(loop_factory) -> None:
    async def main() -> tuple[tcpinfo.PathInfo | None, tcpinfo.PathInfo | None]:
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        transport = TcpTransport()
        listener = await transport.listen("127.0.0.1:0", accepted.set_result, DEFAULT_LIMITS)
        link = await transport.connect(listener.address, DEFAULT_LIMITS)
        other = await asyncio.wait_for(accepted, 20)
        info = link.path_info()
        link.close("done")
        other.close("done")
        await listener.aclose()
        return info, link.path_info()

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        info, after_close = runner.run(main())
    assert info is not None
    assert info.bytes_acked >= 1
    assert 0 < info.rtt < 60
    assert after_close is None
