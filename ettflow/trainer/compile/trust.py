"""Whether a compile-cache path may be loaded from: only what this user owns and nobody else can write.

Inductor's caches (the FX-graph and AOTAutograd entries, the mega-cache artifacts) are
unpickled when torch compiles, so whoever can write the archive, its manifest or the folders
they live in can run code in the trainer. The cache is therefore restored only from paths
owned by the current user and not writable by group or others; folders the cache creates are
made 0o700.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

PRIVATE_DIR_MODE = 0o700


def untrusted_reason(path: Path) -> str | None:
    """Why `path` (a folder or file, symlinks followed) must not be loaded from, or None when it
    is owned by this user and not writable by group or others. Raises OSError if it cannot be
    read (missing, no permission)."""
    st = path.stat()
    uid = os.getuid()
    if st.st_uid != uid:
        return (f"compile cache {path} is owned by uid {st.st_uid}, not by this user (uid {uid}): not "
                f"loaded; use a folder of your own, or take it over with chown {uid} {path}")
    mode = stat.S_IMODE(st.st_mode)
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"compile cache {path} is writable by others (mode {mode:#o}): not loaded; "
                f"fix with chmod go-w {path}")
    return None


def first_untrusted(*paths: Path) -> str | None:
    """The reason the first untrusted path among `paths` is refused (None if all are trusted).
    A path that cannot be read is refused too, with the error."""
    for path in paths:
        try:
            reason = untrusted_reason(path)
        except OSError as e:
            return f"compile cache {path} cannot be checked ({type(e).__name__}: {e}): not loaded"
        if reason is not None:
            return reason
    return None


def make_private_dir(path: Path) -> Path:
    """Create `path` (and missing parents) with mode 0o700 for the folders created; an existing
    folder is left as it is (the restore checks it)."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=PRIVATE_DIR_MODE)
        except FileExistsError:  # another rank made it meanwhile
            continue
    return path
