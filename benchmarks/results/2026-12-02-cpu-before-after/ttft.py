import sys, time, torch, zipmoe
torch.set_num_threads(1)
ver = sys.argv[1]
DecodeLoop = __import__("zipmoe.runtime.serve.loop" if ver == "before" else "zipmoe.runtime.engine.loop", fromlist=["DecodeLoop"]).DecodeLoop
model, tok = zipmoe.load("/tmp/bench/olmoe.zmoe", budget="116M", workers=1, threads=1)
loop = DecodeLoop(model, context=4096, batch=1)
ids = torch.randint(3, 1000, (1, 48), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    t = time.perf_counter(); loop.prefill(ids); a = time.perf_counter() - t
    t = time.perf_counter(); loop.prefill(ids); b = time.perf_counter() - t
c = model.zipmoe.counters.snapshot()
print(ver, f"first prefill {a*1000:.0f} ms, second {b*1000:.0f} ms", c["time_s"])
