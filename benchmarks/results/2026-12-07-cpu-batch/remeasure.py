"""The four-row passes with more timed steps: measure_batch(tokens=N) twice, each into its own copy of the profile."""
import json, sys, time
from zipmoe.codecs.reader import ContainerReader
from zipmoe.runtime.plan.layout import container_layout
from zipmoe.runtime.plan.batched import measure_batch

path, prof_in, tokens, reps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
prof = json.load(open(prof_in))
with ContainerReader(path) as r:
    layout = container_layout(r, prof.get("dtype", "auto"), "cpu")
for i in range(reps):
    t0 = time.time()
    got = measure_batch(path, layout, 4, device="cpu", workers=1, tokens=tokens, load_options={"readers": 4})
    sc = got["step_costs"]
    print(json.dumps({"rep": i, "tokens": tokens, "s": round(time.time() - t0, 1), "resident": sc["resident_step_s"],
                      "per_expert_s": sc["per_expert_s"], "experts_per_layer": got["experts_per_layer"]}), flush=True)
    out = dict(prof, batches={"4": got})
    json.dump(out, open(f"/tmp/b4x/profile-t{tokens}-r{i}.json", "w"))
