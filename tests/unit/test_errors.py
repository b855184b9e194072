"""OS errors about a path become the user-facing error classes (and their exit codes) in one place."""

from __future__ import annotations

import errno

import pytest

from peagle_pipeline.errors import BadInput, OutOfSpace, from_os_error


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EFBIG, errno.EDQUOT])
def test_disk_full_in_every_form_is_out_of_space(code):
    err = from_os_error(OSError(code, "x", "/run/checkpoints/step-1"))
    assert isinstance(err, OutOfSpace) and err.exit_code == 9
    assert "no space left while writing /run/checkpoints/step-1" in str(err)


def test_read_only_and_denied_and_bad_paths_are_bad_input():
    ro = from_os_error(OSError(errno.EROFS, "Read-only file system", "/ro/plots"))
    assert isinstance(ro, BadInput) and str(ro) == "cannot write to /ro/plots: read-only file system"
    denied = from_os_error(OSError(errno.EACCES, "Permission denied", "/x"))
    assert isinstance(denied, BadInput) and "permission denied: /x" in str(denied)
    notdir = from_os_error(NotADirectoryError(errno.ENOTDIR, "Not a directory", "/f/cache.json"))
    assert isinstance(notdir, BadInput) and "not a directory" in str(notdir)


def test_other_os_errors_stay_bugs():
    assert from_os_error(OSError(errno.EIO, "I/O error")) is None
