"""Posting events to the intake (gateway/intake.py) over HTTPS, with the pod's ServiceAccount token."""

from __future__ import annotations

import ssl
from pathlib import Path

import httpx

from models.intake import EVENTS_PATH, UNREADABLE_PREFIX, IntakeEvent
from models.xid import XidEvent

# Longer than the intake takes at worst with its defaults (a TokenReview and a pod read of 15 s
# each when the API server is slow, then Temporal's start): a post given up early is posted
# again, a copy the incident folds, but it costs the API server another review.
POST_TIMEOUT_SECONDS = 30.0


class PostFailed(Exception):
    """The intake did not take the event: ``status`` 0 when nothing answered; the message says why."""

    def __init__(self, message: str, *, status: int = 0, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after  # seconds, when the intake said (429, 503)

    @property
    def unreadable(self) -> bool:
        """The intake read the post and said this event is not one it can take (400, "not an
        event"): posting it again changes nothing. Any other 400 (a proxy's, say) is kept."""
        return self.status == 400 and f": {UNREADABLE_PREFIX}" in str(self)

    @property
    def refused(self) -> bool:
        """The intake refused this node's token (401, 403): waiting alone will not fix it."""
        return self.status in (401, 403)


class IntakePoster:
    """Posts one event at a time to ``url`` (``https://host:port``).

    The token is read from ``token_file`` at every post: the kubelet rotates a projected token in
    place, and the intake refuses an expired one. ``ca_file`` is the CA that signed the intake's
    certificate (None: the system's CAs).
    """

    def __init__(self, url: str, *, token_file: Path, ca_file: Path | None, timeout: float = POST_TIMEOUT_SECONDS):
        self.url = url.rstrip("/") + EVENTS_PATH
        self.token_file = token_file
        self.ca_file = ca_file
        self._timeout = timeout
        self._client: httpx.AsyncClient | None = None

    def _tls(self) -> ssl.SSLContext:
        try:
            return ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)
        except (OSError, ssl.SSLError) as exc:
            raise PostFailed(
                f"GPUFLEET_INTAKE_CA_FILE={self.ca_file}: not a readable PEM CA certificate ({exc}); mount the CA "
                "that signed the intake's certificate"
            ) from None

    def _token(self) -> str:
        try:
            token = self.token_file.read_text().strip()
        except OSError as exc:
            raise PostFailed(
                f"cannot read the token file {self.token_file} ({exc.strerror or exc}): mount the pod's projected "
                "ServiceAccount token (audience gpufleet) there, or set GPUFLEET_INTAKE_TOKEN_FILE"
            ) from None
        if not token:
            raise PostFailed(f"the token file {self.token_file} is empty")
        return token

    async def post(self, event: XidEvent, *, cluster: str, dry_run: bool) -> str:
        """The incident the intake opened or joined with ``event``.

        Raises:
            PostFailed: nothing answered, or the intake answered anything but 202.
        """
        token = self._token()
        if self._client is None:
            self._client = httpx.AsyncClient(verify=self._tls(), timeout=self._timeout)
        body = IntakeEvent(cluster=cluster, dry_run=dry_run, event=event).model_dump(mode="json")
        try:
            answer = await self._client.post(self.url, json=body, headers={"Authorization": f"Bearer {token}"})
        except httpx.HTTPError as exc:
            raise PostFailed(f"the intake at {self.url} did not answer ({type(exc).__name__}: {exc})") from None
        if answer.status_code == 202:
            try:
                return str(answer.json()["incident"])
            except (ValueError, KeyError, TypeError):
                return "?"  # taken all the same: the intake answers 202 only once Temporal has it
        try:
            said = str(answer.json().get("error", answer.text))
        except (ValueError, AttributeError):
            said = answer.text[:200]
        raise PostFailed(
            f"the intake answered {answer.status_code}: {said}",
            status=answer.status_code,
            retry_after=_seconds(answer.headers.get("Retry-After")),
        )

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def _seconds(value: str | None) -> float | None:
    """A Retry-After given in seconds (an HTTP date is not used by the intake: None)."""
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and 0 <= seconds < 3600 else None
