#!/usr/bin/env bash
# The serving runs on the GPU machine (shared/GPU.md), stage by stage, from the checkout's root:
#
#   bash scripts/gpu_serving.sh setup      # onnxruntime-gpu wheels, the package (CUDA), 1B models
#   bash scripts/gpu_serving.sh build      # the same without the models
#   bash scripts/gpu_serving.sh models     # the SHAPE's models alone (SHAPE=llama-3.1-8b DROP_HF=1)
#   bash scripts/gpu_serving.sh tests      # the GPU tests of the op's sampler and the engine
#   bash scripts/gpu_serving.sh profile    # tools/perf/step_profile.py, served against host
#                                          (MODES=device PROFILE_ARGS="--overlap on,off")
#   bash scripts/gpu_serving.sh chat       # bench_serving chat: engine (both graphs), og paged
#                                          (SYSTEMS= another list)
#   bash scripts/gpu_serving.sh long       # bench_serving long mix: engine, og paged
#   bash scripts/gpu_serving.sh prealloc   # long mix: growable against preallocated slots
#   bash scripts/gpu_serving.sh quant      # long mix: fp16 against quantized KV caches (KV_QUANT=)
#
# setup needs the wheel chunks in .device/wheels0..5 (shared/tools/stage-device-wheels) and the
# ORT and cuDNN-frontend headers in .device/hdr/{ort,cudnn_frontend/include}. Results go to $OUT (or
# /tmp/gpu_serving); bench JSON to bench/results/ there too. SHAPE (default llama-3.2-1b),
# KV_BUDGET (KV bytes, default 40 GiB; not BUDGET: gpu_queue.sh's seconds reach its stages),
# CAPACITY (33792), MAX_BATCH (64), PACKING (the engine's
# --packing list, default auto), OVERLAP (--overlap list, default auto), COMMIT_AHEAD
# (--commit-ahead list, default auto), PREFILL_WAIT (--prefill-wait list, default auto), PIPELINE
# (--pipeline list, default auto), CHUNK (prefill tokens a
# step: the engine's default (auto) for chat, 4096 for the long mix;
# a list runs each), RATE (the long mix's requests a second, 2; inf: all at once) and DEADLINE
# (seconds a system may run, 420) are the run's settings.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_serving}"
mkdir -p "$OUT"
SHAPE="${SHAPE:-llama-3.2-1b}"
KV_BUDGET="${KV_BUDGET:-42949672960}"
CAPACITY="${CAPACITY:-33792}"
MAX_BATCH="${MAX_BATCH:-64}"
MODELS="${MODELS:-/opt/models}"
export PYTHONPATH="/opt/kvl:/opt/devwheels${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
BASE="$MODELS/$SHAPE-random-fp16-cuda"
COMMON=(--model-shape "$SHAPE" --build-dir "$MODELS" --provider cuda --kv-budget "$KV_BUDGET"
        --capacity "$CAPACITY" --max-batch "$MAX_BATCH" --stall-timeout 60
        --deadline "${DEADLINE:-420}" --packing "${PACKING:-auto}" --overlap "${OVERLAP:-auto}"
        --commit-ahead "${COMMIT_AHEAD:-auto}" --prefill-wait "${PREFILL_WAIT:-auto}"
        --pipeline "${PIPELINE:-auto}")

case "${1:-}" in
  setup|build)  # build: the wheels and the package alone (models: the next stage)
    bash .device/wheels0/install-device-wheels || exit
    t0=$SECONDS
    ORT_INCLUDE_DIR="$PWD/.device/hdr/ort" \
    CUDNN_FRONTEND_INCLUDE_DIR="$PWD/.device/hdr/cudnn_frontend/include" \
    CMAKE_ARGS="-DORT_KVLAYOUT_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real" \
      python3 -m pip install -q --no-deps --no-build-isolation --upgrade --target /opt/kvl . \
      >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
    echo "package built in $((SECONDS - t0)) s"
    python3 -c "import ort_kvlayout as k; print(k.__file__, k.build_info())"
    [ "$1" = build ] || exec bash "$0" models
    ;;
  models)
    # the 8B shape: DROP_HF=1 deletes the Hugging Face folder once the builder's models exist,
    # NO_PAGED=1 skips og.Engine's paged model (for the engine's own stages: prealloc, quant)
    python3 bench/bench_serving.py "${COMMON[@]}" --build-only ${DROP_HF:+--drop-hf} \
      ${NO_PAGED:+--no-paged}
    df -h / | tail -1
    ;;
  tests)
    python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/op/test_sample_op.py \
      tests/serve/test_engine_gpu.py tests/op/test_cuda_graph.py 2>&1 |
      tee "$OUT/gpu_tests.log" | tail -30
    ;;
  profile)
    python3 tools/perf/step_profile.py "$BASE-seq-major" --provider cuda --batch "$MAX_BATCH" \
      --prompt 256 --output 128 --capacity "$CAPACITY" --kv-budget "$KV_BUDGET" \
      --modes "${MODES:-device,host}" ${PROFILE_ARGS:-} --json "$OUT/step-profile.json"
    ;;
  chat)
    python3 bench/bench_serving.py "${COMMON[@]}" --dataset chat --num-requests 256 \
      --request-rate inf --prefill-chunk "${CHUNK:-auto}" \
      --systems "${SYSTEMS:-engine,engine-host,genai-paged}" \
      --json "$OUT/serving-chat.json"
    ;;
  long)
    python3 bench/bench_serving.py "${COMMON[@]}" --dataset long --num-requests 64 \
      --request-rate "${RATE:-2}" --prefill-chunk "${CHUNK:-4096}" \
      --systems "${SYSTEMS:-engine,genai-paged}" \
      --json "$OUT/serving-long.json"
    ;;
  quant)
    python3 bench/bench_serving.py "${COMMON[@]}" --dataset long --num-requests 64 \
      --request-rate "${RATE:-2}" --prefill-chunk "${CHUNK:-4096}" --systems engine \
      --kv-quant "${KV_QUANT:-none,int8-per-token,fp8-per-token}" \
      --json "$OUT/serving-long-kvquant.json"
    ;;
  prealloc)
    python3 bench/bench_serving.py "${COMMON[@]}" --dataset long --num-requests 64 \
      --request-rate "${RATE:-2}" --prefill-chunk "${CHUNK:-4096}" --cache growable,preallocated \
      --systems engine --json "$OUT/serving-long-prealloc.json"
    ;;
  *)
    sed -n 2,18p "$0"
    exit 2
    ;;
esac
