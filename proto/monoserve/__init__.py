"""monoserve's public gRPC API (protocol buffers). Versions live in subpackages: `monoserve.v1`."""
