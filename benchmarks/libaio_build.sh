#!/usr/bin/env bash
# libaio (the Linux-native asynchronous I/O library, pagure.io/libaio, release 0.3.113) built from
# its source into a folder of its own, the *prefix*, for DeepSpeed's async-I/O op (its NVMe
# offload) on a machine that has no libaio-dev, no root and no network:
# `zipmoe bench ... --baseline deepspeed --deepspeed-libaio PREFIX`.
#
#   benchmarks/libaio_build.sh bundle [DIR]     on a machine that has the source (LIBAIO_GIT: a clone,
#                        bare or not, or a URL; default the upstream): DIR/libaio-0.3.113.tar.gz (default
#                        DIR: .aio in the checkout), the release's tree as upstream's `make create-archive`
#                        writes it (git archive --prefix=libaio-0.3.113/ of the release commit)
#   benchmarks/libaio_build.sh build TARBALL PREFIX
#                        make prefix=PREFIX install (seconds): PREFIX/include/libaio.h, PREFIX/lib/libaio.so*;
#                        then a test program calls io_setup against it (the kernel's AIO is usable here).
#                        Nothing outside PREFIX is written but a temporary build folder; a PREFIX that
#                        exists, is not empty and was not made by this script is refused. Where the
#                        linker finds no libcuda.so (DeepSpeed's CUDA async_io op links -lcuda), it also
#                        makes PREFIX/cuda-lib/libcuda.so, a link to the toolkit's stub or the driver's
#                        libcuda.so.1.
#   benchmarks/libaio_build.sh env PREFIX        the exports DeepSpeed's op builder needs (eval "$(... env PREFIX)"):
#                        CFLAGS and LDFLAGS (its is_compatible test program: -I, -L, -rpath), CPATH and
#                        LIBRARY_PATH (gcc's own search paths: torch's JIT build reads neither CFLAGS nor
#                        LDFLAGS), LD_RUN_PATH (the op's RUNPATH: it finds libaio.so.1 without
#                        LD_LIBRARY_PATH) and LD_LIBRARY_PATH. `zipmoe bench --deepspeed-libaio PREFIX`
#                        sets the same itself.
#   benchmarks/libaio_build.sh check PREFIX [DIR]
#                        with those exports, in a child process: DeepSpeed's AsyncIOBuilder (the
#                        accelerator's: DS_ACCELERATOR, default cuda where torch sees a GPU, else cpu)
#                        is_compatible, load() (JIT-built once into TORCH_EXTENSIONS_DIR, default
#                        ~/.cache/torch_extensions: minutes; bench then finds it built), the libaio the
#                        loaded op uses, and 4 MiB written and read back through its aio_handle in DIR
#                        (default /tmp; O_DIRECT); one line @@check {...}
#
# Settings (environment): LIBAIO_GIT (bundle), CC (build; default cc), CUDA_HOME (build: where the
# libcuda stub is looked for; default nvcc's folder, else /usr/local/cuda), PYTHON (check; python3).
set -uo pipefail

SELF=$(readlink -f "${BASH_SOURCE[0]}")
REPO=$(cd "$(dirname "$SELF")/.." && pwd)
VERSION=0.3.113
COMMIT=1b18bfafc6a2f7b9fa2c6be77a95afed8b7be448  # "bump libaio version" (0.3.113), tag libaio-0.3.113 upstream
MARKER=.libaio_build

die() { echo "libaio_build: $*" >&2; exit 1; }
usage() { sed -n '2,/^set -uo/{/^#/s/^# \{0,1\}//p}' "$SELF"; }

