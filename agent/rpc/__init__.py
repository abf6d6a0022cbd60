"""The agent's RPC: the aiohttp app, its routes and middleware, auth and TLS, bounds, metrics,
the one owner of background services, and the client."""
