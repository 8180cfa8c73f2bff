#!/usr/bin/env bash
# MoE-Infinity (github.com/EfficientMoE/MoE-Infinity) built from its source into a folder of its
# own, the *site*, for `zipmoe bench --baseline moe-infinity --moe-infinity-site SITE`.
#
#   benchmarks/moe_infinity_build.sh bundle [DIR]     on a machine with the network (default DIR: .moei
#                        in the checkout): the two sources as tarballs, CUTLASS's headers, and the
#                        wheels MoE-Infinity pins, for a build box that has no network
#   benchmarks/moe_infinity_build.sh build REF SITE [WORK]
#                        on the GPU box: REF is dev (61840f5, the newest code: _store extension,
#                        Qwen3-MoE) or main (d617801: the C++ prefetch op); the source from the
#                        bundle, patched with benchmarks/moe_infinity/REF.patch, compiled against this
#                        box's own torch (python3), the pinned wheels and the package installed into
#                        SITE; SITE/ZIPMOE_BUILD.json says what was built and how the import went
#   benchmarks/moe_infinity_build.sh check SITE        does moe_infinity import from SITE (in a child process)
#   benchmarks/moe_infinity_build.sh diagnose SITE VIEW STORE [WORK]
#                        MoE(VIEW) and 4 tokens under a preloaded crash handler: on a fatal signal,
#                        the faulting thread and its native backtrace (addr2line), with
#                        MoE-Infinity's trace log (WORK/diagnose.log)
#
# Settings (environment): BUNDLE (the bundle folder, default .moei in the checkout), PYTHON
# (python3: the interpreter whose torch the extension is built against), MAX_JOBS (the compile's
# parallel jobs, default the cores), CUDA_ARCH (e.g. 9.0; default the first GPU's capability),
# MOEI_GIT, CUTLASS_GIT (bundle: a clone or URL of each repository), PY_VERSION (bundle: the build
# box's Python, default 3.12).
#
# What the site holds: moe_infinity (with its compiled extension) and the Python packages it pins
# that zipmoe's own environment must not see (transformers 4.53.0, tokenizers 0.21, huggingface_hub
# 0.36, accelerate 1.8, pydantic 1.10.13, nvtx). torch, safetensors, numpy and the rest come from
# the interpreter's own site-packages. flash-attn, auto_gptq, optimum, datasets, FlashInfer and the
# OpenAI server's packages are left out: the offloading engine does not need them (the patches say
# where its imports had to be made optional). docs/bench.md explains each patch.
set -uo pipefail

SELF=$(readlink -f "${BASH_SOURCE[0]}")
REPO=$(cd "$(dirname "$SELF")/.." && pwd)
BUNDLE=${BUNDLE:-$REPO/.moei}
PYTHON=${PYTHON:-python3}
DEV_REF=61840f5 MAIN_REF=d617801 CUTLASS_TAG=v3.9.2
# the packages MoE-Infinity's requirements.txt pins (dev), or that those pins need at their versions
WHEELS="transformers==4.53.0 tokenizers==0.21.4 huggingface_hub==0.36.2 accelerate==1.8.1 pydantic==1.10.13 nvtx==0.2.17"

die() { echo "moe_infinity_build: $*" >&2; exit 1; }
usage() { sed -n '2,/^set -uo/{/^#/s/^# \{0,1\}//p}' "$SELF"; }

ref_commit() { case $1 in dev) echo $DEV_REF ;; main) echo $MAIN_REF ;; *) die "unknown ref '$1': dev or main" ;; esac; }

