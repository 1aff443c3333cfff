"""Progress bars for long steps (export, tuning, loading weights).

Shown on an interactive terminal, or when KILN_PROGRESS=1; silent in CI, in pipes and
when KILN_PROGRESS=0, so logs stay clean.
"""

from __future__ import annotations

from tqdm.auto import tqdm

from kiln.settings import progress_enabled


def enabled() -> bool:
    return progress_enabled()


def progress(total=None, desc: str = "", unit: str = "it", **kw) -> tqdm:
    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled(), leave=False, **kw)
