"""AWS Signature Version 4 for a bodiless S3 request (a GET), signed in its headers.

Why our own: the ranged reads of a pull (s3ranges.py) receive straight into the caller's
buffer over a plain http.client connection, and a GET needs only this much of SigV4. The
payload is declared ``UNSIGNED-PAYLOAD`` (there is none), as botocore does for S3 GETs.
Specification: AWS's "Signature Version 4 signing process" (canonical request, string to
sign, derived key); checked against botocore's signer in tests/test_s3ranges.py.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
from dataclasses import dataclass
from urllib.parse import quote

UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"
_ALGORITHM = "AWS4-HMAC-SHA256"


@dataclass(frozen=True)
class Credentials:
    access_key: str
    secret_key: str
    token: str | None = None


def canonical_path(path: str) -> str:
    """``path`` URI-encoded as S3 signs and expects it (RFC 3986 unreserved kept, '/' kept;
    S3 does not encode twice)."""
    return quote(path, safe="/~")


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def _signing_key(secret: str, date: str, region: str) -> bytes:
    key = _hmac(("AWS4" + secret).encode(), date)
    for part in (region, "s3", "aws4_request"):
        key = _hmac(key, part)
    return key


def sign(
    method: str,
    host: str,
    path: str,
    headers: dict[str, str],
    creds: Credentials,
    region: str,
    now: datetime.datetime | None = None,
) -> dict[str, str]:
    """The request's headers with ``host``, ``x-amz-date``, ``x-amz-content-sha256``, the
    session token if any, and ``authorization`` added. ``path``: already encoded
    (canonical_path); no query string."""
    now = now or datetime.datetime.now(datetime.UTC)
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    signed = {k.lower(): " ".join(v.split()) for k, v in headers.items()}
    signed.update({"host": host, "x-amz-date": stamp, "x-amz-content-sha256": UNSIGNED_PAYLOAD})
    if creds.token:
        signed["x-amz-security-token"] = creds.token
    names = sorted(signed)
    canonical = "\n".join(
        [
            method,
            path,
            "",  # no query string
            "".join(f"{name}:{signed[name]}\n" for name in names),
            ";".join(names),
            UNSIGNED_PAYLOAD,
        ]
    )
    scope = f"{stamp[:8]}/{region}/s3/aws4_request"
    to_sign = "\n".join([_ALGORITHM, stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    signature = hmac.new(
        _signing_key(creds.secret_key, stamp[:8], region), to_sign.encode(), hashlib.sha256
    ).hexdigest()
    signed["authorization"] = (
        f"{_ALGORITHM} Credential={creds.access_key}/{scope}, "
        f"SignedHeaders={';'.join(names)}, Signature={signature}"
    )
    return signed
