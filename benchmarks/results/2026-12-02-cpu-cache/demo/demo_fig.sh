set -x
cd /work/main
export HF_HUB_OFFLINE=1 ZIPMOE_CACHE_DIR=/tmp/demo-cache PATH=/work/main/.venv/bin:$PATH
[ -e out/demo.zmoe ] || just demo
W=/tmp/demo-fig; mkdir -p $W
zipmoe plan out/demo.zmoe --profile-only --profile $W/profile.json --device cpu
for b in 400M 800M; do
  zipmoe plan out/demo.zmoe --budget $b --profile $W/profile.json --device cpu --calibrate builtin --calibrate-tokens 16 -o $W/plan-$b.json
done
for b in 400M 800M; do
  zipmoe bench out/demo.zmoe --engine zipmoe --engine zipmoe-default --engine zipmoe-basic --engine zipmoe-pools --plan $W/plan-$b.json \
    --budget $b --batch 1 --new-tokens 128 --runs 1 --cold --workload corpus --device cpu --profile $W/profile.json \
    --work-dir $W/work --time-limit 150 --json $W/demo.json --merge
done
echo DONE
