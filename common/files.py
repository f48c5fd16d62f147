"""Temp name, then rename: a reader (another rank, a resumed run, a concurrent preparation) sees either
no file or folder at the final path, or a complete one."""
import os
import shutil
from contextlib import contextmanager
from pathlib import Path


def temp_path(final: Path) -> Path:
    """This process's temp name beside `final` (the same filesystem, so the rename is atomic)."""
    return final.with_name(f"{final.name}.tmp{os.getpid()}")


def remove(path: Path) -> None:
    """Remove a file or folder, if there is one."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def rename_into_place(tmp: Path, final: Path, keep_existing: bool = False) -> None:
    """Move a finished temp file or folder to `final`. An existing final is replaced (a folder is removed
    first: os.replace cannot overwrite a non-empty one), or with keep_existing kept and tmp removed
    (another process wrote the same content first, also when it does so between the check and the rename)."""
    if keep_existing and final.exists():
        remove(tmp)
        return
    if final.is_dir():
        shutil.rmtree(final)
    try:
        os.replace(tmp, final)
    except OSError:
        if not (keep_existing and final.exists()):
            raise
        remove(tmp)


@contextmanager
def written_then_renamed(final: Path, keep_existing: bool = False, tmp: Path | None = None):
    """Yields a temp path (temp_path(final) unless given; any stale one removed) for the block to write
    a file or folder at; after the block it is renamed to `final` (rename_into_place), on an error removed."""
    tmp = temp_path(final) if tmp is None else tmp
    remove(tmp)
    try:
        yield tmp
        rename_into_place(tmp, final, keep_existing)
    except BaseException:
        remove(tmp)
        raise
