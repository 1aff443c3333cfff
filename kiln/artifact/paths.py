"""The artifact directory a user names, checked to be a path before any file is touched.

`kiln.load(None)` or `exe.save(3)` used to end in pathlib's raw TypeError.
"""

from __future__ import annotations

import os
from pathlib import Path

from kiln.errors import ArtifactError


def artifact_path(path) -> Path:
    """`path` (a str or os.PathLike) as a Path, else an ArtifactError."""
    if isinstance(path, (str, os.PathLike)) and str(path):
        return Path(path)
    raise ArtifactError(f"a kiln artifact is named by a directory path, got "
                        f"{type(path).__name__} {path!r}",
                        hint="pass a str or pathlib.Path, e.g. 'model.kiln'")
