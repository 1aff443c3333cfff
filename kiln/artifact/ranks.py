"""A multi-device module on disk: one manifest for the plan, a directory per rank.

    model.kiln/
      parallel.json   {"format": "kiln-parallel", "tp": T, "pp": P, "ranks": ["rank0", ..]}
      rank0/          rank 0's artifact (its plan, kernels and only its weights)
      rank1/ ...

Every rank saves its own part (its weights are only its slices); rank 0 writes the
manifest. Under torchrun, `kiln.load` gives each rank its own part and joins the
world; anywhere else it is an error that says how to launch.
"""

from __future__ import annotations

import json
from pathlib import Path

from kiln.artifact.paths import artifact_path
from kiln.errors import ArtifactError, DistributedError

PARALLEL_FILE = "parallel.json"
FORMAT = "kiln-parallel"


def rank_dir(path, rank: int) -> Path:
    return artifact_path(path) / f"rank{rank}"


def write_parallel_manifest(path, tp: int, pp: int) -> None:
    Path(path).mkdir(parents=True, exist_ok=True)
    body = {"format": FORMAT, "tp": tp, "pp": pp,
            "ranks": [f"rank{r}" for r in range(tp * pp)]}
    tmp = Path(path) / f".{PARALLEL_FILE}.tmp"
    tmp.write_text(json.dumps(body, indent=1))
    tmp.replace(Path(path) / PARALLEL_FILE)


def read_parallel_manifest(path) -> dict | None:
    """The multi-device manifest at `path`, or None for a single-device artifact."""
    f = artifact_path(path) / PARALLEL_FILE
    if not f.is_file():
        return None
    try:
        body = json.loads(f.read_text())
        if body.get("format") != FORMAT:
            raise ValueError(f"format {body.get('format')!r}")
        return {"tp": int(body["tp"]), "pp": int(body["pp"]), "ranks": list(body["ranks"])}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ArtifactError(f"{f} is not a valid kiln multi-device manifest: {e}",
                            hint="save the module again from every rank") from None


def this_rank(manifest: dict, rank: int | None, path) -> Path:
    """The directory of this process's part of the saved plan."""
    world = manifest["tp"] * manifest["pp"]
    if rank is None:
        raise DistributedError(
            f"{path} holds a plan of tp={manifest['tp']} x pp={manifest['pp']} = {world} "
            "ranks; this process is not one of them",
            hint=f"load it from every rank: torchrun --nproc-per-node {world} ...")
    if not 0 <= rank < world:
        raise DistributedError(f"rank {rank} is outside the {world} ranks saved in {path}",
                               hint=f"launch exactly {world} processes")
    d = Path(path) / manifest["ranks"][rank]
    if not d.is_dir():
        raise ArtifactError(f"{d} is missing: rank {rank}'s part of {path} was not saved",
                            hint="save the module from every rank")
    return d
