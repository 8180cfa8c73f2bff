cd /work/main
export HF_HUB_OFFLINE=1 ZIPMOE_CACHE_DIR=/tmp/demo-cache PATH=/work/main/.venv/bin:$PATH
W=/tmp/demo-fig
zipmoe bench out/demo.zmoe --engine zipmoe-default --engine zipmoe-basic --plan $W/plan-400M.json \
    --budget 400M --batch 1 --new-tokens 128 --runs 1 --cold --workload corpus --device cpu --profile $W/profile.json \
    --work-dir $W/work --time-limit 150 --json $W/demo.json --merge --cgroup-slack 1G
zipmoe bench out/demo.zmoe --engine zipmoe --engine zipmoe-default --engine zipmoe-basic --plan $W/plan-800M.json \
    --budget 800M --batch 1 --new-tokens 128 --runs 1 --cold --workload corpus --device cpu --profile $W/profile.json \
    --work-dir $W/work --time-limit 150 --json $W/demo.json --merge --cgroup-slack 1G
echo DONE
