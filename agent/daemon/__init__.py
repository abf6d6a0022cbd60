"""``ferry agent``: its configuration (every key declared once), its log, and the process
that serves the RPC until SIGTERM."""
