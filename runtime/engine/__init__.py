"""The serving runtime: load a container as a transformers model, fetch experts on demand (store, cache pools, scheduler), counters, traces and the chat loop."""
