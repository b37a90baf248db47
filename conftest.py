"""Test set-up for tests/ and the docstring examples in shardplan/: 8 fake CPU devices,
configured before jax initialises its backend, and sp.auto's plan files in temporary
directories."""

import os

# LLVM's optimisation of the CPU code is switched off: it is most of XLA's compile time for the
# tiny programs the tests run, and it acts below HLO, so the optimised HLO, its buffer
# assignment (the compiled memory the tests check plans against) and its collectives are the
# same as at the default level; only float rounding in the generated loops may differ, inside
# the tests' 1e-4. Subprocesses the tests start inherit both flags.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
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