bundle() {  # the sources, CUTLASS's headers and the wheels into DIR
    local dir=${1:-$BUNDLE} moei=${MOEI_GIT:-https://github.com/EfficientMoE/MoE-Infinity} cut=${CUTLASS_GIT:-https://github.com/NVIDIA/cutlass}
    local tmp r c
    mkdir -p "$dir/wheels" || die "cannot make $dir"
    tmp=$(mktemp -d)
    for r in "$moei" "$cut"; do  # a local repository is read in place, a URL cloned without blobs
        [ -d "$r" ] && continue
        git clone -q --filter=blob:none --no-checkout "$r" "$tmp/${r##*/}" || die "cannot clone $r"
    done
    [ -d "$moei" ] || moei=$tmp/${moei##*/}
    [ -d "$cut" ] || cut=$tmp/${cut##*/}
    for r in dev main; do
        c=$(ref_commit $r)
        git -C "$moei" archive --prefix="moe-infinity-$r-$c/" "$c" | gzip -6 > "$dir/moe-infinity-$r-$c.tar.gz" \
            || die "git archive $c of $moei failed"
    done
    git -C "$cut" archive --prefix=cutlass/ "$CUTLASS_TAG" include tools/util/include LICENSE.txt | gzip -6 \
        > "$dir/cutlass-$CUTLASS_TAG-include.tar.gz" || die "git archive $CUTLASS_TAG of $cut failed"
    local py=${PY_VERSION:-3.12}
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp --abi "cp${py/./}" \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
        -d "$dir/wheels" $WHEELS || die "pip download failed"
    rm -rf "$tmp"
    ls -la "$dir" "$dir/wheels"
}

cuda_paths() {  # WORK: what the compile and link need beyond CUDA_HOME's nvcc and runtime: the library
    # headers torch's own headers include (cublas_v2.h, cusparse.h, ...) from torch's nvidia-* wheels
    # when CUDA_HOME lacks them (CPATH), and unversioned names for the libraries those wheels and the
    # driver have only as lib*.so.N (-lcuda), linked in WORK/cuda-lib (LIBRARY_PATH)
    local work=$1 home out inc lib
    home=$("$PYTHON" -c 'from torch.utils import cpp_extension as c; print(c.CUDA_HOME or "/usr/local/cuda")' 2>/dev/null)
    out=$("$PYTHON" - "$work/cuda-lib" "$home" <<'PY'
import glob, os, site, subprocess, sys
shim, home = sys.argv[1], sys.argv[2]
roots = [os.path.join(p, "nvidia") for p in site.getsitepackages() + [site.getusersitepackages()]
         if os.path.isdir(os.path.join(p, "nvidia"))]
incs, found = [], []
if not os.path.exists(os.path.join(home, "include", "cublas_v2.h")):
    for r in roots:
        incs += [d for d in sorted(glob.glob(os.path.join(r, "**", "include"), recursive=True)) if glob.glob(os.path.join(d, "*.h"))]
    found += [f for r in roots for f in sorted(glob.glob(os.path.join(r, "**", "lib", "lib*.so.*"), recursive=True))]
# the driver library: the toolkit's stub, else the driver's own libcuda.so.1 under the name -lcuda looks for
if not glob.glob(os.path.join(home, "lib64", "stubs", "libcuda.so")):
    try:
        cache = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout.split("\n")
    except OSError:
        cache = []
    paths = [ln.split("=>")[-1].strip() for ln in cache if "libcuda.so" in ln and "=>" in ln]
    if not any(p.endswith("/libcuda.so") for p in paths):
        found += [p for p in paths if p.endswith("libcuda.so.1")][:1]
for f in found:
    os.makedirs(shim, exist_ok=True)
    link = os.path.join(shim, os.path.basename(f).split(".so")[0] + ".so")
    if not os.path.lexists(link):
        os.symlink(f, link)
print(":".join(incs) or "-", shim if found else "-")
PY
    )
    read -r inc lib <<< "$out"
    [ "${inc:--}" != - ] && export CPATH="$inc${CPATH:+:$CPATH}"
    [ "${lib:--}" != - ] && export LIBRARY_PATH="$lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
    echo "== CUDA: $home; headers added: ${inc:--}; unversioned library links: ${lib:--} $([ "${lib:--}" != - ] && ls "$lib" | tr '\n' ' ')"
}

cuda_arch() {  # 9.0 on an H200
    [ -n "${CUDA_ARCH:-}" ] && { echo "$CUDA_ARCH"; return; }
    "$PYTHON" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability(0))' 2>/dev/null || echo 9.0
}

check() {  # check SITE [REF]: moe_infinity and its compiled part import from SITE, in a child process
    local site=$1 ref=${2:-}
    [ -d "$site/moe_infinity" ] || die "$site holds no moe_infinity package"
    (cd /tmp && PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" - "$ref" <<'EOF'
import importlib, json, sys
ref = sys.argv[1]
out = {}
import moe_infinity, transformers, pydantic
out.update(moe_infinity=moe_infinity.__file__, transformers=transformers.__version__, pydantic=pydantic.VERSION)
ext = {"dev": "moe_infinity._store", "main": "moe_infinity.ops.prefetch.prefetch_op"}.get(ref)
if ext:
    m = importlib.import_module(ext)
    out["extension"] = m.__file__
from moe_infinity import MoE
out["MoE"] = MoE.__module__
print("@@check " + json.dumps(out))
EOF
    )
}

ours() {  # ours DIR MARKER WHAT: DIR may be replaced: absent, empty, or made by an earlier build (MARKER)
    [ ! -e "$1" ] && return 0
    [ -d "$1" ] || die "$3 $1 exists and is not a folder: give a new path"
    [ -e "$1/$2" ] || [ -z "$(ls -A "$1")" ] || die "$3 $1 is a folder this script did not make (no $2): give a new or empty path"
}

build() {  # build REF SITE [WORK]
    local ref=${1:-} site=${2:-} work=${3:-/tmp/moe-infinity-build} c src t0 rc arch jobs tar
    [ -n "$ref" ] && [ -n "$site" ] || die "usage: build dev|main SITE [WORK]"
    case $ref in dev|main) ;; *) die "unknown ref '$ref': dev or main" ;; esac
    c=$(ref_commit "$ref")
    tar=$BUNDLE/moe-infinity-$ref-$c.tar.gz
    [ -e "$tar" ] || die "no $tar (make the bundle first: $0 bundle, and carry .moei)"
    [ -e "$REPO/benchmarks/moe_infinity/$ref.patch" ] || die "no benchmarks/moe_infinity/$ref.patch"
    t0=$(date +%s)
    ours "$site" ZIPMOE_BUILD.json "SITE"
    ours "$work/$ref" .moe_infinity_build "WORK/$ref"
    rm -rf "$work/$ref" "$site"
    mkdir -p "$work/$ref" "$site" || die "cannot make $work/$ref or $site"
    : > "$work/$ref/.moe_infinity_build"
    echo '{"result": "building"}' > "$site/ZIPMOE_BUILD.json"  # marks the folder as this script's at once
    tar -xzf "$tar" -C "$work/$ref" || die "cannot extract $tar"
    src=$work/$ref/moe-infinity-$ref-$c
    echo "== $ref ($c): patch"
    (cd "$src" && patch -p1 --no-backup-if-mismatch < "$REPO/benchmarks/moe_infinity/$ref.patch") || die "the patch does not apply"
    echo "== $ref: the pinned wheels into $site"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$BUNDLE"/wheels/*.whl \
        || die "installing the wheels failed"
    arch=$(cuda_arch); jobs=${MAX_JOBS:-$(nproc)}
    cuda_paths "$work/$ref"
    echo "== $ref: compile against $("$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)') for sm_${arch/./}, $jobs jobs"
    if [ "$ref" = dev ]; then  # the _store extension (CUTLASS headers); _engine (no Python module imports it) left out
        tar -xzf "$BUNDLE/cutlass-$CUTLASS_TAG-include.tar.gz" -C "$work/$ref" || die "cannot extract CUTLASS's headers"
        (cd "$src" && CUTLASS_DIR="$work/$ref/cutlass" MOE_BUILD_ENGINE=0 MOE_CUDA_ARCH_FLAGS="-gencode=arch=compute_${arch/./},code=sm_${arch/./}" \
            TORCH_CUDA_ARCH_LIST="$arch" MAX_JOBS=$jobs "$PYTHON" setup.py build_ext --inplace)
    else  # the prefetch op, compiled ahead (BUILD_OPS=1) instead of on first use
        (cd "$src" && BUILD_OPS=1 TORCH_CUDA_ARCH_LIST="$arch" MAX_JOBS=$jobs "$PYTHON" setup.py build_ext --inplace)
    fi
    rc=$?
    [ $rc = 0 ] || { echo "== $ref: the compile failed (rc=$rc) after $(( $(date +%s) - t0 )) s"; write_record "$site" "$ref" "$c" "$arch" "$t0" compile-failed; return 1; }
    echo "== $ref: the package into $site"
    # links resolved (main's ops/ links to ../../op_builder); its C++ sources are not needed once compiled
    (cd "$src" && tar -chf - --exclude=moe_infinity/ops/core --exclude='__pycache__' moe_infinity) | tar -xf - -C "$site" \
        || die "copying moe_infinity into $site failed"
    echo "== $ref: import check"
    if check "$site" "$ref"; then write_record "$site" "$ref" "$c" "$arch" "$t0" ok
    else write_record "$site" "$ref" "$c" "$arch" "$t0" import-failed; return 1; fi
    echo "== $ref: built in $(( $(date +%s) - t0 )) s: zipmoe bench ... --baseline moe-infinity --moe-infinity-site $site"
}

