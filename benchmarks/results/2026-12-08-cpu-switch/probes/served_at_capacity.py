import sys, os, json, torch, numpy as np
from zipmoe.codecs.reader import ContainerReader
from zipmoe.runtime.plan.layout import container_layout
from zipmoe.runtime.plan import passes as P
from zipmoe.runtime.plan.workload import teacher_forced
from zipmoe.runtime.plan.replay import model_run, layer_calls_from_steps
from zipmoe.runtime.engine.counters import delta
prof=json.load(open("/work/main/benchmarks/results/2026-12-08-cpu-switch/profile.json"))
sc=dict(prof["runtime"]["step_costs"]); sc=P.scale_misses(sc, 1/sc["served_fit"]["scale"]) if "served_fit" in sc else sc
print("unscaled miss", sc["per_expert_s"]["none"])
with ContainerReader(sys.argv[-1] if sys.argv[-1].endswith(".zmoe") else "/tmp/swb/sw.zmoe") as r:
    L=container_layout(r,"auto","cpu")
share=float(os.environ.get("SHARE","0.25"))
with P.runtime_for_passes(sys.argv[-1] if sys.argv[-1].endswith(".zmoe") else "/tmp/swb/sw.zmoe", L, "cpu", 1) as (model, tok, budget, want):
    rt=model.zipmoe; cfg=model.config.to_dict()
    prompts, forced = teacher_forced(tok, cfg, rows=3, prompt_tokens=16, new_tokens=64)
    cap=int(share*L.total_expert_full)
    cache = rt._new_cache({"full": cap}); old = rt.swap_cache(cache)
    try:
        fills=[]
        for j in (1,2):
            r1=[]; t1,d1=P._run_stream(model, rt, torch.tensor([prompts[j]]), forced[j], routing=r1); fills += layer_calls_from_steps(r1)
            print("fill", j, "mean", np.mean(t1)*1000, "merge/tensor", d1["time_s"]["merge"]/max(1,d1["hits"]["none"])*1000, "used", cache.pools["full"].used/2**20, "of", cap/2**20)
        r0=[]; t0,d0=P._run_stream(model, rt, torch.tensor([prompts[0]]), forced[0], routing=r0)
    finally:
        rt.swap_cache(old)
    print({k: round(v/len(t0)*1000,2) for k,v in d0["time_s"].items()}, "ms per step", [round(x*1000,1) for x in t0]); print("timed mean", np.mean(t0)*1000, "merge/tensor", d0["time_s"]["merge"]/max(1,d0["hits"]["none"])*1000, d0["hits"])
    m = model_run(r0, P._PoolsView(rt, cap), {"step_costs": sc}, prefill_steps=1, before=fills)
    print("model (unscaled)", m["model_tpot_s"]*1000, m["model_hits"])
