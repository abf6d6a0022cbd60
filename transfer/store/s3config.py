"""What every transport of the S3 client is made from: the settings, the region requests
are signed for, and the proxy the environment names for an endpoint. Its own module so
that the client (s3client.py) and its transports (s3objects.py, s3ranges.py) import it and
not each other."""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import urlsplit

from transfer.options import StoreSettings


@dataclass(frozen=True)
class S3Settings:
    """What each transport of a client is made from (credentials: None takes the
    standard AWS chain)."""

    bucket: str
    endpoint_url: str | None = None
    key: str | None = None
    secret: str | None = None
    pool_size: int = 32
    connect_timeout: float = StoreSettings.connect_timeout_seconds
    # no byte for this long on a connection: give up on it and retry
    read_timeout: float = StoreSettings.read_timeout_seconds


def region_of(endpoint_url: str | None) -> str:
    """The region requests are signed for: the environment's, else (AWS itself) the
    configured profile's; a custom endpoint accepts any."""
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region or endpoint_url:
        return region or "us-east-1"
    import botocore.session  # the region of the configured profile

    return botocore.session.get_session().get_config_variable("region") or "us-east-1"


def proxy_for(url: str) -> str | None:
    """The HTTP proxy the environment names for requests to ``url`` (``HTTPS_PROXY`` for an
    https URL, ``HTTP_PROXY`` for an http one, else ``ALL_PROXY``, either case), None where
    there is none or ``NO_PROXY`` exempts the host: the rules botocore and obstore
    (reqwest) both apply."""
    import urllib.request  # here, not at start-up: it imports email, http.client, ...

    proxies = urllib.request.getproxies_environment()
    parts = urlsplit(url)
    proxy = proxies.get(parts.scheme) or proxies.get("all")
    if not proxy or not parts.hostname:
        return None
    if urllib.request.proxy_bypass(parts.netloc):  # NO_PROXY (the environment, on POSIX)
        return None
    return proxy
