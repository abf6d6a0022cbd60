"""The on-store format: names, key layout, manifests and chunk ids. Pure: no I/O.

docs/FORMAT.md is the human-readable specification of what this package implements.
"""
