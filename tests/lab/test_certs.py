"""The lab's certificates: long-lived, the CA kept across calls, and made again once it expires
within a day (a home older than its CA), so that TLS to the intake and the API keeps working."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from lab.certs import RENEW_WITHIN_SECONDS, expires_within, make_server_certificate


def verifies(ca: Path, cert: Path) -> bool:
    """Whether ``cert`` checks out against ``ca`` as a TLS client would (signature and dates)."""
    done = subprocess.run(
        ["openssl", "verify", "-CAfile", str(ca), str(cert)], capture_output=True, text=True, check=False
    )
    return done.returncode == 0


def test_a_lab_certificate_lasts_years_and_its_ca_is_kept(tmp_path: Path) -> None:
    intake = make_server_certificate(tmp_path, name="intake")
    ca_before = intake.ca.read_bytes()
    api = make_server_certificate(tmp_path, name="api")
    assert api.ca.read_bytes() == ca_before  # one CA for the lab: the detectors trust it once
    for path in (api.ca, intake.cert, api.cert):
        assert not expires_within(path, 365 * 24 * 60 * 60), path
    assert verifies(api.ca, intake.cert) and verifies(api.ca, api.cert)


def test_a_ca_that_expires_within_a_day_is_made_again(tmp_path: Path) -> None:
    old = make_server_certificate(tmp_path, days=1, name="intake")  # as a home made long ago would hold
    assert expires_within(old.ca, RENEW_WITHIN_SECONDS)
    ca_before, key_before = old.ca.read_bytes(), (tmp_path / "ca.key").read_bytes()
    renewed = make_server_certificate(tmp_path, name="intake")
    assert renewed.ca.read_bytes() != ca_before and (tmp_path / "ca.key").read_bytes() != key_before
    assert not expires_within(renewed.ca, RENEW_WITHIN_SECONDS)
    assert verifies(renewed.ca, renewed.cert)


def test_expires_within_says_what_it_cannot_read(tmp_path: Path) -> None:
    not_a_cert = tmp_path / "ca.crt"
    not_a_cert.write_text("not a certificate\n")
    with pytest.raises(RuntimeError, match=r"cannot read .*ca\.crt"):
        expires_within(not_a_cert, 60)
