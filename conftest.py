"""Test set-up for tests/ and the docstring examples in shardplan/: 8 fake CPU devices,
configured before jax initialises its backend, and sp.auto's plan files in temporary
directories."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _plan_cache(tmp_path_factory, monkeypatch):
    """Each test keeps sp.auto's plan files in a directory of its own (never ~/.cache)."""
    monkeypatch.setenv("SHARDPLAN_CACHE_DIR", str(tmp_path_factory.mktemp("plans")))


# Scripts the tests run in subprocesses (they join a jax.distributed job when imported): not
# modules whose docstring examples pytest may import.
collect_ignore_glob = ["tests/data/*.py"]
