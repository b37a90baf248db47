"""Where a run resumes: its latest checkpoint, verified against the checksums recorded when it
was saved, or (only with ``output.resume_from_intact``) the newest intact one, the damaged steps
then moved aside. :func:`resume` only reads; ``train`` writes once every check has passed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardplan.data import Dataset
from shardplan.errors import CheckpointError, format_error
from shardplan.train.checkpoint import Checkpointer
from shardplan.train.config import RunConfig

__all__ = ["DAMAGED", "Resume", "move_aside", "resume"]

DAMAGED = "damaged-checkpoints"
"""Where, in the run directory, damaged checkpoint steps are moved (kept for inspection)."""


def move_aside(run_dir: Path, checkpoints: Path, steps: Sequence[int]) -> Path:
    """Moves the damaged ``steps`` out of ``checkpoints`` into ``<run_dir>/damaged-checkpoints``
    (kept for inspection; resuming never looks there)."""
    aside = run_dir / DAMAGED
    aside.mkdir(exist_ok=True)
    for step in steps:
        dest = aside / str(step)
        n = 1
        while dest.exists():
            dest, n = aside / f"{step}.{n}", n + 1
        os.replace(checkpoints / str(step), dest)
    return aside


@dataclass
class Resume:
    """Where a run resumes: the step, its restored state, and what to say and do first."""

    step: int
    state: Any
    message: str
    damaged: tuple[int, ...] = ()


def resume(config: RunConfig, checkpoints: Checkpointer, dataset: Dataset, target: Any
            ) -> Resume | None:
    """The checkpoint the run resumes from, verified and restored (None: a fresh start).
    Reads only: nothing in the run directory changes here."""
    latest = checkpoints.latest_step() if config.output.resume else None
    if latest is None:
        return None
    verdict = checkpoints.verify(latest)
    step = latest
    damaged: tuple[int, ...] = ()
    if not verdict.ok:
        intact = checkpoints.intact_before(latest)
        if intact is None or not config.output.resume_from_intact:
            raise CheckpointError(format_error(
                f"The latest checkpoint (step {latest}) is damaged: a file differs from what was "
                "written when it was saved, so resuming from it would train on corrupt values.",
                where=str(verdict.file), value=verdict.problem,
                remedy=(f"resume from step {intact}, the newest intact one, with "
                        "--output.resume_from_intact=true (the damaged steps are moved to "
                        f"{Path(config.output.dir) / DAMAGED}), or restore the "
                        "files from a copy" if intact is not None else
                        "no earlier step is intact: restore the files from a copy, or start "
                        "fresh in another output.dir")))
        step, damaged = intact, tuple(s for s in checkpoints.all_steps() if s > intact)
    saved = checkpoints.read_meta(step)
    if saved.get("data_fingerprint") != dataset.fingerprint:
        raise CheckpointError(format_error(
            "The checkpoint was written for other training data (the data fingerprint "
            "differs), so resuming would not see the batches the run would have seen.",
            where=str(checkpoints.step_dir(step)),
            value={"checkpoint": saved.get("data_fingerprint"), "now": dataset.fingerprint},
            remedy="use the data config the run started with, or another output.dir"))
    restored = checkpoints.restore(step, target=target, verify=False)
    recorded = checkpoints.verify(step).recorded if damaged else verdict.recorded
    message = (f"resumed from step {step} ({checkpoints.step_dir(step)}"
               + ("; its checksums match)" if recorded else "; no checksums recorded: not "
                  "verified)"))
    if damaged:
        message += (f"; steps {list(damaged)} are damaged ({verdict.problem}) and are moved to "
                    f"{Path(config.output.dir) / DAMAGED}")
    return Resume(restored.step, restored.state, message, damaged)
