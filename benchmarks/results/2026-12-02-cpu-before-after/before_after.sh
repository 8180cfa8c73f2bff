#!/usr/bin/env bash
# Before/after TPOT comparison on the CPU box: the landed code (commit 920908f, installed
# non-editable in /tmp/before-site, run through /tmp/before-venv) against /work/main's working
# tree as it is now (the editable install in /work/main/.venv).
#
#   bash /tmp/bench/before_after.sh                # R=3 repetitions per version and case
#   R=1 bash /tmp/bench/before_after.sh            # a dry run
#   CASES="olmoe-68M" R=5 bash /tmp/bench/before_after.sh
#
# Every run is a fresh process: `python -m zipmoe_cli chat FILE --budget B --greedy
# --max-new-tokens N --prompt P --json --threads T --workers W`. Versions alternate within each
# repetition and the order flips every repetition (before,after / after,before / ...), case by
# case. Raw records (one JSON line per run, with the token ids and the full stats) go to
# $RESULTS (default /tmp/bench/results.jsonl, overwritten); the table is printed at the end.
#
# Environment: R (3), CASES (all three), THREADS (1), WORKERS (1), WARMUP (1: one untimed short
# run per version first, so numba's on-disk cache and the page cache are warm for both),
# RESULTS, DEMO_PROMPT, OLMOE_PROMPT, DEMO_N (40), OLMOE_N (300), BEFORE_PY, AFTER_PY.
set -uo pipefail

B=/tmp/bench
R=${R:-3}
THREADS=${THREADS:-1}
WORKERS=${WORKERS:-1}
WARMUP=${WARMUP:-1}
RESULTS=${RESULTS:-$B/results.jsonl}
BEFORE_PY=${BEFORE_PY:-/tmp/before-venv/bin/python}   # before-site first on sys.path, no editable finder
AFTER_PY=${AFTER_PY:-/work/main/.venv/bin/python}     # the editable install of /work/main
DEMO_PROMPT=${DEMO_PROMPT:-What is the capital of France?}
OLMOE_PROMPT=${OLMOE_PROMPT:-What is the capital of France?}
DEMO_N=${DEMO_N:-40}
OLMOE_N=${OLMOE_N:-300}
CASES=${CASES:-demo-800M olmoe-68M olmoe-116M}
export HF_HUB_OFFLINE=1
unset PYTHONPATH
# Run from /tmp/bench: `python -m` puts the cwd first on sys.path, and /work/main as cwd would
# shadow the before-code with the working tree's zipmoe_cli.
cd "$B" || exit 1
LOG=$B/logs; mkdir -p "$LOG"

case_args() {  # case -> FILE BUDGET N PROMPT (global vars)
  case "$1" in
    demo-800M)  FILE=$B/demo.zmoe;  BUDGET=800M; N=$DEMO_N;  PROMPT=$DEMO_PROMPT ;;
    olmoe-68M)  FILE=$B/olmoe.zmoe; BUDGET=68M;  N=$OLMOE_N; PROMPT=$OLMOE_PROMPT ;;   # ~23% of experts as full tensors
    olmoe-116M) FILE=$B/olmoe.zmoe; BUDGET=116M; N=$OLMOE_N; PROMPT=$OLMOE_PROMPT ;;   # ~50%
    *) echo "unknown case $1" >&2; return 1 ;;
  esac
}

src_hash() {  # fingerprint of the after-code's sources (others edit the tree while this runs)
  (cd /work/main && find zipmoe zipmoe_cli codecs kernels runtime -name '*.py' -print0 | sort -z | xargs -0 sha1sum | sha1sum | cut -c1-12)
}

# --- which code each interpreter imports
check() {  # py expect_pkg forbid_pkg
  "$1" - "$2" "$3" <<'PY'
import importlib.util as u, sys, zipmoe, zipmoe_cli
want, forbid = sys.argv[1], sys.argv[2]
ok = u.find_spec(want) is not None and u.find_spec(forbid) is None
print(f"  {sys.executable}: zipmoe {zipmoe.__file__}, zipmoe_cli {zipmoe_cli.__file__}, {want} {'yes' if u.find_spec(want) else 'NO'}, {forbid} {'PRESENT' if u.find_spec(forbid) else 'absent'}")
sys.exit(0 if ok else 1)
PY
}
echo "== imports"
check "$BEFORE_PY" zipmoe.runtime.serve zipmoe.runtime.engine || { echo "before interpreter does not import the before-code" >&2; exit 1; }
check "$AFTER_PY" zipmoe.runtime.engine zipmoe.runtime.serve || { echo "after interpreter does not import the working tree" >&2; exit 1; }
H0=$(src_hash); echo "  after-code source hash at start: $H0"