write_record() {  # SITE REF COMMIT ARCH T0 RESULT: SITE/ZIPMOE_BUILD.json
    "$PYTHON" - "$@" "$REPO/benchmarks/moe_infinity/$2.patch" <<'EOF'
import hashlib, json, platform, sys, time
site, ref, commit, arch, t0, result, patch = sys.argv[1:8]
try:
    import torch
    tv, cv = torch.__version__, torch.version.cuda
except Exception:
    tv = cv = None
rec = dict(ref=ref, commit=commit, result=result, arch=arch, torch=tv, cuda=cv, python=platform.python_version(),
           patch=patch.rsplit("/", 1)[-1], patch_sha256=hashlib.sha256(open(patch, "rb").read()).hexdigest(),
           seconds=round(time.time() - float(t0)), built=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
json.dump(rec, open(f"{site}/ZIPMOE_BUILD.json", "w"), indent=2)
print("@@build " + json.dumps(rec))
EOF
}

diagnose() {  # diagnose SITE VIEW STORE: MoE(VIEW) and 4 greedy tokens from SITE, with a crash handler
    # preloaded: on SIGSEGV, SIGFPE, SIGBUS or SIGABRT it prints the signal, the faulting address,
    # the thread (tid = pid: the main thread) and its native backtrace, resolved with addr2line;
    # MoE-Infinity's trace log on, stdout unbuffered (its logger writes through C stdout)
    local site=$1 view=$2 store=$3 work=${4:-/tmp/moe-infinity-build} rc
    [ -d "$site/moe_infinity" ] || die "$site holds no moe_infinity package"
    [ -e "$view/config.json" ] || die "$view has no config.json (a checkpoint folder: bench's offload/moe-infinity-view)"
    mkdir -p "$work" "$store" || die "cannot make $work or $store"
    cat > "$work/crash_handler.c" <<'C'
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>
static char alt[1 << 16];
static void on_signal(int sig, siginfo_t* info, void* ctx) {
  void* frames[64];
  int n = backtrace(frames, 64);
  Dl_info d;
  (void)ctx;
  dprintf(2, "\n@@crash signal %d address %p tid %ld pid %d\n", sig, info->si_addr, (long)syscall(SYS_gettid), getpid());
  for (int i = 0; i < n; i++)
    if (dladdr(frames[i], &d) && d.dli_fname)
      dprintf(2, "@@frame %s 0x%lx\n", d.dli_fname, (unsigned long)((char*)frames[i] - (char*)d.dli_fbase - 1));
  signal(sig, SIG_DFL);
  raise(sig);
}
__attribute__((constructor)) static void install(void) {
  void* warm[2];
  backtrace(warm, 2); /* loads libgcc before any crash */
  stack_t ss = {.ss_sp = alt, .ss_size = sizeof alt};
  sigaltstack(&ss, 0);
  struct sigaction a = {0};
  a.sa_sigaction = on_signal;
  a.sa_flags = SA_SIGINFO | SA_ONSTACK;
  int sigs[] = {SIGSEGV, SIGFPE, SIGBUS, SIGABRT};
  for (int i = 0; i < 4; i++) sigaction(sigs[i], &a, 0);
}
C
    gcc -shared -fPIC -O1 -o "$work/crash_handler.so" "$work/crash_handler.c" -ldl || die "cannot build the crash handler"
    (cd /tmp && PYTHONUNBUFFERED=1 MUDUO_LOG_TRACE=1 LD_PRELOAD="$work/crash_handler.so" PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" \
        timeout "${DIAG_TIMEOUT:-150}" "$PYTHON" - "$view" "$store" > "$work/diagnose.log" 2>&1 <<'EOF'
import sys
import torch
from moe_infinity import MoE
model = MoE(sys.argv[1], {"offload_path": sys.argv[2], "device_memory_ratio": 0.05})
print("@@loaded", flush=True)
out = model.generate(torch.tensor([[1, 2, 3, 4]], device="cuda"), max_new_tokens=4, do_sample=False)
print("@@generated", out.tolist(), flush=True)
EOF
    )
    rc=$?
    echo "== diagnose: exit status $rc; the log's last lines (all of it: $work/diagnose.log)"
    grep -v '^@@frame\|^  \|^}' "$work/diagnose.log" | tail -n "${DIAG_LINES:-40}" | cut -c1-300
    grep '^@@frame' "$work/diagnose.log" | while read -r _ f o; do
        echo "  $o $(addr2line -Cfpe "$f" "$o" 2>/dev/null | head -1)  [$f]"
    done | head -40
    return $rc
}

case "${1:-}" in
    bundle) shift; bundle "$@" ;;
    diagnose) shift; [ $# -ge 3 ] || die "usage: diagnose SITE VIEW STORE [WORK]"; diagnose "$@" ;;
    build) shift; build "$@" ;;
    check) shift; [ $# -ge 1 ] || die "usage: check SITE [dev|main]"; check "$@" ;;
    -h|--help|"") usage ;;
    *) die "unknown command '$1' (bundle, build, check; --help)" ;;
esac
