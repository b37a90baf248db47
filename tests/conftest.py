"""Test set-up: 8 fake CPU devices, configured before jax initialises its backend."""

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
