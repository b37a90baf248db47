"""Checkpoints of a training run: every N steps and at the end, the last K kept, atomic, and
restorable into another plan's layout.

Built on ``orbax-checkpoint``'s ``CheckpointManager``. A step is written into
``<directory>/<step>.orbax-checkpoint-tmp`` and renamed to ``<directory>/<step>`` only once every
file is written (orbax's ``AtomicRenameTemporaryPath``; a ``commit_success.txt`` is written just
before the rename). Step listing skips the temporary names, so a run killed mid-save leaves the
previous step as the latest; the next manager removes the leftover (``cleanup_tmp_directories``).

Each step directory holds these items:

- ``state``: the state's arrays as a nested dict of their key-path components (independent of the
  pytree classes, so an ``nnx.State`` and a Linen ``TrainState`` with equal key paths share it);
  orbax writes each process's own shards (OCDBT + tensorstore);
- ``owned`` (multi-process runs only): the leaves that live on one process of several (a
  pipeline stage's, a placeholder elsewhere), which orbax refuses to write ("host local"
  arrays); the process holding each writes it as ``<leaf index>.npy``;
- ``tree``: every leaf's key path, shape, dtype and item, checked before restoring
  (:class:`CheckpointError` naming the first differing leaves instead of an orbax traceback);
  a PRNG key array (``key<fry>``, which orbax cannot write) is stored as its key data
  (``jax.random.key_data``) and wrapped again, with its implementation, on restore;
- ``meta``: the caller's JSON (data position, fingerprints, plan hash, config);
- ``checksums.json``: every file's size and SHA-256, written by process 0 once the step is
  committed (:mod:`shardplan.train._integrity`); :meth:`Checkpointer.restore` verifies them
  first, so damaged files are named rather than restored (a step without one is restored as
  unverified).

Restoring reads the arrays straight into the target's shardings (``jax.ShapeDtypeStruct``s with a
``sharding``), so a checkpoint written under one plan loads into another plan's layout, sub-meshes
included (8-way data parallel -> 2 pipeline stages).

Example:
    >>> import tempfile, jax, jax.numpy as jnp
    >>> state = {"w": jnp.ones((4, 2)), "step": jnp.zeros((), jnp.int32)}
    >>> with Checkpointer(tempfile.mkdtemp(), every_steps=10, keep=2) as ckpt:
    ...     saved = ckpt.save(10, state, meta={"data": {"position": 640}})
    ...     target = abstract_target(state, jax.tree.map(lambda x: x.sharding, state))
    ...     restored = ckpt.restore(target=target)
    >>> restored.step, restored.meta["data"]["position"], restored.verified
    (10, 640, True)
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers

from shardplan.errors import CheckpointError, ConfigError, format_error
from shardplan.trace.dtypes import dtype_name, is_prng_key
from shardplan.train._integrity import Verdict, write_manifest
from shardplan.train._integrity import verify as verify_files
from shardplan.train._owned import (
    OwnedHandler,
    OwnedRestore,
    OwnedSave,
    here,
    one_process,
    placeholder,
)

__all__ = ["Checkpointer", "LeafInfo", "Restored", "abstract_target", "leaf_infos"]

# (Past 600 lines: the orbax wiring and the leaf checks that name what differs in a
# checkpoint; the checks could move to a module of their own.)

_STATE, _OWNED, _TREE, _META = "state", "owned", "tree", "meta"
FORMAT_VERSION = 1
"""Version of the ``tree`` item's layout; bumped when it changes incompatibly."""

_ROOT = ("value",)
"""Where a state that is a single array (key path ``()``) is stored in the ``state`` item."""

_SHOWN = 5
"""How many differing leaves an error lists (of each kind)."""


@dataclass(frozen=True)
class LeafInfo:
    """One state leaf as recorded in a checkpoint: its key path, shape and dtype."""

    path: str
    shape: tuple[int, ...]
    dtype: str

    def describe(self) -> str:
        """``float32[64,128]``."""
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"


@dataclass(frozen=True)
class Restored:
    """What :meth:`Checkpointer.restore` read: the step, the state (target's structure and
    shardings), the caller's ``meta``, and whether the step's files were verified against
    their checksums (False: the step has none recorded, or ``verify=False``)."""

    step: int
    state: Any
    meta: dict[str, Any]
    verified: bool = False


