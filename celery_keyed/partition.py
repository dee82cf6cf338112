"""A network partition for tests, demos and chaos runs: a TCP proxy between clients and one server that can go
*silent* — it keeps every connection open and stops forwarding, so a client waits for an answer that never comes
(no refusal, no reset), as behind a firewall that drops packets. Clients connected through it see the server
vanish; clients connected directly see nothing.

    with SilentProxy("127.0.0.1", pg_port) as proxy:
        url = proxy.url_for(database_url)    # give this URL to the worker to cut off
        ...
        proxy.silence()                      # the partition begins
        ...
        proxy.heal()                         # silenced connections are closed; new ones are forwarded again

One thread, bounded: it stops by itself after ``lifetime`` seconds (closing everything), and on ``stop``.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from typing import Self

from sqlalchemy.engine import make_url

_CHUNK = 65536


class SilentProxy:
    """Forwards TCP from ``127.0.0.1:port`` to ``target_host:target_port`` until ``silence``."""

    def __init__(self, target_host: str, target_port: int, *, lifetime: float = 300.0) -> None:
        self.target = (target_host, target_port)
        self.lifetime = lifetime
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._peers: dict[socket.socket, socket.socket] = {}  # both directions of every forwarded connection
        self._held: list[socket.socket] = []  # silenced: open, never read, never written
        self._silent = False
        self._commands: list[str] = []
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self.accepted = 0  # connections accepted so far (forwarded or held)

    # -- control (any thread) -----------------------------------------------------------------------------

    def start(self) -> Self:
        if self._thread is None:
            self._selector.register(self._listener, selectors.EVENT_READ)
            self._thread = threading.Thread(target=self._run, name=f"silent-proxy-{self.port}", daemon=True)
            self._thread.start()
        return self

    def silence(self) -> None:
        """From now on forward nothing: open connections stay open and unanswered, new ones are accepted and
        left unanswered."""
        self._command("silence")

    def heal(self) -> None:
        """Close the silenced connections (their clients see the connection end) and forward new ones again."""
        self._command("heal")

    def stop(self, timeout: float = 5.0) -> None:
        """Close every connection and the listener; safe to call twice."""
        self._command("stop")
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    @property
    def silent(self) -> bool:
        return self._silent

    def url_for(self, url: str) -> str:
        """``url`` (a database URL) pointed at this proxy."""
        return make_url(url).set(host="127.0.0.1", port=self.port).render_as_string(hide_password=False)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _command(self, command: str) -> None:
        with self._lock:
            self._commands.append(command)
        if self._thread is None and command == "stop":
            self._close_all()

    # -- the thread ---------------------------------------------------------------------------------------

    def _run(self) -> None:
        deadline = time.monotonic() + self.lifetime
        try:
            while time.monotonic() < deadline:
                with self._lock:
                    commands, self._commands = self._commands, []
                for command in commands:
                    if command == "stop":
                        return
                    if command == "silence":
                        self._go_silent()
                    elif command == "heal":
                        self._heal()
                for key, _ in self._selector.select(timeout=0.05):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    if sock is self._listener:
                        self._accept()
                    elif sock in self._peers:
                        self._forward(sock)
        finally:
            self._close_all()

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        self.accepted += 1
        if self._silent:
            self._held.append(client)
            return
        try:
            upstream = socket.create_connection(self.target, timeout=5.0)
        except OSError:
            client.close()
            return
        for sock in (client, upstream):
            sock.settimeout(5.0)
            self._selector.register(sock, selectors.EVENT_READ)
        self._peers[client], self._peers[upstream] = upstream, client

    def _forward(self, sock: socket.socket) -> None:
        other = self._peers[sock]
        try:
            data = sock.recv(_CHUNK)
            if data:
                other.sendall(data)
                return
        except OSError:
            pass
        self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        other = self._peers.pop(sock, None)
        for s in (sock, other):
            if s is None:
                continue
            self._peers.pop(s, None)
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(s)
            s.close()

    def _go_silent(self) -> None:
        self._silent = True
        for sock in list(self._peers):
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(sock)
            self._held.append(sock)
        self._peers.clear()

    def _heal(self) -> None:
        self._silent = False
        held, self._held = self._held, []
        for sock in held:
            sock.close()

    def _close_all(self) -> None:
        self._stopped.set()
        for sock in [*self._peers, *self._held]:
            with contextlib.suppress(OSError):
                sock.close()
        self._peers.clear()
        self._held.clear()
        with contextlib.suppress(OSError):
            self._listener.close()
        with contextlib.suppress(Exception):
            self._selector.close()
