"""Progress bars for long steps (export, tuning, loading weights).

Shown on an interactive terminal, or when KILN_PROGRESS=1; silent in CI, in pipes and
when KILN_PROGRESS=0, so logs stay clean.
"""

from __future__ import annotations

import os
import sys

from tqdm.auto import tqdm


def enabled() -> bool:
    flag = os.environ.get("KILN_PROGRESS")
    if flag is not None:
        return flag not in ("0", "", "false", "no")
    return sys.stderr.isatty()


def progress(total=None, desc: str = "", unit: str = "it", **kw) -> tqdm:
    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled(), leave=False, **kw)
