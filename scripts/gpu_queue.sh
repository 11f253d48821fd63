#!/usr/bin/env bash
# The GPU work of the open issues as one queue, for a lent machine that is scarce and goes back
# after 30 s idle: each call runs the next stages that fit its time, and a later call resumes.
#
#   bash scripts/gpu_queue.sh           # the next stages that fit in BUDGET seconds (540)
#   bash scripts/gpu_queue.sh --list    # every stage: its estimate and state (done, failed)
#   ONLY="suite long-1b" bash scripts/gpu_queue.sh   # these stages alone, in queue order
#
# Run from the checkout's root on the GPU machine once the wheel chunks are there (GPU.md).
# A stage starts only when the stage it needs is done and its estimate fits the time left; it
# runs under `timeout` of the time left, so the call ends before the device's per-call limit.
# A stage that succeeds is marked done and never runs again (FORCE=1 runs it anyway); one that
# fails or times out is marked failed and the queue goes on (the next call retries it last).
# State: $STATE (default /tmp/gpu_queue), kept while the machine stays warm; logs and results:
# $OUT (default /tmp/gpu_queue/out), a folder per stage. DRY_RUN=1 prints what would run, running nothing.
# GPU_QUEUE_STAGES (lines of "name|seconds|needs|command") replaces the queue (for tests).
set -uo pipefail
cd "$(dirname "$0")/.."
STATE="${STATE:-/tmp/gpu_queue}"
export OUT="${OUT:-$STATE/out}"
BUDGET="${BUDGET:-540}"
mkdir -p "$STATE" "$OUT"
# the card's short name (h100, h200) for result files; "gpu" where nvidia-smi is absent
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oiE 'h[0-9]{3}' | tr 'H' 'h')"
export GPU="${GPU:-gpu}"
export PYTHONPATH="/opt/kvl:/opt/devwheels${PYTHONPATH:+:$PYTHONPATH}"
M1=/opt/models/llama-3.2-1b-random-fp16-cuda-seq-major
PROFILE=(python3 tools/perf/step_profile.py "$M1" --provider cuda --batch 64 --capacity 33792
         --kv-budget 42949672960 --modes packed)
COLD=(--flush-l2 --breakdown --prefill= --heads 32/8/128,28/4/128,9/3/64,4/1/256
      --decode 1x1024,1x4096,1x16384,1x32768,8x4096,8x16384)

