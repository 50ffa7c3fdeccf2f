"""Offline tools, apart from what a worker runs: capacity planner, KV calibration, checkpoint conversion,
quality metrics and eval, training of the default model, the demo checkpoint, kernel benchmarks and fault
injection for tests. Nothing in the serving path (pools, engine and below) imports this package."""
