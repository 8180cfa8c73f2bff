#!/usr/bin/env bash
# Run a command with the read bandwidth of one block device capped by the kernel.
#
#   bash benchmarks/slow_disk.sh [-f FILE] [-d MAJ:MIN] RATE -- COMMAND [ARGS...]
#
#   RATE   bytes per second: a plain number, or with K, M, G (binary, as zipmoe's sizes:
#          300M = 300 MiB/s; KB/KiB/MB/MiB... mean the same).
#   -f     the file (or folder) whose block device is throttled (default: the current folder);
#          put the .zmoe container here.
#   -d     the device's MAJ:MIN, instead of finding it from -f.
#
# The command runs inside a fresh cgroup: v1 blkio (blkio.throttle.read_bps_device,
# "MAJ:MIN BYTES") where the blkio controller is mounted, else v2 (io.max, "MAJ:MIN rbps=BYTES").
# The limit is the block layer's throttle: it binds every read the command's processes send to
# the device (O_DIRECT or buffered) and not reads served from the page cache, so measure with
# O_DIRECT (zipmoe's runtime and profile do) or drop the cache first. Its children stay in the
# cgroup; the cgroup is removed when the command ends (its leftover processes moved out).
# What the limit is: a rate over the throttle's 100 ms slices, not a slow device. Each slice
# grants RATE x 0.1 s, which passes at the disk's full speed; a read beyond it waits for the next
# slice. Reads back to back (dd, `zipmoe plan --profile-only`) average RATE; a program that reads
# a few MB between computations gets its reads at full speed while it stays under the grant
# (docs/benchmarks.md §7 measures both).
# Exit status: the command's; 2 for a usage error; 1 when the cgroup cannot be made.
# Needs root (cgroup files are root's). On a partition, the whole disk is throttled: the kernel
# takes only whole-disk numbers (blkg_conf_open_bdev refuses a partition with ENODEV).
set -euo pipefail

prog=slow_disk.sh
die() { echo "$prog: $2" >&2; exit "$1"; }
usage() { die 2 "usage: $prog [-f FILE] [-d MAJ:MIN] RATE -- COMMAND [ARGS...]  (RATE: bytes/s, e.g. 300M = 300 MiB/s)"; }

file=. dev= rate=
while (($#)); do
  case $1 in
    -f|--file) (($# >= 2)) || usage; file=$2; shift 2 ;;
    -d|--device) (($# >= 2)) || usage; dev=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
    --) shift; break ;;
    -*) die 2 "unknown option $1; usage: $prog [-f FILE] [-d MAJ:MIN] RATE -- COMMAND [ARGS...]" ;;
    *) [[ -z $rate ]] || die 2 "one RATE only (got '$rate' and '$1'); put the command after --"; rate=$1; shift ;;
  esac
done
[[ -n $rate ]] || usage
(($#)) || die 2 "no command given after --"

# RATE -> bytes/s (same forms as zipmoe.units.parse_size)
shopt -s nocasematch
if [[ $rate =~ ^([0-9]+(\.[0-9]*)?)([KMGT]?)(I?B)?$ ]]; then
  num=${BASH_REMATCH[1]} unit=${BASH_REMATCH[3]^^}
else
  die 2 "cannot read rate '$rate': use bytes per second, e.g. 300M (MiB/s), 200MiB, 1G or 250000000"
fi
shopt -u nocasematch
case $unit in '') mul=1 ;; K) mul=1024 ;; M) mul=$((1 << 20)) ;; G) mul=$((1 << 30)) ;; T) mul=$((1 << 40)) ;; esac
bps=$(awk -v n="$num" -v m="$mul" 'BEGIN { printf "%.0f", n * m }')
((bps > 0)) || die 2 "rate must be above 0 (got '$rate')"

# the device: MAJ:MIN of the file's file system, then its whole disk
if [[ -z $dev ]]; then
  [[ -e $file ]] || die 2 "no such file: $file"
  dev=$(stat -L -c '%Hd:%Ld' -- "$file")
  if [[ $dev == 0:* ]]; then
    # btrfs, overlay and other virtual st_dev: ask the mount table for its source device
    src=$(findmnt -n -o SOURCE -T "$file" 2>/dev/null | head -1 | sed 's/\[.*//')
    [[ -b $src ]] || die 1 "$file is on ${src:-a file system} without a block device (st_dev $dev): nothing to throttle; pass -d MAJ:MIN"
    dev=$(lsblk -dn -o MAJ:MIN -- "$src" | tr -d ' ')
  fi