run_one() {  # version case rep -> appends one JSON line to $RESULTS
  local ver=$1 cs=$2 rep=$3 py h t0 t1 rc base
  case_args "$cs" || return 1
  if [ "$ver" = before ]; then py=$BEFORE_PY; h=920908f; else py=$AFTER_PY; h=$(src_hash); fi
  base=$LOG/$cs.$ver.$rep
  t0=$(date +%s.%N)
  "$py" -m zipmoe_cli chat "$FILE" --budget "$BUDGET" --greedy --max-new-tokens "$N" \
      --prompt "$PROMPT" --json --threads "$THREADS" --workers "$WORKERS" > "$base.json" 2> "$base.err"
  rc=$?
  t1=$(date +%s.%N)
  "$AFTER_PY" - "$base.json" "$base.err" "$ver" "$cs" "$rep" "$FILE" "$BUDGET" "$N" "$PROMPT" "$rc" "$t0" "$t1" "$h" "$THREADS" "$WORKERS" >> "$RESULTS" <<'PY'
import json, sys
js, err, ver, cs, rep, f, b, n, p, rc, t0, t1, h, th, wk = sys.argv[1:]
rec = dict(case=cs, version=ver, rep=int(rep), file=f, budget=b, max_new_tokens=int(n), prompt=p,
           threads=int(th), workers=int(wk), rc=int(rc), wall_s=round(float(t1) - float(t0), 3), src=h)
try:
    d = json.load(open(js)); s = d["stats"]; ids = d["token_ids"]
    rec.update(tpot_s=s["tpot_s"], ttft_s=s["ttft_s"], hits=s.get("hits"), bytes_read=s.get("bytes_read"),
               new_tokens=s.get("new_tokens"), stop=s.get("stop"), distinct_tokens=len(set(ids)),
               token_ids=ids, text=d.get("text"), stats=s)
except Exception as e:
    lines = open(err, errors="replace").read().strip().splitlines()
    rec.update(error=f"{type(e).__name__}: {e}", stderr_tail=lines[-3:])
print(json.dumps(rec))
r = rec
msg = (f"tpot {r['tpot_s']*1e3:7.1f} ms  ttft {r['ttft_s']:6.2f} s  {r['new_tokens']} tok ({r['distinct_tokens']} distinct)  "
       f"read {r['bytes_read']/2**20:7.1f} MiB  hits {r['hits']}") if "tpot_s" in r else f"FAILED rc={rc}: {r.get('error')} {r.get('stderr_tail')}"
print(f"  {cs:11s} {ver:6s} rep {rep}  wall {r['wall_s']:5.1f} s  {msg}", file=sys.stderr)
PY
}

if [ "$WARMUP" = 1 ]; then
  echo "== warm-up (untimed, not recorded): one 4-token run per version"
  for py in "$BEFORE_PY" "$AFTER_PY"; do
    "$py" -m zipmoe_cli chat "$B/olmoe.zmoe" --budget 68M --greedy --max-new-tokens 4 --prompt hi --json \
        --threads "$THREADS" --workers "$WORKERS" > /dev/null 2> "$LOG/warmup.err" || { echo "warm-up failed with $py:"; tail -3 "$LOG/warmup.err"; exit 1; }
  done
fi

: > "$RESULTS"
T0=$(date +%s)
echo "== runs: R=$R, cases: $CASES, --threads $THREADS --workers $WORKERS (results: $RESULTS)"
for rep in $(seq 1 "$R"); do
  for cs in $CASES; do
    if [ $((rep % 2)) = 1 ]; then order="before after"; else order="after before"; fi
    for ver in $order; do run_one "$ver" "$cs" "$rep"; done
  done
done
H1=$(src_hash)
echo "== done in $(( $(date +%s) - T0 )) s; after-code source hash at start $H0, at end $H1$([ "$H0" = "$H1" ] || echo '  (THE WORKING TREE CHANGED DURING THE RUN: see each record'"'"'s src)')"

"$AFTER_PY" - "$RESULTS" <<'PY'
import json, statistics as st, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
cases = list(dict.fromkeys(r["case"] for r in recs))
med = lambda xs: st.median(xs) if xs else float("nan")
print()
print(f"{'case':11s} {'runs b/a':>8s} {'before TPOT':>12s} {'after TPOT':>11s} {'after/before':>12s} {'before TTFT':>12s} {'after TTFT':>11s}  tokens identical  distinct tokens (of new) per run")
notes = []
for c in cases:
    rs = [r for r in recs if r["case"] == c]
    ok = [r for r in rs if "tpot_s" in r]
    b = [r for r in ok if r["version"] == "before"]; a = [r for r in ok if r["version"] == "after"]
    tb, ta = med([r["tpot_s"] for r in b]), med([r["tpot_s"] for r in a])
    fb, fa = med([r["ttft_s"] for r in b]), med([r["ttft_s"] for r in a])
    same_ids = len(ok) == len(rs) and len({json.dumps(r["token_ids"]) for r in ok}) == 1
    fails = len(rs) - len(ok)
    print(f"{c:11s} {len(b):>3d}/{len(a):<4d} {tb*1e3:9.1f} ms {ta*1e3:8.1f} ms {ta/tb:12.3f} {fb:10.2f} s {fa:9.2f} s  "
          f"{'yes' if same_ids else 'NO':16s}{f' ({fails} FAILED)' if fails else ''}  "
          + " ".join(f"{r['distinct_tokens']}({r['new_tokens']})" for r in ok))
    for v, rr in (("before", b), ("after", a)):
        hs = sorted({f"{r['hits']['full']}/{r['hits']['compressed']}/{r['hits']['sm_only']}/{r['hits']['e_only']}/{r['hits']['none']}" for r in rr})
        br = [r["bytes_read"] for r in rr]
        notes.append(f"  {c:11s} {v:6s} hits F/C/S/E/miss {' | '.join(hs)}   bytes_read {min(br) if br else '-'}..{max(br) if br else '-'}")
print("\nexpert-tensor hits (distinct values over the runs) and bytes_read (min..max):")
print("\n".join(notes))
print("\nper-run TPOT (ms), in run order:")
for c in cases:
    for v in ("before", "after"):
        print(f"  {c:11s} {v:6s} " + " ".join(f"{r['tpot_s']*1e3:.1f}" for r in recs if r["case"] == c and r["version"] == v and "tpot_s" in r))
print("TPOT and TTFT are medians over runs of each run's stats.tpot_s / ttft_s")
PY
