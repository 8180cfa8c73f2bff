#!/usr/bin/env bash
# The headline `zipmoe bench` run on one GPU machine (H200, 16 cores, ~64 GB of disk), in
# resumable stages: each stage fits one 10-minute command, skips itself when already done
# (marker files in $WORK/.done/), and the whole sequence keeps the disk under 64 GB.
#
#   bash benchmarks/headline_gpu.sh STAGE [STAGE ...]      e.g.  ... check qwen-synth qwen-raw
#   bash benchmarks/headline_gpu.sh status                  what is done, disk use
#   bash benchmarks/headline_gpu.sh report                  the compact final tables
#   FORCE=1 bash benchmarks/headline_gpu.sh STAGE           redo a stage
#
# Stages, in order (suggested grouping into device commands of <= 10 minutes on the right):
#   check         GPU, cgroup, drop_caches, page-cache cap self-check       | call 1
#   qwen-synth    zipmoe synth qwen2_moe --preset qwen1.5-moe-a2.7b --layout fused (26.7 GiB)
#   qwen-raw      pack it with codec raw (for 'uncompressed', 26.7 GiB)     | call 1 (disk: 53.4 GiB)
#   qwen-unc      bench uncompressed at 8G,16G, batch 1,4 (one marker per budget) | call 2
#   qwen-res      bench resident (optional: every weight on the GPU, the ceiling)
#   qwen-acc8     bench accelerate at 8G  (Accelerate reads the synth folder itself: no unpack,
#   qwen-acc16    bench accelerate at 16G  and fused tensors need no offload copy)  | call 3
#   qwen-rmraw    delete the raw container (disk: 26.7 GiB)
#   qwen-pack     pack with zstd (~18 GiB; disk: ~45 GiB)
#   qwen-plan     zipmoe plan at 8G and 16G (profile measured once, calibrated on prompts)  | call 4
#   qwen-zipmoe   bench zipmoe (with plan) at 8G,16G, batch 1,4              | call 5
#   qwen-clean    delete the qwen files (disk: 0)
#   olmoe-all     the same for olmoe-1b-7b (12.9 GiB; source+raw+zstd fit at once) | call 6
#   report        final tables (qwen and olmoe)
#
# Disk at its peak: synth folder 26.7 GiB + raw container 26.7 GiB = 53.4 GiB (< 64 GB);
# never synth + raw + zstd at once. The Accelerate baseline reads the synth folder directly:
# with --layout fused the checkpoint already holds transformers-5 tensors, so Accelerate maps
# disk-offloaded weights to the original safetensors and its offload folder stays empty (with
# the split layout it would re-save every offloaded expert there, ~20 GB more).
#
# Generated tokens are few (16) and Accelerate runs stop after --time-limit once they have
# 2 tokens: the comparison is per token. All results go to $WORK/qwen.json and $WORK/olmoe.json
# (each stage merges into them), the logs to $WORK/logs/; when $OUT is set (the device machine's
# return folder) they are copied to $OUT/headline/ at the end of every call, even a failed one.
# $WORK defaults to out/headline in the repository (git-ignored, so it survives between calls
# while the machine is held; a fresh machine starts from nothing).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${WORK:-$HERE/out/headline}"
ZIPMOE="${ZIPMOE:-zipmoe}"
DEVICE="${DEVICE:-cuda}"
BUDGETS="${BUDGETS:-8G 16G}"
BATCH="${BATCH:-1,4}"
TOKENS="${TOKENS:-16}"
RUNS="${RUNS:-2}"
ACC_RUNS="${ACC_RUNS:-1}"
ACC_TIME_LIMIT="${ACC_TIME_LIMIT:-60}"
TIME_LIMIT="${TIME_LIMIT:-90}"
QWEN_PRESET="${QWEN_PRESET:-qwen1.5-moe-a2.7b}"   # tiny: a dry run of this script on a CPU
OLMOE_PRESET="${OLMOE_PRESET:-olmoe-1b-7b}"
PLAN_PROMPTS="${PLAN_PROMPTS:-builtin}"            # prompts the plans are calibrated on
BENCH_EXTRA="${BENCH_EXTRA:-}"                     # more bench options, e.g. --cold-method fadvise
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$WORK/.done" "$WORK/logs"

