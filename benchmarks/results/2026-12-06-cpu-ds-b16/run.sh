# DeepSeek-V2-Lite's real shapes, 3 layers (one dense, two sparse of 64 experts, top-6), batch 16 on the
# CPU box (2 cores) inside bench's memory cgroup with the default 256M margin: does a batch-16 step's
# host memory stay within budget + baseline + margin (§27: killed on the H200 at 5.31 G)?
zipmoe synth deepseek_v2 --preset deepseek-v2-lite --layers 3 --layout fused -o /tmp/ds3
zipmoe pack /tmp/ds3 -o /tmp/ds3.zmoe --force
zipmoe bench /tmp/ds3.zmoe --budget 2G --batch 16 --new-tokens 8 --device cpu --threads 1 --json bench.json
