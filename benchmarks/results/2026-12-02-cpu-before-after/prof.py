import cProfile, pstats, sys, time, torch, zipmoe, io
torch.set_num_threads(1)
ver = sys.argv[1]
if ver == "before":
    from zipmoe.runtime.serve.loop import DecodeLoop
else:
    from zipmoe.runtime.engine.loop import DecodeLoop
model, tok = zipmoe.load("/tmp/bench/olmoe.zmoe", budget="116M", workers=1, threads=1)
loop = DecodeLoop(model, context=4096, batch=1)
ids = torch.randint(3, 1000, (1, 16), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    loop.generate(ids, max_new_tokens=40, do_sample=False, generation_kwargs={"pad_token_id": 0})
    pr = cProfile.Profile(); t = time.perf_counter(); pr.enable()
    res = loop.generate(ids, max_new_tokens=150, do_sample=False, generation_kwargs={"pad_token_id": 0})
    pr.disable()
print(ver, "tpot ms", res.stats["tpot_s"] * 1000)
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18); print(s.getvalue()[:4500])
