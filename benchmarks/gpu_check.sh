#!/usr/bin/env bash
# Everything shardplan checks on a GPU, in one call of under 8 minutes (the device tool lends a
# machine with one GPU for 15 minutes a session, to some tasks only).
#
#   bash benchmarks/gpu_check.sh --prepare   # here, once: fetch the wheels the GPU image lacks
#   bash benchmarks/gpu_check.sh             # there (device `run`, carry [".whl"]), in the repo
#
# The GPU image (Python 3.12, jax 0.11.x with CUDA) has jax, flax, optax, orbax, rich and
# pyyaml but not ortools, which `import shardplan` needs (the planner); --prepare downloads
# ortools, immutabledict and the protobuf this ortools needs (6.33) as Python 3.12 wheels into
# .whl/ (git-ignored, about 30 MB), and the run installs them into /tmp/site, ahead of the
# image's packages, when the import fails.
#
# The run:
#   1. prints the devices and versions;
#   2. benchmarks/kernels.py on the GPU (Pallas compiled for Triton, not interpreted): flash
#      attention forward and forward + backward against cuDNN and XLA attention at sequence
#      1k-16k, head dim 64 and 128, causal, bf16, and the grouped matmul against a dense matmul
#      of equal FLOPs; each shape's error against the reference is recorded too (CI checks
#      numerics on CPU only). Writes benchmarks/results/kernels_gpu.json and copies it, with the
#      log, to $OUT (the device tool brings $OUT back).
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--prepare" ]; then
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  mkdir -p .whl
  for spec in "ortools==$(python3 -c 'import ortools; print(ortools.__version__)' 2>/dev/null \
               || .venv/bin/python -c 'import ortools; print(ortools.__version__)')" \
              immutabledict \
              "protobuf==$(.venv/bin/python -c 'import google.protobuf as p; print(p.__version__)')"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$spec" || exit 1
  done
  ls -la .whl
  exit 0
fi

OUT="${OUT:-/tmp/gpu_check}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
exec > >(tee "$OUT/gpu_check.log") 2>&1
started=$(date +%s)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! python3 -c "import shardplan" 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
  fi
fi
python3 - <<'PY' || exit 1
import jax, platform
import shardplan
print(f"python {platform.python_version()}, jax {jax.__version__}, backend {jax.default_backend()}")
print("devices:", jax.devices())
assert jax.default_backend() == "gpu", "no GPU: run this on the device machine"
PY

# Kernel throughput and numerics; stop early enough to write results inside 8 minutes.
timeout 400 python3 benchmarks/kernels.py --repeats 10 --out "$OUT/kernels_gpu.json"
status=$?
cp -f "$OUT/kernels_gpu.json" benchmarks/results/kernels_gpu.json 2>/dev/null
echo "gpu_check: kernels.py exited $status after $(( $(date +%s) - started )) s"
exit $status
