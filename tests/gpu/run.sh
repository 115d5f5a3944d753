#!/usr/bin/env bash
# On a machine with a CUDA GPU: run the GPU tests and the engine benchmark there,
# in under 8 minutes, writing logs and the benchmark's JSON to $OUT (default
# ./gpu-results). Such machines may have no network and another torch than the
# one pyproject.toml pins: Kervan runs from the checkout (PYTHONPATH), on the
# machine's own torch, and the packages it lacks come from wheels in .whl/ when
# that folder exists (see tests/gpu/README.md for how to fill it).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-results}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/kervan-site .whl/*.whl || exit 1
  export PYTHONPATH="$PYTHONPATH:/tmp/kervan-site"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -m control_plane.cli info --json | tee "$out/info.json"
# the tests need no network: tiny models from a seeded init, a local redis-server
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$out/pytest.log"
status=${PIPESTATUS[0]}
timeout 150 python3 -m benchmarks.engine_throughput --device cuda --vocab-size 32000 --dtype bfloat16,float32 \
  --num-requests 64 --repeat 2 > "$out/engine_throughput.json" 2> "$out/engine_throughput.err"
bench=$?
# decode steps replaying CUDA graphs against eager, per batch bucket
timeout 100 python3 -m benchmarks.parallel --device cuda --dtype bfloat16 --buckets 1,8,32 --steps 20 \
  > "$out/parallel_cuda.json" 2> "$out/parallel_cuda.err"
echo "tests exit $status; benchmarks exit $bench and $?"
exit "$status"