bundle() {  # bundle [DIR]: DIR/libaio-VERSION.tar.gz from LIBAIO_GIT
    local dir=${1:-$REPO/.aio} src=${LIBAIO_GIT:-https://pagure.io/libaio.git} tmp="" git out
    mkdir -p "$dir" || die "cannot make $dir"
    if [ -d "$src" ]; then
        git=$src
    else
        tmp=$(mktemp -d)
        git clone -q --bare "$src" "$tmp/libaio.git" || die "cannot clone $src"
        git=$tmp/libaio.git
    fi
    [ "$(git --git-dir="$git" cat-file -t "$COMMIT" 2>/dev/null || git -C "$git" cat-file -t "$COMMIT" 2>/dev/null)" = commit ] \
        || die "$src has no commit $COMMIT (libaio $VERSION)"
    out=$dir/libaio-$VERSION.tar.gz
    { git --git-dir="$git" archive --prefix="libaio-$VERSION/" "$COMMIT" 2>/dev/null || git -C "$git" archive --prefix="libaio-$VERSION/" "$COMMIT"; } \
        | gzip -9n > "$out" || die "git archive $COMMIT of $src failed"
    [ -z "$tmp" ] || rm -rf "$tmp"
    ls -l "$out"
    sha256sum "$out"
}

ours() {  # ours DIR: DIR may be replaced: absent, empty, or made by an earlier build (its marker file)
    [ ! -e "$1" ] && return 0
    [ -d "$1" ] || die "PREFIX $1 exists and is not a folder: give a new path"
    [ -e "$1/$MARKER" ] || [ -z "$(ls -A "$1")" ] || die "PREFIX $1 is a folder this script did not make (no $MARKER): give a new or empty path"
}

cuda_stub() {  # PREFIX: PREFIX/cuda-lib/libcuda.so where the linker finds none (none needed on a machine without CUDA)
    local prefix=$1 cc=${CC:-cc} home target
    case $("$cc" -print-file-name=libcuda.so) in /*) return 0 ;; esac
    home=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc 2>/dev/null || echo /usr/local/cuda/bin/nvcc)")")}
    [ -e "$home/lib64/libcuda.so" ] && return 0
    for target in "$home/lib64/stubs/libcuda.so" "$home/targets/x86_64-linux/lib/stubs/libcuda.so" \
        "$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 .*=>/ {print $NF; exit}')"; do
        [ -n "$target" ] && [ -e "$target" ] || continue
        mkdir -p "$prefix/cuda-lib" && ln -sfn "$target" "$prefix/cuda-lib/libcuda.so" || die "cannot link $prefix/cuda-lib/libcuda.so"
        echo "== libcuda.so for -lcuda: $prefix/cuda-lib/libcuda.so -> $target"
        return 0
    done
}

build() {  # build TARBALL PREFIX
    local tar=${1:-} prefix=${2:-} work t0 rc
    [ -n "$tar" ] && [ -n "$prefix" ] || die "usage: build TARBALL PREFIX"
    [ -f "$tar" ] || die "no $tar (make it first: $0 bundle, and carry .aio)"
    case $prefix in /*) ;; *) prefix=$(pwd)/$prefix ;; esac
    ours "$prefix"
    t0=$(date +%s)
    rm -rf "$prefix"
    mkdir -p "$prefix" || die "cannot make $prefix"
    : > "$prefix/$MARKER"  # marks the folder as this script's at once
    work=$(mktemp -d) || die "cannot make a build folder"
    tar -xzf "$tar" -C "$work" || die "cannot extract $tar"
    set -- "$work"/libaio-*/
    [ -f "$1/Makefile" ] || die "$tar holds no libaio-*/Makefile"
    make -s -C "$1" -j"$(nproc)" prefix="$prefix" install > "$work/make.log" 2>&1
    rc=$?
    [ $rc = 0 ] || { tail -n 20 "$work/make.log" >&2; die "make install failed (rc=$rc; the log: $work/make.log)"; }
    [ -f "$prefix/include/libaio.h" ] && [ -e "$prefix/lib/libaio.so" ] || die "make install left no include/libaio.h or lib/libaio.so in $prefix"
    cat > "$work/probe.c" <<'C'
#include <libaio.h>
#include <stdio.h>
int main(void) {
  io_context_t ctx = 0;
  int rc = io_setup(8, &ctx);
  if (rc != 0) { fprintf(stderr, "io_setup: %d\n", rc); return 1; }
  io_destroy(ctx);
  return 0;
}
C
    "${CC:-cc}" -o "$work/probe" "$work/probe.c" -I"$prefix/include" -L"$prefix/lib" -Wl,-rpath,"$prefix/lib" -laio \
        || die "a program cannot be linked against $prefix/lib/libaio.so"
    "$work/probe" || die "io_setup failed with $prefix/lib/libaio.so: the kernel's AIO is not usable here (/proc/sys/fs/aio-max-nr: $(cat /proc/sys/fs/aio-max-nr 2>/dev/null))"
    cuda_stub "$prefix"
    rm -rf "$work"
    echo "== libaio $VERSION in $prefix ($(( $(date +%s) - t0 )) s): zipmoe bench ... --deepspeed-libaio $prefix"
}

exports() {  # env PREFIX: the export lines
    local p=${1:-} lib
    [ -n "$p" ] || die "usage: env PREFIX"
    [ -f "$p/include/libaio.h" ] && [ -e "$p/lib/libaio.so" ] || die "$p has no include/libaio.h or lib/libaio.so (build it: $0 build TARBALL $p)"
    p=$(cd "$p" && pwd)
    lib=$p/lib
    [ -e "$p/cuda-lib/libcuda.so" ] && lib=$lib:$p/cuda-lib
    printf 'export CFLAGS="-I%s/include${CFLAGS:+ $CFLAGS}"\n' "$p"
    printf 'export LDFLAGS="-L%s/lib -Wl,-rpath,%s/lib${LDFLAGS:+ $LDFLAGS}"\n' "$p" "$p"
    printf 'export CPATH="%s/include${CPATH:+:$CPATH}"\n' "$p"
    printf 'export LIBRARY_PATH="%s${LIBRARY_PATH:+:$LIBRARY_PATH}"\n' "$lib"
    printf 'export LD_RUN_PATH="%s/lib${LD_RUN_PATH:+:$LD_RUN_PATH}"\n' "$p"
    printf 'export LD_LIBRARY_PATH="%s/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"\n' "$p"
}

check() {  # check PREFIX [DIR]: the op builds, loads, and reads back what it wrote
    local p=${1:-} dir=${2:-/tmp} lines
    [ -n "$p" ] || die "usage: check PREFIX [DIR]"
    mkdir -p "$dir" || die "cannot make $dir"  # the round trip's folder (drive.sh names one under its run folder)
    lines=$(exports "$p") || exit 1
    eval "$lines"
    (cd /tmp && "${PYTHON:-python3}" - "$dir" <<'EOF'
import json, os, sys, tempfile, time
import torch
os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
from deepspeed.accelerator import get_accelerator
b = get_accelerator().create_op_builder("AsyncIOBuilder")
out = {"accelerator": get_accelerator().device_name(), "builder": type(b).__module__, "compatible": b.is_compatible(verbose=True)}
t0 = time.time()
op = b.load(verbose=False)
out.update(load_s=round(time.time() - t0, 1), op=op.__file__)
out["libaio"] = sorted({ln.split()[-1] for ln in open("/proc/self/maps") if "libaio.so" in ln})
h = op.aio_handle(1 << 20, 8, False, True, 1)
n = 4 << 20
src = h.new_cpu_locked_tensor(n, torch.empty(0, dtype=torch.uint8))
src.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
dst = h.new_cpu_locked_tensor(n, torch.empty(0, dtype=torch.uint8))
dst.zero_()
with tempfile.TemporaryDirectory(dir=sys.argv[1]) as d:
    f = os.path.join(d, "roundtrip.bin")
    out["written"] = h.sync_pwrite(src, f)
    out["read"] = h.sync_pread(dst, f)
    out["file_bytes"] = os.path.getsize(f)
out["roundtrip"] = bool(torch.equal(src, dst))
h.free_cpu_locked_tensor(src)
h.free_cpu_locked_tensor(dst)
print("@@check " + json.dumps(out))
sys.exit(0 if out["roundtrip"] else 1)
EOF
    )
}

case "${1:-}" in
    bundle) shift; bundle "$@" ;;
    build) shift; build "$@" ;;
    env) shift; exports "$@" ;;
    check) shift; check "$@" ;;
    -h|--help|"") usage ;;
    *) die "unknown command '$1' (bundle, build, env, check; --help)" ;;
esac
