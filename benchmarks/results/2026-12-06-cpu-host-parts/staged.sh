# The CUDA path's serving-thread work emulated on the CPU box (2 cores): the staging ring, the
# device merge and the full pool's slots as on CUDA (--staged), every part of `host` apart, then
# the same served pass sampled by py-spy (binary taken out of the py-spy wheel), read by stacks.py.
cd /tmp
python benchmarks/profile_fetch.py --work /tmp/pf --preset qwen1.5-moe-a2.7b --layers 2 --experts 16 --device cpu \
    --staged --workers 1 --threads 1 --steps 8 --repeat 3 --served 0.3 --json staged-served.json
py-spy record --threads --nonblocking --rate 500 --format raw -o spy-staged-served.txt -- \
    python benchmarks/profile_fetch.py --work /tmp/pf --preset qwen1.5-moe-a2.7b --layers 2 --experts 16 --device cpu \
    --staged --workers 1 --threads 1 --steps 8 --repeat 3 --served 0.3 --quiet
python benchmarks/stacks.py spy-staged-served.txt --under Fetcher._issue --thread MainThread