# name, estimated seconds, the stage it needs done, command (in priority order: the serving
# engine's runs (the pipeline first), then the quantized decode, then the cluster (its stage
# needs the chunks of scripts/stage_device_ray.sh carried: .device/ray0..), then the 8B shape,
# which removes the 1B models to fit the disk)
STAGES=(
  "setup|180||bash scripts/gpu_serving.sh build"
  "models-1b|100|setup|bash scripts/gpu_serving.sh models"
  "tests-pipeline|40|setup|python3 -m pytest -q -m gpu -p no:cacheprovider tests/serve/test_engine_gpu.py -k pipelined"
  "profile-pipeline|200|models-1b|${PROFILE[*]} --requests 256 --prompt 64:512 --output 64:512 --pipeline off,on --json \$OUT/step-profile-\$GPU-1b-chat-pipeline.json"
  "ab-upload|420|models-1b|python3 tools/perf/ab_python.py --out \$OUT/ab --rounds 2 --json \$OUT/step-profile-\$GPU-1b-chat-upload.json 254f532 8beed9c 2d6836e -- ${PROFILE[*]:2} --requests 256 --prompt 64:512 --output 64:512 --pipeline on"
  "profile-switch|200|models-1b|${PROFILE[*]} --requests 256 --prompt 64:512 --output 64:512 --pipeline on --switch-interval 5,0.5 --json \$OUT/step-profile-\$GPU-1b-chat-switch.json"
  "chat-pipeline|200|models-1b|PIPELINE=off,on SYSTEMS=engine DEADLINE=60 bash scripts/gpu_serving.sh chat"
  "chat-wait|100|models-1b|PREFILL_WAIT=0,16 SYSTEMS=engine DEADLINE=60 bash scripts/gpu_serving.sh chat"
  "tests-quick|90|setup|python3 -m pytest -q -m gpu -p no:cacheprovider tests/runtime/test_kv_cache_gpu.py tests/serve/test_engine_gpu.py"
  "quant-cold|100|setup|python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/op/test_gqa_cuda_quant.py && python3 bench/bench_cuda.py --flush-l2 --breakdown --prefill= --kv-quant int8-per-channel,int4-per-channel,int8-per-token --heads 32/8/128,9/3/64 --decode 1x16384,1x32768,8x16384,1x65536 --json \$OUT/cuda-quant-\$GPU-cold.json"
  "profile-chat|90|models-1b|${PROFILE[*]} --requests 256 --prompt 64:512 --output 64:512 --cprofile 40 --json \$OUT/step-profile-\$GPU-1b-chat.json"
  "profile-chat-wait|90|models-1b|${PROFILE[*]} --requests 256 --prompt 64:512 --output 64:512 --prefill-wait 16 --json \$OUT/step-profile-\$GPU-1b-chat-wait.json"
  "profile-cold|150|models-1b|${PROFILE[*]} --prompt 256 --output 128 --commit-ahead on,off --cprofile 40 --json \$OUT/step-profile-\$GPU-1b.json"
  "profile-nograph|120|models-1b|${PROFILE[*]} --prompt 256 --output 128 --no-cuda-graph --json \$OUT/step-profile-\$GPU-1b-nograph.json"
  "cold-decode|90|setup|python3 bench/bench_cuda.py ${COLD[*]} --json \$OUT/cuda-\$GPU-cold.json"
  "chat|200|models-1b|SYSTEMS=engine,genai-paged DEADLINE=60 bash scripts/gpu_serving.sh chat"
  "long-ahead|300|models-1b|RATE=inf COMMIT_AHEAD=off,on SYSTEMS=engine DEADLINE=120 bash scripts/gpu_serving.sh long"
  "ab-prepared|280|models-1b|python3 tools/perf/ab_python.py --out \$OUT/ab --rounds 2 --json \$OUT/step-profile-\$GPU-1b-chat-prepared.json 4ef8bfc d263aec -- ${PROFILE[*]:2} --requests 256 --prompt 64:512 --output 64:512 --pipeline on"
  "profile-graphed|260|models-1b|python3 -m pytest -q -m gpu -p no:cacheprovider tests/serve/test_engine_gpu.py -k graphed && ${PROFILE[*]} --requests 256 --prompt 64:512 --output 64:512 --pipeline on --graph-chunk 0,64,128 --json \$OUT/step-profile-\$GPU-1b-chat-graphed.json"
  "profile-fed|200|models-1b|python3 -m pytest -q -m gpu -p no:cacheprovider tests/serve/test_engine_gpu.py -k device_fed && ${PROFILE[*]} --requests 256 --prompt 64:512 --output 64:512 --pipeline on --device-ids off,on --json \$OUT/step-profile-\$GPU-1b-chat-fed.json"
  "long-1b|330|models-1b|RATE=inf CHUNK=1024,4096 SYSTEMS=engine,genai-paged DEADLINE=120 bash scripts/gpu_serving.sh long"
  "quant-1b|300|models-1b|KV_QUANT=none,int8-per-token RATE=inf DEADLINE=120 bash scripts/gpu_serving.sh quant"
  "suite|240|setup|bash scripts/run_gpu_tests.sh"
  "sanitizer|150|setup|SANITIZER=memcheck SUITE=0 SAN_EXTRA_K=query_seqlens bash scripts/run_gpu_tests.sh"
  "ncu-int8|150|setup|SKIP=0 COUNT=64 BENCH_ARGS='--kv-quant int8-per-channel' KERNELS=DecodeTc bash tools/perf/ncu_decode.sh 32/8/128 1x16384"
  "quant-wide|90|setup|for w in 0 1; do for s in 0 24 33; do ORT_KVLAYOUT_DECODE_WIDE=\$w ORT_KVLAYOUT_DECODE_SPLITS=\$s python3 bench/bench_cuda.py --flush-l2 --breakdown --prefill= --kv-quant int8-per-channel --heads 32/8/128 --decode 1x16384,1x32768 --json \$OUT/cuda-quant-\$GPU-cold-splits\$s-wide\$w.json || exit 1; done; done"
  "ncu-int8-source|200|setup|SOURCE=1 SKIP=2 OUT_DIR=\$OUT/ncu BENCH_ARGS='--kv-quant int8-per-channel' KERNELS='Li128ELNS0_10DecodeFormE2ELi8EaEE Li128ELNS0_10DecodeFormE2ELi4ES2_EE' bash tools/perf/ncu_decode.sh 32/8/128 1x16384"
  "quant-splits|120|setup|for s in 0 4 8 16 32 64; do ORT_KVLAYOUT_DECODE_SPLITS=\$s python3 bench/bench_cuda.py --flush-l2 --breakdown --prefill= --kv-quant int8-per-channel --heads 32/8/128 --decode 1x16384,8x16384 --json \$OUT/cuda-quant-\$GPU-cold-splits\$s.json || exit 1; done"
  "cluster-1gpu|300|setup|bash .device/ray0/install-device-ray && python3 bench/bench_serving.py --model-shape smollm2-135m --build-dir /opt/models --provider cuda --systems server,cluster --replicas 1,2 --gpus-per-replica 0.5 --kv-budget 8589934592 --max-batch 32 --dataset chat --num-requests 256 --deadline 120 --repeat 2 --json \$OUT/serving-\$GPU-smollm2-cluster.json"
  "cluster-overhead|300|setup|bash .device/ray0/install-device-ray && python3 bench/bench_serving.py --model-shape smollm2-135m --build-dir /opt/models --provider cuda --systems server,cluster --replicas 1 --ingress haproxy,proxy --kv-budget 8589934592 --max-batch 32 --dataset chat --num-requests 256 --deadline 120 --repeat 3 --json \$OUT/serving-\$GPU-smollm2-cluster-overhead.json"
  "cluster-ttft|240|setup|bash .device/ray0/install-device-ray && python3 bench/bench_serving.py --model-shape smollm2-135m --build-dir /opt/models --provider cuda --systems server,cluster --replicas 1 --kv-budget 8589934592 --max-batch 32 --dataset chat --num-requests 256 --request-rate 20 --deadline 120 --repeat 3 --json \$OUT/serving-\$GPU-smollm2-cluster-ttft.json"
  "cluster-ngpu|600|setup|N=\$(nvidia-smi -L | wc -l); [ \"\$N\" -ge 2 ] || { echo \"cluster-ngpu needs several GPUs, \$N visible\"; exit 1; }; bash .device/ray0/install-device-ray && python3 bench/bench_serving.py --model-shape smollm2-135m --build-dir /opt/models --provider cuda --systems server,cluster --replicas 1,\$N --kv-budget 8589934592 --max-batch 32 --dataset chat --num-requests \$((256 * N)) --deadline 240 --repeat 2 --json \$OUT/serving-\$GPU-smollm2-cluster-\${N}gpu.json"
  "models-8b|500|setup|rm -rf /opt/models/llama-3.2-1b*; SHAPE=llama-3.1-8b DROP_HF=1 NO_PAGED=1 bash scripts/gpu_serving.sh models"
  "prealloc-8b|480|models-8b|SHAPE=llama-3.1-8b CAPACITY=131072 RATE=inf DEADLINE=200 bash scripts/gpu_serving.sh prealloc"
  "quant-8b|480|models-8b|SHAPE=llama-3.1-8b KV_QUANT=none,int8-per-token RATE=inf DEADLINE=200 bash scripts/gpu_serving.sh quant"
)
if [ -n "${GPU_QUEUE_STAGES:-}" ]; then
  mapfile -t STAGES <<<"$GPU_QUEUE_STAGES"