say() { printf '\n== %s  [%s]\n' "$*" "$(date -u +%H:%M:%S)"; }
done_mark() { touch "$WORK/.done/$1"; }
is_done() { [ -z "${FORCE:-}" ] && [ -e "$WORK/.done/$1" ]; }
free_gib() { df -Pk "$WORK" | awk 'NR==2 {printf "%d", $4/1048576}'; }
need_gib() {  # need_gib N what: stop with a clear line when the disk has less than N GiB free
    local f; f=$(free_gib)
    if [ "$f" -lt "$1" ]; then echo "headline: only ${f} GiB free in $WORK, $2 needs ${1} GiB" >&2; exit 3; fi
}
profile_arg() {  # once plan measured the disk: every engine's I/O floor from that same figure
    # (a --profile would not do for the raw container: the profile belongs to the zstd one)
    [ -e "$WORK/$1-profile.json" ] || return 0
    python3 -c "import json, sys; print('--disk-bw', int(json.load(open(sys.argv[1]))['costs']['disk_bw']))" "$WORK/$1-profile.json"
}
budget_args() { local a=""; for b in $BUDGETS; do a="$a --budget $b"; done; echo "$a"; }

# ---- model-generic stages: $1 = tag, $2 = family, $3 = preset, $4 = GiB of bf16
synth() {
    local tag=$1 fam=$2 preset=$3 gib=$4
    is_done "$tag-synth" && return
    say "$tag: synth $fam --preset $preset --layout fused"
    need_gib $((gib + 1)) "synth $preset"
    "$ZIPMOE" synth "$fam" --preset "$preset" --layout fused -o "$WORK/$tag-src" --force
    du -sh "$WORK/$tag-src"
    done_mark "$tag-synth"
}
raw() {
    local tag=$1 gib=$2
    is_done "$tag-raw" && return
    say "$tag: pack with codec raw (the 'uncompressed' engine's container)"
    need_gib $((gib + 1)) "the raw container"
    python - "$WORK/$tag-src" "$WORK/$tag-raw.zmoe" <<'EOF'
import sys, time
from zipmoe.codecs.writer import pack
t = time.time(); s = pack(sys.argv[1], sys.argv[2], codec="raw", force=True)
print(f"raw container {s.file_bytes / 2**30:.2f} GiB in {time.time() - t:.0f} s")
EOF
    done_mark "$tag-raw"
}
bench_unc() {  # uncompressed, one bench per budget, against the raw container
    local tag=$1 b
    for b in $BUDGETS; do
        is_done "$tag-unc-$b" && continue
        say "$tag: bench uncompressed at $b"
        # FILE is the raw container here (the zstd one does not exist yet): --engine picks the engine
        "$ZIPMOE" bench "$WORK/$tag-raw.zmoe" --engine uncompressed $BENCH_EXTRA $(profile_arg $tag) --budget "$b" \
            --batch "$BATCH" --new-tokens "$TOKENS" --runs "$RUNS" --cold --device "$DEVICE" --time-limit "$TIME_LIMIT" \
            --raw-container "$WORK/$tag-raw.zmoe" --work-dir "$WORK/$tag-work" \
            --json "$WORK/$tag.json" --merge 2>&1 | tee "$WORK/logs/$tag-unc-$b.log"
        done_mark "$tag-unc-$b"
    done
}
bench_res() {  # resident: every weight on the device, no budget (the ceiling, and the token reference)
    local tag=$1 file
    is_done "$tag-res" && return
    file="$WORK/$tag.zmoe"; [ -e "$file" ] || file="$WORK/$tag-raw.zmoe"
    say "$tag: bench resident"
    "$ZIPMOE" bench "$file" --engine resident $BENCH_EXTRA $(profile_arg $tag) --batch "$BATCH" --new-tokens "$TOKENS" --runs "$RUNS" --cold --device "$DEVICE" \
        --source "$WORK/$tag-src" --work-dir "$WORK/$tag-work" --json "$WORK/$tag.json" --merge 2>&1 | tee "$WORK/logs/$tag-res.log"
    done_mark "$tag-res"
}
bench_acc() {  # accelerate at one budget (slow: seconds per token)
    local tag=$1 budget=$2 file
    is_done "$tag-acc-$budget" && return
    file="$WORK/$tag.zmoe"; [ -e "$file" ] || file="$WORK/$tag-raw.zmoe"
    say "$tag: bench accelerate at $budget (time limit ${ACC_TIME_LIMIT}s per run)"
    "$ZIPMOE" bench "$file" --engine accelerate $BENCH_EXTRA $(profile_arg $tag) --budget "$budget" \
        --batch "$BATCH" --new-tokens "$TOKENS" --runs "$ACC_RUNS" --cold --device "$DEVICE" --time-limit "$ACC_TIME_LIMIT" \
        --source "$WORK/$tag-src" --work-dir "$WORK/$tag-work" --json "$WORK/$tag.json" --merge 2>&1 | tee "$WORK/logs/$tag-acc-$budget.log"
    du -sh "$WORK/$tag-work/offload" 2>/dev/null || true
    done_mark "$tag-acc-$budget"
}
rmraw() {
    local tag=$1
    is_done "$tag-rmraw" && return
    say "$tag: delete the raw container"
    rm -f "$WORK/$tag-raw.zmoe" "$WORK/$tag-work/raw.zmoe"
    done_mark "$tag-rmraw"
}
pack_zstd() {
    local tag=$1 gib=$2
    is_done "$tag-pack" && return
    say "$tag: pack (zstd)"
    need_gib $((gib * 7 / 10 + 1)) "the container"
    "$ZIPMOE" pack "$WORK/$tag-src" -o "$WORK/$tag.zmoe" --force 2>&1 | tee "$WORK/logs/$tag-pack.log"
    done_mark "$tag-pack"
}
plan() {
    local tag=$1
    is_done "$tag-plan" && return
    say "$tag: plan (profile measured once: disk, decompression, merge, compute)"
    "$ZIPMOE" plan "$WORK/$tag.zmoe" --profile-only --profile "$WORK/$tag-profile.json" --device "$DEVICE" 2>&1 | tee "$WORK/logs/$tag-profile.log"
    for b in $BUDGETS; do
        "$ZIPMOE" plan "$WORK/$tag.zmoe" --budget "$b" --calibrate "$PLAN_PROMPTS" --calibrate-tokens 16 --profile "$WORK/$tag-profile.json" \
            --device "$DEVICE" -o "$WORK/$tag-plan-$b.json" 2>&1 | tee -a "$WORK/logs/$tag-plan.log"
    done
    done_mark "$tag-plan"
}
bench_zipmoe() {  # one bench per budget: each budget has its own plan
    local tag=$1
    for b in $BUDGETS; do
        is_done "$tag-zipmoe-$b" && continue
        local planarg=""
        [ -e "$WORK/$tag-plan-$b.json" ] && planarg="--plan $WORK/$tag-plan-$b.json"
        say "$tag: bench zipmoe at $b ${planarg:+(with plan)}"
        "$ZIPMOE" bench "$WORK/$tag.zmoe" --engine zipmoe $BENCH_EXTRA --budget "$b" $planarg \
            --batch "$BATCH" --new-tokens "$TOKENS" --runs "$RUNS" --cold --device "$DEVICE" --time-limit "$TIME_LIMIT" \
            --profile "$WORK/$tag-profile.json" --work-dir "$WORK/$tag-work" --json "$WORK/$tag.json" --merge 2>&1 | tee "$WORK/logs/$tag-zipmoe-$b.log"
        done_mark "$tag-zipmoe-$b"
    done
}
ablations() {  # optional: basic eviction only / + heterogeneous pools, at the first budget
    local tag=$1 b; b=$(echo $BUDGETS | awk '{print $1}')
    is_done "$tag-ablations" && return
    say "$tag: ablations at $b"
    "$ZIPMOE" bench "$WORK/$tag.zmoe" $BENCH_EXTRA --engine zipmoe-basic --engine zipmoe-pools --budget "$b" \
        --batch 1 --new-tokens "$TOKENS" --runs "$RUNS" --cold --device "$DEVICE" \
        --profile "$WORK/$tag-profile.json" --work-dir "$WORK/$tag-work" --json "$WORK/$tag.json" --merge 2>&1 | tee "$WORK/logs/$tag-ablations.log"
    done_mark "$tag-ablations"
}
clean() {
    local tag=$1
    say "$tag: delete the model files (results stay in $WORK/$tag.json)"
    rm -rf "$WORK/$tag-src" "$WORK/$tag-raw.zmoe" "$WORK/$tag.zmoe" "$WORK/$tag-work/source" "$WORK/$tag-work/raw.zmoe" "$WORK/$tag-work/offload"
    done_mark "$tag-clean"
}
report() {
    for tag in qwen olmoe; do
        [ -e "$WORK/$tag.json" ] || continue
        say "$tag"
        "$ZIPMOE" bench --report "$WORK/$tag.json" --compact
    done
}

