"""Serving over gRPC: the server, the engine worker thread, Prometheus metrics, the client library and the protos."""
