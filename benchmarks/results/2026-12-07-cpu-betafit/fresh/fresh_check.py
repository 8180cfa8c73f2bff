import sys, json
sys.path.insert(0, "/work/main/tests")
import torch
torch.set_num_threads(1)
from pathlib import Path
from zipmoe.runtime.plan import passes
from zipmoe.codecs.reader import ContainerReader
from zipmoe.runtime.plan.layout import container_layout

path = Path("/work/main/out/demo.zmoe")
with ContainerReader(path) as r:
    layout = container_layout(r, "float32", "cpu")
real = passes._run_stream
log = []
def spy(model, rt, prompt, forced, **kw):
    f0 = rt.counters.snapshot()["fresh_buffers"]
    times, d = real(model, rt, prompt, forced, **kw)
    log.append((type(rt.cache.pools.get("compressed")).__name__, sum(1 for p in rt.cache.pools.values() if p.capacity), rt.counters.snapshot()["fresh_buffers"] - f0, d["hits"]))
    return times, d
passes._run_stream = spy
out = passes.measure_runtime(path, layout, "cpu", workers=2, tokens=4, warmup=3, miss_tokens=4, served_tokens=8)
names = ["warm", "resident", "resident", "compressed", "sm_only", "e_only", "none", "admit", "m1", "m1-t", "m2", "m2-t", "beta-warm", "beta", "served", "served_c"]
for n, l in enumerate(log):
    print(n, l[2], {k: v for k, v in l[3].items() if v})
print(out.get("serving_error"))
