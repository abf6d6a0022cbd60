"""Certificates for the TLS tests, made with the ``openssl`` CLI (the ``cryptography``
package is not a dependency): a CA, leaf certificates it signs for 127.0.0.1 (an IP SAN;
server and client use alike, as an agent's certificate serves both), and a second CA whose
leaves every agent here must refuse."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

_LEAF_EXTENSIONS = """\
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth, clientAuth
subjectAltName = IP:127.0.0.1
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid, issuer
"""


@dataclass(frozen=True)
class Leaf:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Authority:
    """A CA on disk (``pem``, its key beside it) that signs leaves into ``root``."""

    name: str
    root: Path
    pem: Path
    key: Path

    def leaf(self, name: str, serial: int) -> Leaf:
        key, csr, cert = (self.root / f"{name}.{ext}" for ext in ("key", "csr", "crt"))
        ext = self.root / f"{name}.ext"
        ext.write_text(_LEAF_EXTENSIONS)
        _openssl(
            "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-keyout", key, "-out", csr, "-subj", f"/CN={name}",
        )  # fmt: skip
        _openssl(
            "x509", "-req", "-in", csr, "-CA", self.pem, "-CAkey", self.key,
            "-set_serial", str(serial), "-days", "2", "-sha256", "-extfile", ext, "-out", cert,
        )  # fmt: skip
        return Leaf(cert, key)


def authority(root: Path, name: str) -> Authority:
    root.mkdir(parents=True, exist_ok=True)
    pem, key = root / f"{name}.pem", root / f"{name}.key"
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", key, "-out", pem, "-days", "2", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    return Authority(name, root, pem, key)


def _openssl(*args: object) -> None:
    if shutil.which("openssl") is None:
        pytest.fail("the TLS tests need the openssl CLI (apt-get install openssl)")
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)
