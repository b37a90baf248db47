"""One process of the multi-process checkpoint test (run under ``shardplan launch``).

``checkpoint_worker.py DIR``: two processes x four CPU devices. Saves a state laid out like a
2-stage pipeline (each leaf on one process's devices; the other process holds a placeholder with
no shards), restores it onto a mesh over both processes and onto the swapped stages; then saves
it from the mesh over both processes and restores that onto the stages. Each restore checks
this process's shards against the values.
"""

from __future__ import annotations

import sys
from typing import Any

import shardplan as sp

sp.initialize_distributed()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from shardplan.train.checkpoint import Checkpointer, abstract_target  # noqa: E402

VALUES = {
    "w": np.arange(64, dtype=np.float32).reshape(8, 8),
    "b": np.linspace(-1, 1, 6, dtype=np.float32),
    "e": (np.arange(64, dtype=np.float32).reshape(16, 4) / 7).astype(jnp.bfloat16),
    "step": np.asarray(7, np.int32),
}


def _mesh(devices: list[jax.Device], names: tuple[str, ...], shape: tuple[int, ...]) -> Any:
    return jax.sharding.Mesh(
        np.array(devices).reshape(shape),
        names,
        axis_types=(jax.sharding.AxisType.Auto,) * len(names),
    )


def _placed(shardings: dict[str, NamedSharding]) -> dict[str, jax.Array]:
    """The values on ``shardings``; a leaf on the other process's devices has no shard here."""
    return {
        k: jax.make_array_from_callback(v.shape, shardings[k], lambda i, v=v: v[i], dtype=v.dtype)
        for k, v in VALUES.items()
    }


def _check(state: dict[str, jax.Array], shardings: dict[str, NamedSharding], what: str) -> None:
    for key, leaf in state.items():
        assert leaf.sharding == shardings[key], (what, key, leaf.sharding)
        for shard in leaf.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), VALUES[key][shard.index])


def main(directory: str) -> None:
    me = jax.process_index()
    mine = [d for d in jax.devices() if d.process_index == 0]
    theirs = [d for d in jax.devices() if d.process_index == 1]
    stage0, stage1 = _mesh(mine, ("data",), (4,)), _mesh(theirs, ("data",), (4,))
    everywhere = _mesh(jax.devices(), ("data", "model"), (4, 2))
    pipeline = {
        "w": NamedSharding(stage0, P("data")),
        "b": NamedSharding(stage1, P()),
        "e": NamedSharding(stage1, P("data")),
        "step": NamedSharding(stage0, P()),
    }
    state = _placed(pipeline)
    with Checkpointer(directory, every_steps=1, keep=2) as ckpt:
        ckpt.save(1, state, meta={"process_count": jax.process_count()})
        assert ckpt.latest_step() == 1
        layouts = {
            "both processes": {
                "w": NamedSharding(everywhere, P("data", "model")),
                "b": NamedSharding(everywhere, P()),
                "e": NamedSharding(everywhere, P("data", "model")),
                "step": NamedSharding(everywhere, P()),
            },
            "swapped stages": {
                "w": NamedSharding(stage1, P(None, "data")),
                "b": NamedSharding(stage0, P()),
                "e": NamedSharding(stage0, P(None, "data")),
                "step": NamedSharding(stage1, P()),
            },
        }
        for what, shardings in layouts.items():
            restored = ckpt.restore(target=abstract_target(state, shardings))
            assert restored.meta == {"process_count": 2}
            _check(restored.state, shardings, what)
            print(f"restored onto {what}", flush=True)
        # Saved from arrays spanning both processes (data parallel), read into the stages.
        ckpt.save(2, _placed(layouts["both processes"]), meta={})
        assert ckpt.all_steps() == [1, 2]
        _check(ckpt.restore(target=abstract_target(state, pipeline)).state, pipeline, "stages")
        print("restored step 2 onto the stages", flush=True)
    print(f"process {me} ok", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
