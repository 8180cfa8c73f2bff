"""zipmoe.runtime: expert store, cache pools, planner, scheduler, transformers integration."""
