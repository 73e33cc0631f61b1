"""The detector's inbox: events other processes on the node drop there reach the spool, in order;
what is no event the inbox takes is set aside; a crash between the spool and the removal repeats
an event once, the same event (the incident folds it), and loses none."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from detector.daemon import Delivery, Detector
from detector.inbox import MAX_EVENT_BYTES, InboxItem, InboxSource, write_event
from detector.spool import Spool
from models.policy import Policy
from tests.conftest import gpufleet_cli


def event(
    node: str = "gpu1", message: str = "prolog: gpu_count: NVML sees 1 GPU(s), the node should have 2"
) -> dict[str, Any]:
    return {
        "node": node,
        "kind": "health_check",
        "xid": None,
        "message": message,
        "source": "health-check",
        "timestamp": "2026-12-06T10:00:00+00:00",
    }


def detector(tmp_path: Path) -> Detector:
    delivery = Delivery(cluster="lab", spool=Spool(tmp_path / "spool"))
    return Detector(node="gpu1", policy=Policy(), delivery=delivery, fold_seconds=0, out=lambda _: None)


def test_events_are_taken_in_the_order_they_were_dropped(tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    for n in range(5):
        write_event(inbox, event(message=f"check {n}"))
    source = InboxSource(inbox, node="gpu1")
    items = source.take()
    assert [item.event.message for item in items] == [f"check {n}" for n in range(5)]
    assert source.take() == []  # handed over once, not again while the main loop holds them


def test_what_is_no_event_for_this_node_is_set_aside(tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "01-bad.json").write_text("{not json")
    (inbox / "02-other.json").write_text(json.dumps(event(node="gpu2")))
    (inbox / "03-xid.json").write_text(json.dumps({**event(), "kind": "xid", "xid": 79}))
    (inbox / "04-partial.json.tmp").write_text("{")  # a writer that never finished: not read
    write_event(inbox, event())
    source = InboxSource(inbox, node="gpu1")
    [item] = source.take()
    assert item.event.node == "gpu1"
    assert sorted(p.name for p in inbox.iterdir() if p.name.endswith(".rejected")) == [
        "01-bad.json.rejected",
        "02-other.json.rejected",
        "03-xid.json.rejected",
    ]
    assert source.rejected == 3


def test_an_event_is_spooled_before_its_file_goes(tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    write_event(inbox, event())
    found = detector(tmp_path)
    [item] = InboxSource(inbox, node="gpu1").take()
    found._take(item, "inbox")
    [(_, spooled)] = found.delivery.spool.pending()  # type: ignore[union-attr]
    assert spooled == item.event and spooled.source == "health-check"
    assert list(inbox.glob("*.json")) == []


def test_a_crash_before_the_removal_repeats_the_same_event_once(tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    write_event(inbox, event())
    [item] = InboxSource(inbox, node="gpu1").take()
    detector(tmp_path).consider(item.event)  # spooled, then the process dies before item.done()
    [again] = InboxSource(inbox, node="gpu1").take()  # the restarted detector
    restarted = detector(tmp_path)
    restarted._take(again, "inbox")
    events = [e for _, e in restarted.delivery.spool.pending()]  # type: ignore[union-attr]
    assert events == [item.event, item.event]  # the same event, timestamp included: the incident folds it
    assert list(inbox.glob("*.json")) == []
    assert isinstance(again, InboxItem)


def test_the_daemon_spools_what_the_inbox_holds(tmp_path: Path) -> None:
    """`gpufleet detect` reads --inbox beside the kernel log; with Temporal away the event stays spooled."""
    inbox = tmp_path / "inbox"
    write_event(inbox, event())
    kmsg = tmp_path / "kern.log"
    kmsg.write_text("")
    env = {"GPUFLEET_HOME": str(tmp_path / "home"), "TEMPORAL_ADDRESS": "127.0.0.1:1"}
    done = gpufleet_cli(
        "detect",
        "--kmsg",
        str(kmsg),
        "--node",
        "gpu1",
        "--cluster",
        "lab",
        "--once",
        "--json",
        "--inbox",
        str(inbox),
        env=env,
        unset=("GPUFLEET_INTAKE_URL",),
    )
    assert done.returncode == 1 and "1 event(s) still spooled" in done.stderr, done.stderr
    [printed] = [json.loads(line) for line in done.stdout.splitlines()]
    assert (printed["kind"], printed["source"], printed["action"]) == (
        "health_check",
        "health-check",
        "DRAIN_AFTER_JOBS",
    )
    assert list(inbox.glob("*.json")) == []
    assert len(os.listdir(tmp_path / "home" / "spool" / "gpu1")) == 1


def test_a_fifo_a_link_a_folder_or_a_huge_file_neither_blocks_nor_crashes_the_inbox(tmp_path: Path) -> None:
    """Whoever can write the inbox cannot stop the detector: what is no small regular file is set
    aside unread, and the event behind it is still taken."""
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    os.mkfifo(inbox / "01-fifo.json")  # read as a file, it would wait for a writer forever
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps(event(message="not dropped here")))
    (inbox / "02-link.json").symlink_to(elsewhere)
    (inbox / "03-folder.json").mkdir()  # read as a file: IsADirectoryError, which ended the source
    (inbox / "04-huge.json").write_bytes(b" " * (MAX_EVENT_BYTES + 1))
    write_event(inbox, event())
    source = InboxSource(inbox, node="gpu1")
    taken: list[list[InboxItem]] = []
    reader = threading.Thread(target=lambda: taken.append(source.take()), daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "the inbox blocked on a file"
    [[item]] = taken
    assert item.event.message.startswith("prolog: gpu_count")
    assert sorted(p.name for p in inbox.iterdir() if p.name.endswith(".rejected")) == [
        "01-fifo.json.rejected",
        "02-link.json.rejected",
        "03-folder.json.rejected",
        "04-huge.json.rejected",
    ]
    assert source.rejected == 4 and elsewhere.exists()
