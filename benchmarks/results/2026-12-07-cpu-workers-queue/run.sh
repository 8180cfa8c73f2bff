# The pools' token queue (7c9771d) against the code before it (2bc5024), the CUDA path emulated on the
# CPU box (2 cores, 4 workers: oversubscribed, noisy), 3 rounds alternating.
git archive 2bc5024 | tar -x -C /tmp/bcpu && .venv/bin/pip install -q --no-deps --no-build-isolation --target /tmp/site-bcpu /tmp/bcpu
cd /tmp && /work/main/.venv/bin/python /work/main/benchmarks/profile_fetch.py --work /tmp/pf --preset qwen1.5-moe-a2.7b \
    --layers 2 --experts 16 --device cpu --staged --workers 4 --threads 2 --steps 8 --repeat 3 --served 0.3 --rounds 3 \
    --compare-with /tmp/site-bcpu --json cpu-ab-workers.json
