"""A real etcd for the membership tests: Debian's ``etcd-server``, installed when missing
(:mod:`tests.apt`), on free loopback ports with its data in a temporary directory.

The tests stop it (a restart under a running fabric), and pause it with SIGSTOP (a partition:
its port still accepts, nothing answers, as behind a dropped route); :class:`Line` cuts one
daemon alone off from it.  With ``tls`` it serves clients over TLS only and asks each for a
certificate (made with openssl: :func:`make_tls`), and :meth:`Etcd.enable_auth` turns
authentication on.  Timeouts here are hang guards only.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import ssl
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aetcd
import grpc

from fabricd.daemon.launcher import _free_port, spawn_tied
from tests import apt

if TYPE_CHECKING:
    from pathlib import Path

#: how long etcd may take to answer after a start (a hang guard)
START_GUARD = 30.0


def skip_reason() -> str | None:
    """Why the etcd tests cannot run here (``None``: they can; etcd is installed now)."""
    return apt.ensure("etcd-server", "etcd")


@dataclass(frozen=True, slots=True)
class Tls:
    """A test CA and the certificates it signed: etcd's (for 127.0.0.1) and a client's."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_tls(directory: Path) -> Tls | str:
    """Make a CA and two certificates with openssl, or say why not (the reason to skip)."""
    if shutil.which("openssl") is None:
        return "openssl is not installed"
    curve = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    d = directory
    _openssl("req", "-x509", *curve, "-keyout", d / "ca.key", "-out", d / "ca.pem",
             "-days", "2", "-subj", "/CN=fabricd-test-ca")  # fmt: skip
    for who, extension in (
        ("server", "subjectAltName=IP:127.0.0.1"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        (d / f"{who}.ext").write_text(extension + "\n")
        _openssl("req", *curve, "-keyout", d / f"{who}.key", "-out", d / f"{who}.csr",
                 "-subj", f"/CN={who}")  # fmt: skip
        _openssl("x509", "-req", "-in", d / f"{who}.csr", "-CA", d / "ca.pem", "-CAkey",
                 d / "ca.key", "-CAcreateserial", "-out", d / f"{who}.pem", "-days", "2",
                 "-extfile", d / f"{who}.ext")  # fmt: skip
    return Tls(
        ca=d / "ca.pem",
        server_cert=d / "server.pem",
        server_key=d / "server.key",
        client_cert=d / "client.pem",
        client_key=d / "client.key",
    )


def _openssl(*args: object) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)


class Etcd:
    """One etcd member: :meth:`start`, :meth:`stop`, :meth:`pause`, :meth:`resume`."""

    def __init__(self, directory: Path, tls: Tls | None = None) -> None:
        self.directory = directory
        self.tls = tls
        self.client_port, self.peer_port = _free_port(), _free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self) -> None:
        """Start it (on the same ports and data as before, after a stop) and wait until it
        answers a health check."""
        scheme = "https" if self.tls else "http"
        client, peer = f"{scheme}://{self.endpoint}", f"http://127.0.0.1:{self.peer_port}"
        command = [
            "etcd",
            "--name=test",
            f"--data-dir={self.directory / 'data'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=test={peer}",
            "--log-outputs=stderr",
        ]
        if self.tls is not None:
            command += [
                f"--cert-file={self.tls.server_cert}",
                f"--key-file={self.tls.server_key}",
                f"--trusted-ca-file={self.tls.ca}",
                "--client-cert-auth",
            ]
        with open(self.directory / "etcd.log", "ab") as log:
            self.process = spawn_tied(command, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_GUARD
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"etcd exited: {self.log_tail()}")
            health = f"{'https' if self.tls else 'http'}://{self.endpoint}/health"
            context = self._ssl_context()
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(health, timeout=1, context=context) as r,
            ):
                if b'"health":"true"' in r.read():
                    return
            time.sleep(0.05)
        raise RuntimeError(f"etcd not healthy after {START_GUARD}s: {self.log_tail()}")

    def _ssl_context(self) -> ssl.SSLContext | None:
        if self.tls is None:
            return None
        context = ssl.create_default_context(cafile=str(self.tls.ca))
        context.load_cert_chain(str(self.tls.client_cert), str(self.tls.client_key))
        return context

    def enable_auth(self, password: str) -> None:
        """Turn authentication on, with the user ``root`` (etcd's first user) and
        ``password``: from now on every client must authenticate."""
        assert self.tls is not None, "a password goes over TLS only"
        credentials = grpc.ssl_channel_credentials(
            self.tls.ca.read_bytes(), self.tls.client_key.read_bytes(),
            self.tls.client_cert.read_bytes(),
        )  # fmt: skip
        with grpc.secure_channel(self.endpoint, credentials) as channel:
            auth = aetcd.rpc.AuthStub(channel)
            auth.UserAdd(aetcd.rpc.AuthUserAddRequest(name="root", password=password), timeout=10)
            grant = aetcd.rpc.AuthUserGrantRoleRequest(user="root", role="root")
            auth.UserGrantRole(grant, timeout=10)
            auth.AuthEnable(aetcd.rpc.AuthEnableRequest(), timeout=10)

    def put(self, key: bytes, value: bytes) -> None:
        """Write ``key`` as any client with write access could (plaintext servers only)."""
        assert self.tls is None, "a plaintext server only"
        with grpc.insecure_channel(self.endpoint) as channel:
            kv = aetcd.rpc.KVStub(channel)
            kv.Put(aetcd.rpc.PutRequest(key=key, value=value), timeout=10)

    def stop(self) -> None:
        """SIGTERM and wait (SIGKILL past the guard); its data stays for the next start."""
        if self.process is None or self.process.poll() is not None:
            return
        self.resume()
        self.process.terminate()
        try:
            self.process.wait(START_GUARD)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def pause(self) -> None:
        """Stop it answering (SIGSTOP): connections hang, as in a partition."""
        if self.process is not None:
            self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGCONT)

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            text = (self.directory / "etcd.log").read_text(errors="replace")
            return "\n".join(text.splitlines()[-lines:])
        return "(no log)"


class Line:
    """One daemon's own way to etcd: a byte forwarder on 127.0.0.1 that the test can cut, so
    that this daemon alone is cut off from etcd (its view goes stale) while the others, and
    etcd itself, go on.  Cut, it resets every connection and closes each new one at once:
    the daemon's calls fail and it keeps its last view, retrying.  Run by an event loop on a
    thread of its own; timeouts are hang guards only."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.port = _free_port()
        self._cut = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._accept, "127.0.0.1", self.port), self._loop
        )
        self._server = future.result(START_GUARD)

    def cut(self) -> None:
        """Sever the line: every connection reset, every new one closed at once."""
        asyncio.run_coroutine_threadsafe(self._sever(), self._loop).result(START_GUARD)

    def mend(self) -> None:
        """Let new connections through again (the daemon reconnects by itself)."""
        self._loop.call_soon_threadsafe(setattr, self, "_cut", False)

    def close(self) -> None:
        async def shut() -> None:
            self._server.close()
            await self._sever()

        asyncio.run_coroutine_threadsafe(shut(), self._loop).result(START_GUARD)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(START_GUARD)
        self._loop.close()

    async def _sever(self) -> None:
        self._cut = True
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut:
            writer.transport.abort()
            return
        host, port = self.upstream.rsplit(":", 1)
        try:
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.transport.abort()
        self._writers.discard(writer)
