# The demo at 800M on the CPU box: full tensors only against the default plan (zipmoe-default: fitted at load
# from this machine's cached profile, as chat does) and the explicit engine zipmoe, paired round by round.
cd /tmp
HF_HUB_OFFLINE=1 /work/main/.venv/bin/zipmoe bench /work/main/out/demo.zmoe --engine zipmoe-basic --engine zipmoe-default \
    --engine zipmoe-pools --budget 800M --device cpu --new-tokens 64 --runs 1 --rounds 4 --cold --json /tmp/rounds/rounds.json
