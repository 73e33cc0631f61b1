"""Certificates for the lab and the tests: a CA and a server certificate it signs, made with openssl.

The intake (and gpufleet's API) serve HTTPS only; the lab gives them a certificate for
``localhost`` and ``127.0.0.1`` from a CA of its own, which the detectors are told to trust.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

_SERVER_EXTENSIONS = """\
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid, issuer
subjectAltName = {names}
"""


@dataclass(frozen=True)
class ServerCertificate:
    """The PEM files: the CA's certificate (to trust), and the server's certificate and key."""

    ca: Path
    cert: Path
    key: Path


def _openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, check=False, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {done.stderr.strip()[-500:]}")


def make_server_certificate(
    folder: Path,
    *,
    hosts: tuple[str, ...] = ("localhost",),
    addresses: tuple[str, ...] = ("127.0.0.1",),
    days: int = 7,
    name: str = "server",
) -> ServerCertificate:
    """A CA (``ca.crt``, ``ca.key``) and a certificate it signed (``NAME.crt``, ``NAME.key``) for
    ``hosts`` and ``addresses``, in ``folder``; the CA is made once and reused for later names.

    Raises:
        RuntimeError: openssl is missing or failed (its message).
    """
    folder.mkdir(parents=True, exist_ok=True)
    ca, ca_key = folder / "ca.crt", folder / "ca.key"
    if not ca.exists():
        _openssl(
            "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", str(ca_key), "-out", str(ca), "-days", str(days), "-subj", "/CN=gpufleet lab CA",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
            "-addext", "subjectKeyIdentifier=hash",
            cwd=folder,
        )  # fmt: skip
    cert, key, request = folder / f"{name}.crt", folder / f"{name}.key", folder / f"{name}.csr"
    names = ", ".join([*(f"DNS:{h}" for h in hosts), *(f"IP:{a}" for a in addresses)])
    extensions = folder / f"{name}.ext"
    extensions.write_text(_SERVER_EXTENSIONS.format(names=names))
    _openssl(
        "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", str(key), "-out", str(request), "-subj", f"/CN={(hosts or addresses)[0]}",
        cwd=folder,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", str(request), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
        "-out", str(cert), "-days", str(days), "-extfile", str(extensions),
        cwd=folder,
    )  # fmt: skip
    request.unlink(missing_ok=True)
    return ServerCertificate(ca=ca, cert=cert, key=key)
