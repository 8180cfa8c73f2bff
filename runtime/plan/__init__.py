"""The planner: hardware profile, activation statistics, the cost model and simulator, the partition search, plan.json and its measured check."""
