"""The router as a Ray actor on the head node, and a small RouterAdmin gRPC client.

The router process serves clients (gRPC `Inference`, optional OpenAI HTTP) and `RouterAdmin`;
the supervisor registers replicas with it over RouterAdmin, exactly as an operator would.
"""

from __future__ import annotations

import grpc
from monoserve.v1 import admin_pb2, admin_pb2_grpc

ROUTER_ACTOR_NAME = "monoserve-router"
# Ray gives the head node this resource; a tiny demand pins the router there (stable address).
HEAD_NODE_RESOURCE = "node:__internal_head__"


class RouterActor:
    """Hosts a `router.server.RouterServer` (its own event-loop thread) in a Ray actor."""

    def __init__(self, host: str, port: int, http_port: int | None, metrics_port: int | None,
                 model: str | None, model_name: str, queue_size: int):
        import ray

        from router.server import RouterServer

        self.server = RouterServer(host=host, port=port, http_port=http_port, metrics_port=metrics_port,
                                   tokenizer=model, model_name=model_name, queue_size=queue_size)
        self.port = self.server.start()
        # a wildcard bind is reached through the node's IP
        self.public_host = ray.util.get_node_ip_address() if host in ("0.0.0.0", "::", "") else host
        self.http_port = getattr(self.server, "http_port", None) or http_port

    def addresses(self) -> dict:
        return {
            "grpc": f"{self.public_host}:{self.port}",
            "http": f"http://{self.public_host}:{self.http_port}" if self.http_port else None,
        }

    def stop(self) -> None:
        self.server.stop()


class RouterAdminClient:
    """Blocking RouterAdmin calls with short deadlines (the supervisor loop must not hang)."""

    def __init__(self, address: str, timeout_s: float = 5.0):
        self.address = address
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(address)
        self._stub = admin_pb2_grpc.RouterAdminStub(self._channel)

    def add(self, replica_address: str) -> None:
        """Register a replica; already registered counts as success."""
        try:
            self._stub.AddReplica(admin_pb2.AddReplicaRequest(address=replica_address), timeout=self.timeout_s)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.ALREADY_EXISTS:
                raise

    def remove(self, replica_address: str, drain: bool) -> int:
        """Deregister a replica; returns requests still running there (0 if it was unknown)."""
        try:
            reply = self._stub.RemoveReplica(
                admin_pb2.RemoveReplicaRequest(address=replica_address, drain=drain), timeout=self.timeout_s)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return 0
            raise
        return reply.running_requests

    def list(self) -> admin_pb2.ListReplicasResponse:
        return self._stub.ListReplicas(admin_pb2.ListReplicasRequest(), timeout=self.timeout_s)

    def close(self) -> None:
        self._channel.close()