fi
[[ $dev =~ ^[0-9]+:[0-9]+$ ]] || die 2 "bad device '$dev': want MAJ:MIN, e.g. 254:0"
sys=/sys/dev/block/$dev
[[ -e $sys ]] || die 1 "no block device $dev (no $sys)"
if [[ -e $sys/partition ]]; then
  part=$(basename "$(readlink -f "$sys")")
  disk=$(basename "$(dirname "$(readlink -f "$sys")")")
  dev=$(cat "/sys/class/block/$disk/dev")
  echo "$prog: $part is a partition; throttling its disk $disk ($dev)" >&2
fi
name=$(basename "$(readlink -f "/sys/dev/block/$dev")")

# the controller: v1 blkio if mounted, else v2 io
[[ $EUID -eq 0 ]] || die 1 "needs root to create a cgroup and set its read limit (run with sudo)"
v1=$(awk '$9 == "cgroup" && $NF ~ /(^|,)blkio(,|$)/ { print $5; exit }' /proc/self/mountinfo)
v2=$(awk '$9 == "cgroup2" { print $5; exit }' /proc/self/mountinfo)
if [[ -n $v1 ]]; then
  kind=v1 cg=$v1/zipmoe-slow-$$ limit_file=blkio.throttle.read_bps_device limit="$dev $bps"
  [[ -e $v1/$limit_file ]] || die 1 "the blkio controller at $v1 has no $limit_file (kernel without CONFIG_BLK_DEV_THROTTLING)"
elif [[ -n $v2 ]] && grep -qw io "$v2/cgroup.controllers" 2>/dev/null; then
  kind=v2 cg=$v2/zipmoe-slow-$$ limit_file=io.max limit="$dev rbps=$bps"
  grep -qw io "$v2/cgroup.subtree_control" || echo +io > "$v2/cgroup.subtree_control" \
    || die 1 "cannot enable the io controller in $v2/cgroup.subtree_control"
else
  die 1 "no blkio controller: neither a cgroup v1 blkio mount nor a cgroup v2 mount with the io controller (see /proc/self/mountinfo)"
fi

child=
cleanup() {
  local rc=$?
  set +e
  if [[ -d $cg ]]; then
    # processes the command left behind go back to the root cgroup, then the cgroup goes
    local p parent
    parent=$(dirname "$cg")
    for _ in 1 2 3 4 5; do
      while read -r p; do echo "$p" > "$parent/cgroup.procs" 2>/dev/null || true; done < "$cg/cgroup.procs"
      rmdir "$cg" 2>/dev/null && break
      sleep 0.2
    done
    [[ -d $cg ]] && echo "$prog: could not remove $cg" >&2
  fi
  exit "$rc"
}
trap cleanup EXIT
trap '[[ -n $child ]] && kill -TERM "$child" 2>/dev/null' TERM HUP
trap ':' INT  # Ctrl-C reaches the command (same process group); this shell waits for it, then cleans up

mkdir "$cg" || die 1 "cannot create $cg"
echo "$limit" > "$cg/$limit_file" || die 1 "the kernel refused '$limit' in $cg/$limit_file"
echo "$prog: cgroup $kind $cg, $limit_file = $(grep -h "^$dev " "$cg/$limit_file" || echo "$limit") ($name, $(awk -v b="$bps" 'BEGIN { printf "%.1f MiB/s", b / 1048576 }'))" >&2

# the command joins the cgroup before exec; this shell stays outside to clean up after it
( trap - INT TERM HUP EXIT; echo "$BASHPID" > "$cg/cgroup.procs"; exec "$@" ) &
child=$!
set +e
while kill -0 "$child" 2>/dev/null; do wait "$child"; done   # a trapped signal ends a wait early
wait "$child"; rc=$?
set -e
exit "$rc"
