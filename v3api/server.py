"""The etcd v3 API's gRPC server (grpc.aio, on the node's event loop): `kv serve --grpc
HOST:PORT`. Services KV, Watch, Lease, Cluster, Maintenance and Auth (which says
authentication is by token)."""

from __future__ import annotations

import grpc

from .access import Access, CallCounts
from .cluster_service import AuthService, ClusterService, MaintenanceService
from .kv_service import KVService
from .lease_service import LeaseService
from .proto import rpc_pb2_grpc
from .watch_service import WatchService

# etcdctl and the Go client ping every few seconds on an idle connection; the C core's
# default answers pings more often than every 5 minutes with GOAWAY ("too_many_pings").
_OPTIONS = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.max_receive_message_length", 2 * 1024 * 1024 + 64 * 1024),  # etcd's 1.5 MiB request limit and some room
    ("grpc.max_send_message_length", (1 << 31) - 1),
    ("grpc.so_reuseport", 0),
]


async def serve_grpc(node, host: str, port: int, *, grants=None, tls: tuple[str, str] | None = None, counts: CallCounts | None = None) -> grpc.aio.Server:
    """Start serving the etcd API for node on host:port; stop it with `await server.stop(grace)`.
    `tls`: (certificate file, key file), the node's --tls-cert and --tls-key: then the port
    speaks TLS, as the HTTP one does (etcd's clients send credentials only over TLS)."""
    server = grpc.aio.server(options=_OPTIONS)
    access = Access(grants, "grpc", counts)
    scheme = "https" if tls else "http"
    rpc_pb2_grpc.add_KVServicer_to_server(KVService(node, access), server)
    rpc_pb2_grpc.add_WatchServicer_to_server(WatchService(node, access), server)
    rpc_pb2_grpc.add_LeaseServicer_to_server(LeaseService(node, access), server)
    rpc_pb2_grpc.add_ClusterServicer_to_server(ClusterService(node, access, f"{scheme}://{host}:{port}"), server)
    rpc_pb2_grpc.add_MaintenanceServicer_to_server(MaintenanceService(node, access), server)
    rpc_pb2_grpc.add_AuthServicer_to_server(AuthService(node, access), server)
    if tls:
        with open(tls[0], "rb") as c, open(tls[1], "rb") as k:
            bound = server.add_secure_port(f"{host}:{port}", grpc.ssl_server_credentials([(k.read(), c.read())]))
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port} for the etcd API")
    await server.start()
    return server