check() {
    # Every probe has its own timeout: on the H200 machine (2026-11-29) this stage printed the
    # GPU line and then nothing for 9 minutes, and the next call on the same machine printed
    # nothing at all (suspected: the cgroup page-cache self-check or drop_caches wedging the
    # Firecracker VM's page cache). The cgroup self-check now only runs with CGROUP_CHECK=1.
    say "check: machine"
    timeout 20 nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || echo "no nvidia-smi"
    timeout 120 python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())" || echo "torch check failed or timed out"
    timeout 60 python -c "import accelerate; print('accelerate', accelerate.__version__)" || echo "accelerate missing: pip install 'zipmoe[bench]'"
    nproc; free -g | head -2; df -h "$WORK" | tail -1
    if [ -n "${CGROUP_CHECK:-}" ]; then
        say "check: memory cgroup and page-cache cap (reads 1.5 GiB in a 512 MiB cgroup)"
        timeout 120 python -m zipmoe.runtime.bench.cgroup | tee "$WORK/logs/cgroup-check.json" | grep --line-buffered -E '"usable"|"reason"|observation' || echo "cgroup check failed or timed out"
    fi
    say "check: drop_caches"
    if timeout 60 sh -c 'sync && echo 1 > /proc/sys/vm/drop_caches' 2>/dev/null; then echo "drop_caches: permitted"; else echo "drop_caches: not permitted or timed out (bench falls back to fadvise DONTNEED per file)"; fi
}

