"""ckpt-ferry's node-side programs: the CLI now; the daemon and its RPC build on it."""
