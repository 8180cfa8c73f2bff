"""The benchmark harness: engines in their own processes and memory cgroups, cold runs, the report."""