def _registry() -> Any:
    """Which orbax handler reads and writes each item."""
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    state = ocp.PyTreeCheckpointHandler()
    registry.add(_STATE, ocp.args.PyTreeSave, state)
    registry.add(_STATE, ocp.args.PyTreeRestore, state)
    owned = OwnedHandler()
    registry.add(_OWNED, OwnedSave, owned)
    registry.add(_OWNED, OwnedRestore, owned)
    for name in (_TREE, _META):
        json_handler = ocp.JsonCheckpointHandler()
        registry.add(name, ocp.args.JsonSave, json_handler)
        registry.add(name, ocp.args.JsonRestore, json_handler)
    return registry


def _key_path(path: Sequence[Any]) -> str:
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def _flatten(tree: Any) -> tuple[list[tuple[tuple[str, ...], Any]], Any]:
    """The leaves as ``(key-path components, leaf)`` and the treedef."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [(tuple(_key_path((k,)) for k in path), leaf) for path, leaf in leaves], treedef


def _info(parts: tuple[str, ...], leaf: Any, what: str) -> LeafInfo:
    path = "/".join(parts)
    if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
        raise CheckpointError(
            format_error(
                f"A {what} leaf is not an array.",
                where=path,
                value=type(leaf).__name__,
                remedy="keep only arrays in the state (jnp.asarray(x) for Python numbers)",
            )
        )
    return LeafInfo(path, tuple(int(d) for d in leaf.shape), dtype_name(leaf.dtype))


def _stored(leaf: Any) -> Any:
    """What orbax writes for a state leaf: a PRNG key array's key data (``uint32``, the key's
    words as a trailing dimension), else the leaf itself."""
    return jax.random.key_data(leaf) if is_prng_key(leaf.dtype) else leaf


def _stored_target(target: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    """The abstract array orbax reads ``target``'s leaf from (:func:`_stored`), on the
    target's sharding (which leaves the key words' dimension whole)."""
    if not is_prng_key(target.dtype):
        return target
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(target.shape, target.dtype))
    return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=target.sharding)


def leaf_infos(tree: Any, /) -> list[LeafInfo]:
    """Every leaf's key path, shape and dtype, in flattening order.

    Args:
      tree: a state pytree of arrays or ``jax.ShapeDtypeStruct``s.

    Returns:
      One :class:`LeafInfo` per leaf.
    """
    return [_info(parts, leaf, "state") for parts, leaf in _flatten(tree)[0]]


def abstract_target(state: Any, shardings: Any, /) -> Any:
    """The restore target for ``state`` laid out per ``shardings``: no allocation.

    Args:
      state: the state pytree (arrays or ``ShapeDtypeStruct``s), e.g. from
        ``models.abstract_train_state``.
      shardings: a pytree of the same structure with a ``jax.sharding.Sharding`` per leaf (the
        new plan's state shardings; a pipelined plan's leaves may sit on different sub-meshes).

    Returns:
      ``state``'s structure with ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)`` leaves.

    Raises:
      CheckpointError: a sharding is missing for a leaf or the structures differ.
    """
    leaves, treedef = _flatten(state)
    try:
        flat_shardings = treedef.flatten_up_to(shardings)
    except (ValueError, TypeError) as err:
        raise CheckpointError(
            format_error(
                "The shardings do not have the state's structure.",
                value=str(err).splitlines()[0],
                remedy="pass one Sharding per state leaf, in a pytree shaped like the state",
            )
        ) from err
    out = []
    for (parts, leaf), sharding in zip(leaves, flat_shardings, strict=True):
        info = _info(parts, leaf, "state")
        if not isinstance(sharding, jax.sharding.Sharding):
            raise CheckpointError(
                format_error(
                    "A state leaf has no sharding to restore onto.",
                    where=info.path,
                    value=sharding,
                    remedy="give every leaf a jax.sharding.Sharding (e.g. a "
                    "NamedSharding from the plan's state shardings)",
                )
            )
        out.append(jax.ShapeDtypeStruct(info.shape, leaf.dtype, sharding=sharding))
    return jax.tree.unflatten(treedef, out)


def _nest(leaves: Sequence[tuple[tuple[str, ...], Any]]) -> dict[str, Any]:
    """``{"a": {"b": leaf}}`` from ``[(("a", "b"), leaf)]``; two leaves on one path are an error."""
    root: dict[str, Any] = {}
    for parts, leaf in leaves:
        parts = parts or _ROOT
        node = root
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            clash = part in node and (last or not isinstance(node[part], dict))
            if clash:
                raise CheckpointError(
                    format_error(
                        "Two state leaves have the same key path (e.g. dict keys 0 and '0').",
                        where="/".join(parts[: i + 1]),
                        remedy="give the state distinct keys",
                    )
                )
            if last:
                node[part] = leaf
            else:
                node = node.setdefault(part, {})
    return root


def _pick(nested: dict[str, Any], parts: tuple[str, ...]) -> Any:
    for part in parts or _ROOT:
        nested = nested[part]
    return nested


def _differences(saved: Sequence[LeafInfo], wanted: Sequence[LeafInfo]) -> list[str]:
    """Lines naming the leaves that differ: missing, added, other shape or dtype."""
    have = {leaf.path: leaf for leaf in saved}
    want = {leaf.path: leaf for leaf in wanted}
    missing = [p for p in have if p not in want]
    added = [p for p in want if p not in have]
    changed = [p for p in want if p in have and have[p] != want[p]]
    lines = [
        f"{p}: checkpoint {have[p].describe()}, target {want[p].describe()}"
        for p in changed[:_SHOWN]
    ]
    lines += [f"{p}: only in the checkpoint ({have[p].describe()})" for p in missing[:_SHOWN]]
    lines += [f"{p}: only in the target ({want[p].describe()})" for p in added[:_SHOWN]]
    hidden = (len(changed) + len(missing) + len(added)) - len(lines)
    if hidden > 0:
        lines.append(f"... and {hidden} more")
    return lines


_SHOWN_CHARS = 300
"""How much of an underlying (orbax, tensorstore) error message an error shows."""


def _first_line(err: BaseException) -> str:
    """``Type: first line``, without tensorstore's long specs, at most ``_SHOWN_CHARS``."""
    lines = str(err).strip().splitlines()
    text = lines[0].split(" [tensorstore_spec")[0] if lines else ""
    if len(text) > _SHOWN_CHARS:
        text = text[:_SHOWN_CHARS] + "..."
    return f"{type(err).__name__}: {text}"


