"""The RPC routes, one module per resource; agent/rpc.py puts them together
(docs/openapi.yaml is their contract)."""