status() {
    echo "work folder: $WORK   free: $(free_gib) GiB"
    echo "done: $(ls "$WORK/.done" 2>/dev/null | tr '\n' ' ')"
    du -sh "$WORK"/* 2>/dev/null || true
}

copy_out() {  # on the lent device machine, $OUT is what comes back: results, plans, logs
    if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
        mkdir -p "$OUT/headline"
        cp -r "$WORK"/*.json "$WORK/logs" "$OUT/headline/" 2>/dev/null || true
    fi
}
trap copy_out EXIT

[ $# -gt 0 ] || { sed -n '2,35p' "$0"; exit 0; }
for stage in "$@"; do
    case "$stage" in
        check) check ;;
        status) status ;;
        qwen-synth) synth qwen qwen2_moe "$QWEN_PRESET" 27 ;;
        qwen-raw) raw qwen 27 ;;
        qwen-unc) bench_unc qwen ;;
        qwen-res) bench_res qwen ;;
        qwen-acc8) bench_acc qwen 8G ;;
        qwen-acc16) bench_acc qwen 16G ;;
        qwen-acc) for b in $BUDGETS; do bench_acc qwen "$b"; done ;;
        qwen-rmraw) rmraw qwen ;;
        qwen-pack) pack_zstd qwen 27 ;;
        qwen-plan) plan qwen ;;
        qwen-zipmoe) bench_zipmoe qwen ;;
        qwen-ablations) ablations qwen ;;
        qwen-clean) clean qwen ;;
        olmoe-all)
            synth olmoe olmoe "$OLMOE_PRESET" 13; raw olmoe 13; pack_zstd olmoe 13; plan olmoe
            bench_unc olmoe; bench_zipmoe olmoe; for b in $BUDGETS; do bench_acc olmoe "$b"; done ;;
        olmoe-synth) synth olmoe olmoe "$OLMOE_PRESET" 13 ;;
        olmoe-raw) raw olmoe 13 ;;
        olmoe-pack) pack_zstd olmoe 13 ;;
        olmoe-plan) plan olmoe ;;
        olmoe-unc) bench_unc olmoe ;;
        olmoe-res) bench_res olmoe ;;
        olmoe-zipmoe) bench_zipmoe olmoe ;;
        olmoe-acc) for b in $BUDGETS; do bench_acc olmoe "$b"; done ;;
        olmoe-clean) clean olmoe ;;
        report) report ;;
        *) echo "headline: unknown stage '$stage' (run without arguments for the list)" >&2; exit 2 ;;
    esac
done
