"""An object store that drops its link mid-upload leaves failed aiohttp tasks behind; asyncio reports each one as
"Task exception was never retrieved" with a traceback when it is collected, sometimes before the run's one error
line. `RemoteCache` keeps those records out of the terminal (PEAGLE_DEBUG=1 keeps them)."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

from peagle_pipeline.cache import remote


@pytest.fixture
def asyncio_records():
    """The asyncio logger's records that pass its filters, from none (a store opened in this process by an earlier
    test has installed ours); the filters are restored afterwards."""
    log = logging.getLogger("asyncio")
    saved_filters, saved_disabled = list(log.filters), log.disabled
    log.filters[:] = []
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    handler = Keep()
    log.addHandler(handler)
    log.disabled = False
    yield seen
    log.removeHandler(handler)
    log.filters[:] = saved_filters
    log.disabled = saved_disabled


def _abandon_a_failed_task() -> None:
    """A task that fails and is never awaited, collected: asyncio logs "Task exception was never retrieved"."""

    async def upload() -> None:
        raise ConnectionResetError("Cannot write to closing transport")

    loop = asyncio.new_event_loop()
    try:
        task = loop.create_task(upload())
        loop.run_until_complete(asyncio.sleep(0.01))
        assert task.done()
        del task
        gc.collect()
    finally:
        loop.close()


def test_abandoned_task_reports_are_kept_out(asyncio_records, monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("PEAGLE_DEBUG", raising=False)
    _abandon_a_failed_task()  # without the filter the record is there: the test can fail
    assert any("never retrieved" in r.getMessage() for r in asyncio_records)
    asyncio_records.clear()
    remote.RemoteCache("memory://quiet/cache", staging=tmp_path / "staging")  # opening a store quiets them
    _abandon_a_failed_task()
    assert not any("never retrieved" in r.getMessage() for r in asyncio_records)
    logging.getLogger("asyncio").error("another asyncio error")  # only those reports are dropped
    assert [r.getMessage() for r in asyncio_records] == ["another asyncio error"]


def test_peagle_debug_keeps_them(asyncio_records, monkeypatch) -> None:
    monkeypatch.setenv("PEAGLE_DEBUG", "1")
    remote._quiet_abandoned_tasks()
    _abandon_a_failed_task()
    assert any("never retrieved" in r.getMessage() for r in asyncio_records)
