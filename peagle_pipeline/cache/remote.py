"""An object store (fsspec URL: `s3://bucket/prefix`, `memory://...`) as the place a cache is written to.

The writer keeps its local code path in a staging directory and this module mirrors it, with the on-disk
guarantees: after each local commit the newly committed shard files go up as whole objects (an object store
never shows half an object), then the tables, then `manifest.json`, LAST, so the store's manifest never names an
object that is not fully there. Resuming throws the staging copy of the store away and downloads the store
(whatever its manifest says is the truth) from the object store. A writer claims its rank with a lock object
created by a conditional put (`If-None-Match: *`, atomic on S3): a second writer of the rank is refused (`Busy`).
A lock left by a killed writer is taken over only by a writer on the same host that sees the holder's pid dead;
elsewhere the message names the object to delete.

Credentials come from fsspec's usual sources (AWS_* environment variables, ~/.aws, instance roles) and
`AWS_ENDPOINT_URL` / `FSSPEC_S3_*` for another endpoint; nothing here writes them anywhere. Every failure of the
object store becomes `BadInput` with one line (the cause, and that the last commit is intact).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from peagle_pipeline.cache import layout
from peagle_pipeline.cache.layout import CacheMeta
from peagle_pipeline.cache.location import check_meta
from peagle_pipeline.errors import BadInput, Busy, IncompatibleCache, OutputExists, ResumeMismatch

__all__ = ["is_remote", "describe_error", "RemoteCache", "STAGING_ENV"]

STAGING_ENV = "PEAGLE_STAGING_DIR"  # where staging directories go (default: the system temp directory)


def is_remote(url: str) -> bool:
    """True for an fsspec URL other than a local path (`file://` counts as local)."""
    return "://" in url and not url.startswith("file://")


def describe_error(err: BaseException) -> str:
    """`Type: first line of the message` (200 characters at most) of an object store's error, for one-line errors."""
    text = (str(err).strip().splitlines() or [""])[0][:200]
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


