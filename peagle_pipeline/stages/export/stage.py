"""`peagle-pipeline export`: write a trained draft in the speculators P-EAGLE format that vLLM loads (docs/reference/checkpoint-format.md).

Output directory: `config.json` + `model.safetensors` (`stages.export.speculators_format`) + `.peagle-export.json`
(the run and checkpoint it came from, `stages.export.marker`), written into a temporary sibling directory and
swapped into place, so a reader sees a whole export or none; an export of a run then gets its model card
`README.md` beside them (`stages.export.card`). A folder is replaced only when it holds exactly those files from
the same run (another run's export: only with `force`); files we did not write are never deleted. The facts the
export needs beyond the weights come from `RUN/draft.json` (`stages.draft_spec.DraftSpec`), written by the
trainer at the start of a run. Never trains; of the cache it reads only the records the card quotes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from peagle_pipeline.errors import BadInput, Busy, OutputExists
from peagle_pipeline.runtime import (
    RankLock,
    exchange_paths,
    fsync_dir,
    fsync_file,
    make_readable,
    pause_for_crash_test,
    raise_if_no_space,
)
from peagle_pipeline.stages.draft_spec import DraftSpec, export_method
from peagle_pipeline.stages.export.card import CARD_FILE, is_generated, write_card
from peagle_pipeline.stages.export.marker import MARKER_FILE, same_run
from peagle_pipeline.stages.export.speculators_format import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    export_config,
    export_weights,
    serving_depths,
)
from peagle_pipeline.stages.run_records import run_identity

log = logging.getLogger(__name__)

__all__ = ["EXPORT_FILES", "check_export_target", "write_export", "export_run"]

# the card only from a run, and only a card an export wrote (`card.is_generated`) counts as part of an export
EXPORT_FILES = frozenset({CONFIG_FILE, WEIGHTS_FILE, MARKER_FILE, CARD_FILE})
SLEEP_ENV = "PEAGLE_TEST_EXPORT_SLEEP"
"""Test hook: seconds to sleep while holding the export lock, before the swap (widens the window two exports share)."""


def check_export_target(
    output: str | os.PathLike[str], source: dict[str, Any] | None, force: bool = False, own: bool = False
) -> None:
    """Refuse an `output` that an export may not replace: nothing there is ever deleted unless it is
    exactly an export (config.json, model.safetensors, the marker) of the same run, or of another run with `force`.

    Args:
        source: `run_identity` of the run being exported (None: unknown).
        own: `output` is the run's own `RUN/export`: an export there without a marker (written before markers
            existed) belongs to the run.

    Raises:
        OutputExists: `output` is a file, holds anything else, is not a draft export, or is another run's
            export (without `force`).
    """
    out = Path(output)
    if not out.exists():
        return
    if not out.is_dir():
        raise OutputExists(f"{out} exists and is not a directory: choose another export directory")
    names = {p.name for p in out.iterdir()}
    foreign = sorted(names - EXPORT_FILES | ({CARD_FILE} & names if not is_generated(out) else set()))
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        hint = "move them out or pass --no-export" if own else "move them out or choose another --output"
        raise OutputExists(f"{out} holds files that are not part of a draft export ({shown}): {hint}")
    if not names:
        return
    try:
        ours = export_method(json.loads((out / CONFIG_FILE).read_text())) is not None
    except (OSError, ValueError, AttributeError):
        ours = False
    if not ours:
        raise OutputExists(
            f"{out} is not a draft export (its {CONFIG_FILE}): choose another export directory"
        )
    try:
        marker = json.loads((out / MARKER_FILE).read_text())
    except FileNotFoundError:
        marker = None
    except (OSError, ValueError):
        marker = {}
    if force or (marker is None and own) or (marker and same_run(marker, source)):
        return
    if marker and marker.get("run"):
        what = f"the export of another run ({marker['run']}, {marker.get('checkpoint')})"
    else:
        what = "a draft export of unknown origin"
    raise OutputExists(f"{out} holds {what}: pass --force to replace it, or choose another --output")


def write_export(
    output: str | os.PathLike[str],
    spec: DraftSpec,
    state: dict[str, torch.Tensor],
    source: dict[str, Any] | None = None,
    force: bool = False,
    own: bool = False,
    speculative_tokens: int | None = None,
) -> Path:
    """Write config.json + model.safetensors + the marker into `output`: built in a temporary sibling folder,
    then swapped in atomically (renameat2 RENAME_EXCHANGE; two renames where the OS lacks it).

    Args:
        source: what the marker records (`run_identity` plus the checkpoint); None for drafts not from a run.
        force, own: see `check_export_target`.
        speculative_tokens: the served K (`serving_depths`); the marker records the trained one.

    Raises:
        BadInput: `speculative_tokens` above the trained depths.
        OutputExists: see `check_export_target`.
        OutOfSpace: the disk filled up (the previous export, if any, is untouched).
        Busy: another export into `output` is running.
    """
    out = Path(output)
    config = export_config(spec, speculative_tokens)  # BadInput before anything is written
    check_export_target(out, source, force=force, own=own)
    weights = export_weights(spec, state)  # NumericalFault before anything is written
    out.parent.mkdir(parents=True, exist_ok=True)
    with _one_export_at_a_time(out):
        check_export_target(out, source, force=force, own=own)  # again, now that no other export can swap
        pause_for_crash_test(SLEEP_ENV)
        return _swap_in(out, spec, weights, config, source)


@contextlib.contextmanager
def _one_export_at_a_time(out: Path) -> Iterator[None]:
    """Hold `.NAME.lock` beside `out` (flock): a second export, checked before the first swapped its folder in,
    would replace it unseen. The file is removed while still held; one that locked it meanwhile finds its inode
    gone from the path and is refused too.

    Raises:
        Busy: another export into `out` is running.
    """
    path = out.with_name(f".{out.name}.lock")
    lock = RankLock(path, f"export {out}", "wait for it, or choose another --output").acquire()
    try:
        try:
            current = os.stat(path).st_ino == os.fstat(lock.fileno()).st_ino
        except FileNotFoundError:
            current = False
        if not current:
            raise Busy(
                f"export {out} is being written by another process; wait for it, or choose another --output"
            )
        yield
    finally:
        path.unlink(missing_ok=True)
        lock.release()


def _swap_in(
    out: Path, spec: DraftSpec, weights: dict[str, torch.Tensor], config: dict[str, Any], source: Any
) -> Path:
    """Write the export into a temporary sibling folder and swap it in for `out` (see `write_export`)."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    swapped = False  # once True, `tmp` holds the previous export, not our fresh folder
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        _write_files(tmp, spec, weights, config, source)
        if out.exists():
            os.chmod(tmp, stat.S_IMODE(out.stat().st_mode))  # keep the folder's permissions
            if not exchange_paths(tmp, out):
                old = out.with_name(f".{out.name}.old-{os.getpid()}")
                os.replace(out, old)
                os.replace(tmp, out)
                os.replace(old, tmp)
            swapped = True
            _remove_export(tmp)  # the previous export, now under the temporary name
        else:
            os.replace(tmp, out)
        fsync_dir(out.parent)
    except OSError as err:
        if swapped:
            _remove_export(tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        raise_if_no_space(err, str(out))
    except BaseException:  # Ctrl-C included: no half-written temp folder is left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_files(
    folder: Path,
    spec: DraftSpec,
    weights: dict[str, torch.Tensor],
    config: dict[str, Any],
    source: dict[str, Any] | None,
) -> None:
    """Write the export's files into the new `folder` and flush them to disk: the `weights` (`export_weights`),
    the `config` (`export_config`) and the marker (`source` plus the target's identity, the trained K, the time)."""
    from peagle_pipeline.stages.checkpoint import save_tensors

    save_tensors(weights, folder / WEIGHTS_FILE, metadata={"format": "pt"})
    make_readable(folder / WEIGHTS_FILE)  # safetensors writes 0600; a vLLM of another user must read it
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    marker = {
        **(source or {}),
        "target": spec.target_identity,
        "trained_depths": spec.depths,
        "time": time.time(),
    }
    (folder / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    for name in (CONFIG_FILE, WEIGHTS_FILE, MARKER_FILE):
        fsync_file(folder / name)
    fsync_dir(folder)


def _remove_export(path: Path) -> None:
    """Delete the files an export consists of, then the folder if that left it empty (never anything else)."""
    for name in EXPORT_FILES:
        (path / name).unlink(missing_ok=True)
    try:
        path.rmdir()
    except OSError:
        log.warning("left %s in place: it holds files that are not part of an export", path)


def export_run(
    run_dir: str | os.PathLike[str],
    output: str | os.PathLike[str],
    checkpoint: str = "best",
    force: bool = False,
    speculative_tokens: int | None = None,
) -> Path:
    """Export checkpoint `best`, `latest` or `step-N` of a training run to `output`, serving
    `serving_depths(trained, speculative_tokens)` tokens (config.json's `speculative_tokens`).

    `output` may be new, empty, or hold an export of the same run (replaced); another run's export is replaced
    only with `force`; a folder holding anything else is refused (see `check_export_target`).

    Raises:
        BadInput: not a run directory, no such complete checkpoint, or `speculative_tokens` above the trained K.
        OutputExists: see `check_export_target`.
    """
    from peagle_pipeline.stages.checkpoint import CheckpointManager
    from peagle_pipeline.stages.run_layout import EXPORT_DIR

    if Path(output).exists() and not Path(output).is_dir():
        raise BadInput(f"--output {output} is a file: give a directory for the export")
    spec = DraftSpec.load(run_dir)
    serving_depths(spec.depths, speculative_tokens)  # refused before the (slow) checkpoint load
    source = run_identity(run_dir)
    own = Path(output).resolve() == Path(run_dir).resolve() / EXPORT_DIR
    check_export_target(output, source, force=force, own=own)  # before the (slow) checkpoint load
    manager = CheckpointManager(run_dir, keep=1)
    ckpt = manager.load(manager.resolve(checkpoint), with_optimizer=False)
    source.update(checkpoint=ckpt.path.name, step=ckpt.step)
    path = write_export(
        output, spec, ckpt.model, source=source, force=force, own=own, speculative_tokens=speculative_tokens
    )
    write_card(path, run_dir)
    return path