fi

state_of() {
  if [ -e "$STATE/$1.done" ]; then echo done
  elif [ -e "$STATE/$1.failed" ]; then echo failed
  else echo pending
  fi
}

selected() {  # a stage ONLY names (all without ONLY)
  [ -z "${ONLY:-}" ] && return 0
  case " $ONLY " in *" $1 "*) return 0 ;; esac
  return 1
}

if [ "${1:-}" = "--list" ]; then
  for stage in "${STAGES[@]}"; do
    IFS='|' read -r name estimate needs command <<<"$stage"
    printf '%-16s %4s s  %-8s %s\n' "$name" "$estimate" "$(state_of "$name")" "$command"
  done
  exit 0
fi
[ $# -eq 0 ] || { sed -n 2,16p "$0"; exit 2; }

# pending stages first, then those that failed before (retried last)
order=()
for pass in pending failed; do
  for stage in "${STAGES[@]}"; do
    IFS='|' read -r name _ _ _ <<<"$stage"
    selected "$name" || continue
    [ "${FORCE:-0}" = 1 ] && [ "$pass" = pending ] && [ "$(state_of "$name")" = done ] && order+=("$stage")
    [ "$(state_of "$name")" = "$pass" ] && order+=("$stage")
  done
done

start=$SECONDS
ran=0
for stage in "${order[@]}"; do
  IFS='|' read -r name estimate needs command <<<"$stage"
  left=$((BUDGET - (SECONDS - start)))
  if [ -n "$needs" ] && [ "$(state_of "$needs")" != done ] && [ "${DRY_RUN:-0}" != 1 ]; then
    echo "== $name: waits for $needs"
    continue
  fi
  if [ "$estimate" -gt "$left" ]; then
    echo "== $name: needs ~${estimate} s, ${left} s left: next call"
    continue
  fi
  echo "== $name (~${estimate} s, ${left} s left): $command"
  ran=$((ran + 1))
  [ "${DRY_RUN:-0}" = 1 ] && { start=$((start - estimate)); continue; }
  t0=$SECONDS
  # each stage writes under its own folder, so stages that name the same file keep both
  mkdir -p "$OUT/$name"
  OUT="$OUT/$name" timeout --signal=INT --kill-after=10 "$left" bash -c "$command" >"$OUT/$name.log" 2>&1
  rc=$?
  tail -15 "$OUT/$name.log"
  if [ "$rc" -eq 0 ]; then
    rm -f "$STATE/$name.failed"
    touch "$STATE/$name.done"
    echo "== $name: done in $((SECONDS - t0)) s"
  else
    touch "$STATE/$name.failed"
    echo "== $name: FAILED (exit $rc) after $((SECONDS - t0)) s; log $OUT/$name.log"
  fi
done
[ "$ran" -gt 0 ] || echo "== nothing fits or nothing is left (--list shows the queue)"
