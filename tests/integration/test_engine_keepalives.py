"""The ledger's connections carry TCP keepalives and a user timeout (D19), checked on the socket of a real
connection to PostgreSQL: the kernel, not only libpq's parameters, has them."""

from __future__ import annotations

import socket

from celery_keyed.engine import create_ledger_engine, tcp_keepalive_args
from celery_keyed.settings import read_settings


def test_a_ledger_connection_socket_has_keepalives_and_a_user_timeout(database_url: str) -> None:
    settings = read_settings({"keyed_database_url": database_url, "keyed_lease": 60})
    wanted = tcp_keepalive_args(settings)
    engine = create_ledger_engine(settings)
    try:
        with engine.connect() as conn:
            raw = conn.connection.driver_connection
            assert raw is not None
            sock = socket.socket(fileno=raw.pgconn.socket)  # a second object for the same descriptor
            try:
                if sock.family == socket.AF_UNIX:  # keepalives are TCP's: nothing to check on a Unix socket
                    return
                assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == wanted["keepalives_idle"]
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == wanted["keepalives_interval"]
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == wanted["keepalives_count"]
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == wanted["tcp_user_timeout"]
            finally:
                sock.detach()  # the descriptor stays libpq's
    finally:
        engine.dispose()
