"""monoserve gRPC API, version 1: generated stubs beside their .proto files.

    from monoserve.v1 import inference_pb2, inference_pb2_grpc   # client-facing Inference
    from monoserve.v1 import replica_pb2, replica_pb2_grpc       # router-facing Replica
    from monoserve.v1 import admin_pb2, admin_pb2_grpc           # RouterAdmin
    from monoserve.v1 import common_pb2                          # shared messages

Regenerate after editing a .proto with `python proto/regen.py` (tests check they are fresh).
"""

# Fully qualified service names (for health checks and reflection).
INFERENCE_SERVICE = "monoserve.v1.Inference"
REPLICA_SERVICE = "monoserve.v1.Replica"
ROUTER_ADMIN_SERVICE = "monoserve.v1.RouterAdmin"