class Checkpointer:
    """Saves and restores a run's state (and JSON meta) under ``directory``, one folder per step.

    Saves are synchronous by default: :meth:`save` returns once the step directory is final,
    so the caller may donate or overwrite the state's buffers right after. With
    ``asynchronous=True`` orbax copies the arrays to host memory before :meth:`save` returns and
    writes them in a background thread; call :meth:`wait` (or :meth:`close`) before exiting.
    (Only a plain round trip is tested asynchronously; with a step that donates the state, as
    ``apply_plan``'s does, prefer synchronous saves until that is verified.)

    One run writes a directory at a time: opening a ``Checkpointer`` removes the unfinished
    ``<step>.orbax-checkpoint-tmp`` folders a killed save left behind.

    Args:
      directory: where the step folders go (created if missing). A directory with no
        checkpoint is a fresh start (:meth:`latest_step` is None).
      every_steps: :meth:`should_save` is true every this many steps and at the last step;
        None: only at the last step.
      keep: how many of the latest steps to keep; None keeps all.
      asynchronous: write in the background (see above).

    Raises:
      ConfigError: ``every_steps`` or ``keep`` is not a positive integer.

    Example:
      >>> import tempfile
      >>> ckpt = Checkpointer(tempfile.mkdtemp(), every_steps=100, keep=3)
      >>> ckpt.should_save(200), ckpt.should_save(250), ckpt.should_save(250, final=True)
      (True, False, True)
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        /,
        *,
        every_steps: int | None,
        keep: int | None,
        asynchronous: bool = False,
    ) -> None:
        for name, value in (("every_steps", every_steps), ("keep", keep)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(
                    format_error(
                        f"Checkpoint option {name} must be a positive integer.",
                        where=name,
                        value=value,
                        remedy=f"set {name} to 1 or more (or None: "
                        + ("keep all)" if name == "keep" else "save only at the last step)"),
                    )
                )
        self.directory = Path(directory).absolute()
        self.every_steps = every_steps
        self.keep = keep
        self.asynchronous = asynchronous
        options = ocp.CheckpointManagerOptions(
            # Saving is decided by the caller (should_save); save() always writes.
            save_decision_policy=None,
            preservation_policy=checkpoint_managers.LatestN(n=keep),
            enable_async_checkpointing=asynchronous,
            # The item folders exist (on every process) before any item is written: the
            # one-process leaves' handler writes plain files into its folder right away.
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
            cleanup_tmp_directories=True,  # a killed save's leftovers
            create=True,
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, handler_registry=_registry()
        )
        self._unsealed: list[int] = []  # asynchronous saves whose checksums are not written

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def should_save(self, step: int, /, *, final: bool = False) -> bool:
        """Whether ``step`` is a checkpoint step: a multiple of ``every_steps``, or the last.

        Args:
          step: the number of steps done.
          final: ``step`` is the run's last step.
        """
        return final or (self.every_steps is not None and step % self.every_steps == 0)

    def all_steps(self) -> list[int]:
        """The finished steps on disk, oldest first (temporary folders never count)."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest finished step, or None when there is none (a fresh start)."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def step_dir(self, step: int, /) -> Path:
        """The folder of ``step``."""
        return self.directory / str(step)

    def save(self, step: int, state: Any, /, *, meta: dict[str, Any]) -> bool:
        """Writes ``state`` and ``meta`` as step ``step`` (atomically), then drops old steps.

        Every process must call it (orbax writes each process's shards and synchronises).
        Leaves held by other processes (a pipeline's other stages) are written by those.

        Args:
          step: the number of steps done.
          state: the state pytree of ``jax.Array``s (any sharding).
          meta: JSON-serialisable: data position, fingerprints, plan hash, config.

        Returns:
          True if written; False if ``step`` is already saved (e.g. a final save right after a
          periodic one), which is left as it is.

        Raises:
          CheckpointError: ``meta`` is not JSON, a leaf is not an array, or a later step is
            already saved (the run would resume from that one instead).
        """
        try:
            json.dumps(meta, allow_nan=False)
        except (TypeError, ValueError) as err:
            raise CheckpointError(
                format_error(
                    "The checkpoint meta is not JSON-serialisable.",
                    where="meta",
                    value=_first_line(err),
                    remedy="keep only dicts, lists, str, int, float (finite), bool, None",
                )
            ) from err
        steps = self.all_steps()
        if step in steps:
            return False
        if steps and steps[-1] > step:
            raise CheckpointError(
                format_error(
                    f"A later step is already saved in {self.directory}: saving step {step} "
                    f"there would leave resume picking step {steps[-1]}.",
                    where=str(self.step_dir(steps[-1])),
                    value=steps,
                    remedy="use another output directory, or move the later steps away",
                )
            )
        leaves, _ = _flatten(state)
        infos = [_info(parts, leaf, "state") for parts, leaf in leaves]
        leaves = [(parts, _stored(leaf)) for parts, leaf in leaves]
        owned = {str(n): leaf for n, (_, leaf) in enumerate(leaves) if one_process(leaf)}
        shared = [(parts, leaf) for n, (parts, leaf) in enumerate(leaves) if str(n) not in owned]
        tree = {
            "format": FORMAT_VERSION,
            "leaves": [
                [i.path, list(i.shape), i.dtype, _OWNED if str(n) in owned else _STATE]
                for n, i in enumerate(infos)
            ],
        }
        items: dict[str, Any] = {_TREE: ocp.args.JsonSave(tree), _META: ocp.args.JsonSave(meta)}
        if shared:
            items[_STATE] = ocp.args.PyTreeSave(_nest(shared))
        if owned:
            items[_OWNED] = OwnedSave(owned)
        saved = bool(self._manager.save(step, args=ocp.args.Composite(**items), force=True))
        if saved:
            self._unsealed.append(step)
            if not self.asynchronous:
                self._seal()
        return saved

    def _seal(self) -> None:
        """Writes the checksums of the committed steps that have none yet (process 0)."""
        steps, self._unsealed = self._unsealed, []
        if jax.process_index() != 0:
            return
        on_disk = set(self.all_steps())
        for step in steps:
            if step in on_disk:  # (a step the keep policy already dropped has nothing to seal)
                write_manifest(self.step_dir(step))

    def wait(self) -> None:
        """Blocks until an asynchronous save is final, and its checksums are written (no-op
        when synchronous)."""
        self._manager.wait_until_finished()
        self._seal()

    def close(self) -> None:
        """Waits for saves in flight (and writes their checksums), and releases orbax's
        resources."""
        self._manager.wait_until_finished()
        self._seal()
        self._manager.close()

    def verify(self, step: int, /) -> Verdict:
        """Compares ``step``'s files with the checksums recorded when it was saved (sizes, then
        SHA-256): ``.ok``, ``.recorded`` (False: none recorded), ``.problem`` and ``.file``."""
        self.wait()
        return verify_files(self.step_dir(self._resolve(step)))

    def intact_before(self, step: int, /) -> int | None:
        """The newest step before ``step`` whose files match their checksums (or that has
        none recorded), or None."""
        for earlier in reversed([s for s in self.all_steps() if s < step]):
            if verify_files(self.step_dir(earlier)).ok:
                return earlier
        return None

    def _damaged(self, step: int, verdict: Verdict) -> CheckpointError:
        intact = self.intact_before(step)
        if intact is not None:
            remedy = (f"step {intact} is intact ({self.step_dir(intact)}): restore it with "
                      f"step={intact}, or move {self.step_dir(step)} away so that resuming "
                      "picks it")
        else:
            remedy = (f"no earlier step is intact: restore the files from a copy, or delete "
                      f"{self.directory} and start fresh")
        return CheckpointError(format_error(
            f"The checkpoint of step {step} is damaged: a file differs from what was written "
            "when it was saved.",
            where=str(verdict.file), value=verdict.problem, remedy=remedy))

    def _resolve(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise CheckpointError(
                    format_error(
                        "There is no checkpoint to restore.",
                        where=str(self.directory),
                        remedy="check latest_step() first; None means a fresh start",
                    )
                )
            return steps[-1]
        if step not in steps:
            raise CheckpointError(
                format_error(
                    f"Step {step} has no checkpoint in {self.directory}.",
                    value=steps,
                    has_value=True,
                    remedy="pick one of the saved steps (or None for the latest)",
                )
            )
        return step

    def _corrupt(self, step: int, err: BaseException) -> CheckpointError:
        earlier = [s for s in self.all_steps() if s < step]
        if earlier:
            remedy = (
                f"step {earlier[-1]} is intact ({self.step_dir(earlier[-1])}): restore "
                f"it with step={earlier[-1]}, or move {self.step_dir(step)} away so that "
                "resuming picks it"
            )
        else:
            remedy = f"no earlier step is saved: delete {self.directory} and start fresh"
        return CheckpointError(
            format_error(
                f"The checkpoint of step {step} cannot be read (missing or damaged files).",
                where=str(self.step_dir(step)),
                value=_first_line(err),
                remedy=remedy,
            )
        )

    def _read_json(self, step: int) -> tuple[list[LeafInfo], list[str], dict[str, Any]]:
        """The step's leaf table, the item each leaf is in, and the meta."""
        try:
            got = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    **{_TREE: ocp.args.JsonRestore(), _META: ocp.args.JsonRestore()}
                ),
            )
            tree, meta = got[_TREE], got[_META]
            saved = [
                LeafInfo(str(p), tuple(int(d) for d in shape), str(dtype))
                for p, shape, dtype, _ in tree["leaves"]
            ]
            items = [str(item) for *_, item in tree["leaves"]]
        except Exception as err:  # orbax/tensorstore/json raise many kinds; all mean unreadable
            raise self._corrupt(step, err) from err
        if tree.get("format") != FORMAT_VERSION:
            raise CheckpointError(
                format_error(
                    "The checkpoint was written by another shardplan checkpoint format.",
                    where=str(self.step_dir(step)),
                    value=tree.get("format"),
                    remedy=f"restore it with the shardplan version that wrote it "
                    f"(this one reads format {FORMAT_VERSION})",
                )
            )
        return saved, items, meta

    def read_meta(self, step: int | None = None, /) -> dict[str, Any]:
        """The ``meta`` saved with ``step`` (the latest if None).

        Raises:
          CheckpointError: no such step, or its files are unreadable.
        """
        self.wait()
        return self._read_json(self._resolve(step))[2]

    def restore(self, step: int | None = None, /, *, target: Any,
                verify: bool = True) -> Restored:
        """Reads step ``step`` (the latest if None) into ``target``'s structure and shardings.

        The step's files are verified against their checksums first (``verify``), then the
        leaves are checked: the checkpoint must have exactly the target's key paths, shapes
        and dtypes. A damaged step is an error, not a silent fall-back to an older one (that
        would quietly redo work and hide a disk problem); the error names the file and the
        newest intact earlier step to use instead.

        Args:
          step: the step to read; None reads the latest.
          target: a pytree of ``jax.ShapeDtypeStruct``s with shardings (see
            :func:`abstract_target`) or of ``jax.Array``s (their shardings are used); it may
            place leaves on different meshes than the saving run did.
          verify: compare the step's files with their checksums first (False: the caller
            has, with :meth:`verify`).

        Returns:
          :class:`Restored` with the state as ``jax.Array``s on the target's shardings.

        Raises:
          CheckpointError: no checkpoint, another model's checkpoint (naming the differing key
            paths, shapes and dtypes), a target leaf without sharding, unreadable files, or
            files that differ from their checksums (naming the file and the newest intact
            step).
        """
        self.wait()
        step = self._resolve(step)
        verdict = self.verify(step) if verify else None
        if verdict is not None and not verdict.ok:
            raise self._damaged(step, verdict)
        leaves, treedef = _flatten(target)
        abstract = []
        for parts, leaf in leaves:
            sharding = getattr(leaf, "sharding", None)
            if sharding is None:
                raise CheckpointError(
                    format_error(
                        "A restore target leaf has no sharding.",
                        where="/".join(parts),
                        value=leaf,
                        remedy="build the target with abstract_target(state, shardings)",
                    )
                )
            info = _info(parts, leaf, "target")
            try:
                sharding.shard_shape(info.shape)
            except ValueError as err:
                raise CheckpointError(
                    format_error(
                        "A restore target's sharding does not fit its leaf.",
                        where=info.path,
                        value=f"{info.describe()} on {sharding}",
                        remedy="pick a sharding whose mesh axes divide the dimensions they split "
                        "(or replicate that dimension)",
                    )
                ) from err
            abstract.append(
                (parts, jax.ShapeDtypeStruct(info.shape, leaf.dtype, sharding=sharding))
            )
        saved, items, meta = self._read_json(step)
        differences = _differences(saved, [_info(p, leaf, "target") for p, leaf in abstract])
        if differences:
            raise CheckpointError(
                format_error(
                    f"The checkpoint in {self.directory} (step {step}) belongs to another model: "
                    "its state leaves differ from the run's.",
                    where="\n    " + "\n    ".join(differences),
                    remedy="write this run's checkpoints to another directory (output.dir), or "
                    f"delete {self.directory} to start fresh",
                )
            )
        try:
            values = self._read_arrays(
                step, [(parts, _stored_target(t)) for parts, t in abstract], saved, items)
        except Exception as err:  # orbax/tensorstore raise many kinds; all mean unreadable
            raise self._corrupt(step, err) from err
        values = [jax.random.wrap_key_data(v, dtype=t.dtype) if is_prng_key(t.dtype) else v
                  for v, (_, t) in zip(values, abstract, strict=True)]
        return Restored(step, jax.tree.unflatten(treedef, values), meta,
                        verified=verdict is not None and verdict.recorded)

    def _read_arrays(
        self,
        step: int,
        abstract: list[tuple[tuple[str, ...], Any]],
        saved: list[LeafInfo],
        items: list[str],
    ) -> list[Any]:
        """The target's leaves read from ``step``: only those with devices on this process
        (the others are placeholders, as a pipeline's other stages are)."""
        index = {info.path: n for n, info in enumerate(saved)}
        shared, owned = [], {}
        for parts, target in abstract:
            n = index["/".join(parts)]
            if not here(target.sharding):
                continue
            if items[n] == _OWNED:
                owned[str(n)] = target
            else:
                shared.append((parts, target))
        args: dict[str, Any] = {}
        if shared:
            nested = _nest(shared)
            args[_STATE] = ocp.args.PyTreeRestore(
                item=nested,
                restore_args=ocp.checkpoint_utils.construct_restore_args(nested),
                partial_restore=len(shared) < items.count(_STATE),
            )
        if owned:
            args[_OWNED] = OwnedRestore(owned)
        got = self._manager.restore(step, args=ocp.args.Composite(**args)) if args else {}
        values = []
        for parts, target in abstract:
            stem = str(index["/".join(parts)])
            if not here(target.sharding):
                values.append(placeholder(target))
            elif stem in owned:
                values.append(got[_OWNED][stem])
            else:
                values.append(_pick(got[_STATE], parts))
        return values
