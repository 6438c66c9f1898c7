"""The etcd v3 API's gRPC server, on the node's event loop: `kv serve --grpc HOST:PORT`.
Services KV, Watch, Lease, Cluster, Maintenance and Auth (which says authentication is by
token), over ledgerkv's own HTTP/2 and gRPC framing (v3api/http2.py, v3api/rpc.py)."""

from __future__ import annotations

from .access import Access, CallCounts
from .cluster_service import AuthService, ClusterService, MaintenanceService
from .kv_service import KVService
from .lease_service import LeaseService
from .proto import rpc_pb2
from .rpc import RpcServer, methods_of
from .watch_service import WatchService


async def serve_grpc(node, host: str, port: int, *, grants=None, tls: tuple[str, str] | None = None, counts: CallCounts | None = None) -> RpcServer:
    """Start serving the etcd API for node on host:port; stop it with `await server.stop(grace)`.
    `tls`: (certificate file, key file), the node's --tls-cert and --tls-key: then the port
    speaks TLS, as the HTTP one does (etcd's clients send credentials only over TLS)."""
    access = Access(grants, "grpc", counts)
    cluster = ClusterService(node, access, node.config.grpc_url)  # (host and port are config.grpc's)
    servicers = {
        "KV": KVService(node, access),
        "Watch": WatchService(node, access),
        "Lease": LeaseService(node, access),
        "Cluster": cluster,
        "Maintenance": MaintenanceService(node, access),
        "Auth": AuthService(node, access),
    }
    server = await RpcServer(methods_of(rpc_pb2.DESCRIPTOR, servicers, rpc_pb2), node.config.http_unread_bytes).start(host, port, tls)
    server.keep_running(cluster.learn_urls())
    return server
