"""Certificates for the lab and the tests: a CA and a server certificate it signs, made with openssl.

The intake (and gpufleet's API) serve HTTPS only; the lab gives them a certificate for
``localhost`` and ``127.0.0.1`` from a CA of its own, which the detectors are told to trust.
A lab's home lives for as long as its user keeps it: its certificates are valid ten years, and a
CA that expires within a day (a home made when they were shorter) is made again, with a new key.
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


# How long the lab's certificates are valid (a lab's, never a cluster's: nothing rotates them).
LAB_DAYS = 3650
# A CA that expires within this many seconds is made again before it signs anything.
RENEW_WITHIN_SECONDS = 24 * 60 * 60


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


def expires_within(cert: Path, seconds: int) -> bool:
    """Whether the certificate in ``cert`` (PEM) has expired, or will within ``seconds``
    (``openssl x509 -checkend``).

    Raises:
        RuntimeError: openssl is missing, or cannot read the file as a certificate (its message).
    """
    done = subprocess.run(
        ["openssl", "x509", "-noout", "-in", str(cert), "-checkend", str(seconds)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    if done.returncode not in (0, 1) or "Certificate" not in done.stdout:
        raise RuntimeError(f"openssl x509 -checkend cannot read {cert}: {(done.stderr or done.stdout).strip()[-500:]}")
    return done.returncode == 1


def make_server_certificate(
    folder: Path,
    *,
    hosts: tuple[str, ...] = ("localhost",),
    addresses: tuple[str, ...] = ("127.0.0.1",),
    days: int = LAB_DAYS,
    name: str = "server",
) -> ServerCertificate:
    """A CA (``ca.crt``, ``ca.key``) and a certificate it signed (``NAME.crt``, ``NAME.key``) for
    ``hosts`` and ``addresses``, in ``folder``, each valid ``days``; the CA is made once and
    reused for later names, and made again (a new key) once it expires within a day.

    Raises:
        RuntimeError: openssl is missing or failed (its message).
    """
    folder.mkdir(parents=True, exist_ok=True)
    ca, ca_key = folder / "ca.crt", folder / "ca.key"
    if not ca.exists() or not ca_key.exists() or expires_within(ca, RENEW_WITHIN_SECONDS):
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
