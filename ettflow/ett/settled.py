"""The spool's settled index: the finished runs a refresh's reconciliation no longer reads.

Every refresh reconciles its spool before it claims, on its clock (`tasks.reconcile`). Without
this index it read every run the spool ever held: about 0.2 s per 1,000 finished runs here,
growing with every refresh for as long as the spool is kept. A run is **settled** for a
warehouse when the reconciliation found that warehouse's row right, for a run that ended long
enough ago (`SETTLE_AFTER_S`, and no file of it written for as long); a refresh's
reconciliation then skips it without opening a file of its, so its cost grows with the runs not
yet settled (and the few settled ones it re-checks: `tasks.reconcile.RECHECK_PER_REFRESH`).

Layout: ``<spool>/.settled/<warehouse key>/<run_id>``, an empty file. The key names the
warehouse (`tasks.reconcile` makes it from its URL, password masked), so a spool archived into
another warehouse (a team's new PostgreSQL) still gets every run's row there.

Invariant: whatever may change what a run's row should say removes the run's entries, under
every key (`unsettle`), after it made its change:

- a spool writer of the run opening or closing a file (a flow retry's attempts, an
  orchestrator failure recorded, a late rank); a writer kept open since before the run was
  settled (a rank's) is seen at its close;
- the run's heartbeat starting (a flow retry), seeing a lapse (a process that stood still
  resumes) or recording its end;
- a pending mark or a pending lineage record written for it;
- its row written to a warehouse (a reconciliation that read the spool earlier may write last).

The settler judges the run on its row and then its folder (`fingerprint`), and checks both
again after it wrote the entry (`settle` the folder, `tasks.reconcile` the rows, taking back
every entry of the call if that read fails), taking it back if either changed: a change between
the judgement and the entry is never hidden, because its `unsettle` comes after it. What the
invariant cannot see (a writer killed between a line and its close, a shared file system's
cached attributes) is found by the few settled runs each refresh re-checks. A row deleted from
the warehouse by hand is restored by `ettflow archive --pending`, which reads every run, settled
or not.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

SETTLED_DIR = ".settled"
SETTLE_AFTER_S = 600.0  # a run settles this long after its end and its last write

log = logging.getLogger("ettflow.ett")

Fingerprint = tuple[tuple[str, int, int], ...]


def settled_runs(spool_root: Path | str, key: str) -> frozenset[str]:
    """The runs settled for warehouse `key` (empty when none or unreadable)."""
    try:
        return frozenset(os.listdir(Path(spool_root) / SETTLED_DIR / key))
    except FileNotFoundError:
        return frozenset()
    except OSError as exc:  # the index only saves reading: without it every run is read
        log.warning("the spool's settled index %s is unreadable (%s): every run is reconciled",
                    Path(spool_root) / SETTLED_DIR / key, exc)
        return frozenset()


def fingerprint(spool_root: Path | str, run_id: str) -> Fingerprint:
    """What the run's folder holds: each file's name, size and mtime (ns); empty (never settled)
    when it cannot be read."""
    out = []
    try:
        with os.scandir(Path(spool_root) / run_id) as entries:
            for e in entries:
                with contextlib.suppress(FileNotFoundError):
                    st = e.stat()
                    out.append((e.name, st.st_size, st.st_mtime_ns))
    except OSError:
        return ()
    return tuple(sorted(out))


def settle(spool_root: Path | str, run_id: str, key: str, judged: Fingerprint,
           now_print: Callable[[], Fingerprint] | None = None) -> bool:
    """Enter `run_id` as settled for `key`, judged on its folder as `judged` (its `fingerprint`
    when the caller read it); the entry is taken back when the folder changed since. True when
    it stands. Never raises: without an entry the run is only read again."""
    path = Path(spool_root) / SETTLED_DIR / key / run_id
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644))
    except OSError as exc:
        log.debug("cannot settle run %s in %s: %s", run_id, path.parent, exc)
        return False
    if not judged or (now_print or (lambda: fingerprint(spool_root, run_id)))() != judged:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("cannot take run %s out of the settled index %s (%s): a refresh will not reconcile it; "
                        "`ettflow archive --pending` does", run_id, path.parent, exc)
        return False
    return True


def unsettle(spool_root: Path | str, run_id: str) -> None:
    """Remove `run_id` from the settled index, for every warehouse. Never raises: an entry that
    cannot be removed is logged (that run's row is then not reconciled on a refresh's clock)."""
    index = Path(spool_root) / SETTLED_DIR
    try:
        keys = os.listdir(index)
    except FileNotFoundError:
        return
    except OSError as exc:
        log.warning("cannot read the spool's settled index %s (%s)", index, exc)
        return
    for key in keys:
        try:
            os.unlink(index / key / run_id)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot take run %s out of the settled index %s (%s): a refresh will not "
                        "reconcile it; `ettflow archive --pending` does", run_id, index / key, exc)