class _AbandonedTasks(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" records (a traceback each).

    When the link drops mid-upload, s3fs's requests fail on fsspec's event loop; botocore retries and then raises
    one error, which `RemoteCache._errors` turns into the one line the user sees, but the failed requests' aiohttp
    tasks are collected along the way, before or after that line, and asyncio would print each of them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "exception was never retrieved" not in record.getMessage()


def _quiet_abandoned_tasks() -> None:
    """Install `_AbandonedTasks` on the asyncio logger once; PEAGLE_DEBUG=1 keeps the records."""
    asyncio_log = logging.getLogger("asyncio")
    if os.environ.get("PEAGLE_DEBUG") != "1" and not any(
        isinstance(f, _AbandonedTasks) for f in asyncio_log.filters
    ):
        asyncio_log.addFilter(_AbandonedTasks())


class RemoteCache:
    """The cache at `url` on an object store, written through the local `staging` directory.

    Raises (from the constructor): BadInput when the URL's scheme has no fsspec driver, the endpoint cannot be
    reached or the bucket does not exist.
    """

    def __init__(self, url: str, staging: str | os.PathLike[str] | None = None) -> None:
        self.url = url.rstrip("/")
        _quiet_abandoned_tasks()
        try:
            import fsspec

            self.fs, self.base = fsspec.core.url_to_fs(self.url)
        except (ImportError, ValueError) as err:
            raise BadInput(f"cannot use {url} as a cache location: {describe_error(err)}") from None
        self.base = self.base.rstrip("/")
        self.fs.invalidate_cache()  # (a cached instance's listings may predate other writers' objects)
        if staging is None:
            parent = Path(os.environ.get(STAGING_ENV) or tempfile.gettempdir())
            digest = hashlib.blake2b(self.url.encode(), digest_size=8).hexdigest()
            staging = parent / f"peagle-staging-{digest}"
        self.staging = Path(staging)
        bucket = self.base.split("/", 1)[0]
        if bucket:  # (bucket-based stores; an unreachable endpoint fails here, before anything is written)
            with self._errors("reach"):
                try:
                    self.fs.info(bucket)
                except FileNotFoundError:
                    raise BadInput(
                        f"cannot write the cache {url}: bucket {bucket!r} does not exist"
                    ) from None
        self._locks: dict[str, str] = {}  # lock key -> the content this process put there

    # ------------------------------------------------------------------------------------------ plumbing
    def key(self, rel: str) -> str:
        return f"{self.base}/{rel}" if rel else self.base

    @contextlib.contextmanager
    def _errors(self, doing: str, after: str = "") -> Iterator[None]:
        """Any failure of the object store (network, credentials, missing bucket) as a one-line BadInput."""
        try:
            yield
        except (BadInput, Busy, OutputExists, ResumeMismatch, IncompatibleCache):
            raise
        except Exception as err:  # s3fs/aiohttp/botocore raise many types
            # The one line below says what happened: asyncio's later complaints about the failed call's other
            # requests (unclosed sessions, abandoned tasks) would only repeat it. Earlier ones: `_AbandonedTasks`.
            logging.getLogger("asyncio").disabled = True
            raise BadInput(f"cannot {doing} {self.url}: {describe_error(err)}{after}") from None

    # ----------------------------------------------------------------------------------------- the root
    def pull_root(self) -> bool:
        """Make staging hold the cache's cache.json, extract.yaml and target/ as the object store has them.

        Returns whether the object store already holds a cache (its cache.json).
        Raises OutputExists when the prefix holds objects but no cache.json.
        """
        self.staging.mkdir(parents=True, exist_ok=True)
        for name in (layout.CACHE_META, layout.EXTRACT_YAML):
            (self.staging / name).unlink(missing_ok=True)
        shutil.rmtree(self.staging / layout.TARGET_DIR, ignore_errors=True)
        with self._errors("read"):
            if not self.fs.exists(self.key(layout.CACHE_META)):
                found = self.fs.find(self.base, maxdepth=None) if self.fs.exists(self.base) else []
                held = [key.removeprefix(self.base + "/") for key in found]
                if not held:
                    return False
                # Another rank may have claimed the prefix between the two reads: cache.json is the first object
                # a writer puts, so a listing that holds it is a cache being started, not a foreign prefix.
                if layout.CACHE_META not in held:
                    raise OutputExists(
                        f"output {self.url} exists and is not a peagle cache (it holds "
                        f"{held[0]!r}, ...); choose an empty or new prefix"
                    )
            for name in (layout.CACHE_META, layout.EXTRACT_YAML):
                if self.fs.exists(self.key(name)):
                    self.fs.get_file(self.key(name), str(self.staging / name))
            if self.fs.exists(self.key(layout.TARGET_DIR)):
                self.fs.get(
                    self.key(layout.TARGET_DIR) + "/",
                    str(self.staging / layout.TARGET_DIR) + "/",
                    recursive=True,
                )
        return True

    def push_root(self, meta: CacheMeta) -> None:
        """Claim cache.json with a conditional put (the first writer's wins; a writer that lost the race, or
        resumes, checks its settings against the one there), then put extract.yaml and target/ when absent.

        Raises: ResumeMismatch, IncompatibleCache (`location.check_meta`)."""
        with self._errors("write"):
            try:
                self.fs.pipe_file(
                    self.key(layout.CACHE_META),
                    (self.staging / layout.CACHE_META).read_bytes(),
                    mode="create",
                )
            except FileExistsError:  # there already (resume), or another rank's first run got there first
                self.fs.get_file(self.key(layout.CACHE_META), str(self.staging / layout.CACHE_META))
                check_meta(self.staging / layout.CACHE_META, meta)
            if not self.fs.exists(self.key(layout.EXTRACT_YAML)):
                self.fs.put_file(str(self.staging / layout.EXTRACT_YAML), self.key(layout.EXTRACT_YAML))
            target = self.staging / layout.TARGET_DIR
            for path in sorted(p for p in target.rglob("*") if p.is_file()):
                rel = f"{layout.TARGET_DIR}/{path.relative_to(target).as_posix()}"
                if not self.fs.exists(self.key(rel)):  # (the same bytes from every rank: the same model)
                    self.fs.put_file(str(path), self.key(rel))

    def remove_root(self) -> None:
        """Remove what `push_root` put (a first run that produced nothing)."""
        with self._errors("clean up"):
            for rel in (layout.CACHE_META, layout.EXTRACT_YAML, layout.TARGET_DIR):
                if self.fs.exists(self.key(rel)):
                    self.fs.rm(self.key(rel), recursive=True)

    # ----------------------------------------------------------------------------------------- a store
    def lock(self, store: str, lock_name: str) -> None:
        """Claim the store's lock object `stores/<lock_name>` (conditional put), or raise Busy."""
        key = self.key(f"{layout.STORES_DIR}/{lock_name}")
        mine = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()})
        with self._errors("lock a store in"):
            for _ in range(2):
                try:
                    self.fs.pipe_file(key, mine.encode(), mode="create")
                    self._locks[key] = mine
                    return
                except FileExistsError:
                    holder = self._holder(key)
                    if not _dead_here(holder):
                        who = f" (pid {holder.get('pid')} on {holder.get('host')})" if holder else ""
                        raise Busy(
                            f"store {store} of {self.url} is already being written by another process{who}; "
                            f"stop it first, or if no writer is running delete the lock object {self.url}/"
                            f"{layout.STORES_DIR}/{lock_name}"
                        ) from None
                    self.fs.rm_file(key)  # its writer died on this host: take it over
            raise Busy(f"store {store} of {self.url}: another process took its lock at the same time")

    def _holder(self, key: str) -> dict[str, Any]:
        try:
            found = json.loads(self.fs.cat_file(key))
        except (OSError, ValueError):
            return {}
        return found if isinstance(found, dict) else {}

    def unlock(self) -> None:
        """Delete the lock objects this process holds (when they are still its own)."""
        for key, mine in list(self._locks.items()):
            with contextlib.suppress(Exception):
                if self.fs.cat_file(key).decode() == mine:
                    self.fs.rm_file(key)
            del self._locks[key]

    def pull_store(self, store: str) -> None:
        """Replace the staging copy of `store` with the object store's (nothing when it has none)."""
        local = self.staging / layout.STORES_DIR / store
        shutil.rmtree(local, ignore_errors=True)
        remote = self.key(f"{layout.STORES_DIR}/{store}")
        with self._errors("read"):
            if self.fs.exists(remote):
                local.mkdir(parents=True, exist_ok=True)
                self.fs.get(remote + "/", str(local) + "/", recursive=True)

    def publish(self, store: str, files: list[str], committed_samples: int) -> None:
        """Upload `files` (paths relative to the staging store, the manifest last) as whole objects, in order:
        everything but the manifest (concurrently), then the manifest alone."""
        local = self.staging / layout.STORES_DIR / store
        remote = self.key(f"{layout.STORES_DIR}/{store}")
        body = [f for f in files if f != layout.MANIFEST]
        after = (
            f"; the object store keeps its last commit, re-run the same command to resume "
            f"(this run had committed {committed_samples} samples locally)"
        )
        with self._errors("upload to", after):
            if body:
                self.fs.put([str(local / f) for f in body], [f"{remote}/{f}" for f in body])
            if layout.MANIFEST in files:
                self.fs.put_file(str(local / layout.MANIFEST), f"{remote}/{layout.MANIFEST}")


def _dead_here(holder: dict[str, Any]) -> bool:
    """The lock's holder ran on this host and its process is gone."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
