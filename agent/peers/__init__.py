"""Agents sending each other chunks: the wire, serving and fetching chunks, fan-out groups
that read a step from the store once, and first-contact probes of a source's rate."""
