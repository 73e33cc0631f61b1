"""Settings from the environment (GPUFLEET_*): every number finite and within its bounds, and a
wrong one named by its variable in one line."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from models.settings import Settings, settings_error

# Every number the environment sets.
FLOATS = [name for name, field in Settings.model_fields.items() if field.annotation is float]
INTS = [name for name, field in Settings.model_fields.items() if field.annotation is int]


def refused(monkeypatch: pytest.MonkeyPatch, variable: str, value: str) -> str:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValidationError) as caught:
        Settings()
    message = settings_error(caught.value)
    assert "\n" not in message
    return message


# A number added to the settings is checked by being counted here.
assert "slurm_timeout_seconds" in FLOATS and "grace_seconds" in FLOATS and "metrics_port" in INTS
assert len(FLOATS) == 10 and len(INTS) == 2, (FLOATS, INTS)


@pytest.mark.parametrize("name", FLOATS)
@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "infinity"])
def test_no_duration_from_the_environment_is_nan_or_infinite(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    variable = f"GPUFLEET_{name.upper()}"
    assert f"{variable}: Input should be a finite number" in refused(monkeypatch, variable, value)


@pytest.mark.parametrize("name", FLOATS + INTS)
@pytest.mark.parametrize("value", ["-1", "1e30", "soon", ""])
def test_no_number_from_the_environment_is_negative_absurd_or_a_word(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    if name == "metrics_port" and value == "":
        pytest.skip("an empty GPUFLEET_METRICS_PORT turns the endpoint off (documented)")
    variable = f"GPUFLEET_{name.upper()}"
    assert f"{variable}: " in refused(monkeypatch, variable, value)


@pytest.mark.parametrize("value", ["0", "-5", "1e9", "nan", "inf"])
def test_the_slurm_timeout_is_a_positive_bounded_number(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    assert "GPUFLEET_SLURM_TIMEOUT_SECONDS: " in refused(monkeypatch, "GPUFLEET_SLURM_TIMEOUT_SECONDS", value)
    monkeypatch.setenv("GPUFLEET_SLURM_TIMEOUT_SECONDS", "12.5")  # a number within bounds still reads
    assert Settings().slurm_timeout_seconds == 12.5


def test_the_kubernetes_timeout_is_a_positive_bounded_number(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUFLEET_KUBE_TIMEOUT_SECONDS", raising=False)
    assert Settings().kube_timeout_seconds == 15
    for value in ("0", "-5", "1e9", "nan"):
        assert "GPUFLEET_KUBE_TIMEOUT_SECONDS: " in refused(monkeypatch, "GPUFLEET_KUBE_TIMEOUT_SECONDS", value)
    monkeypatch.setenv("GPUFLEET_KUBE_TIMEOUT_SECONDS", "2.5")
    assert Settings().kube_timeout_seconds == 2.5
