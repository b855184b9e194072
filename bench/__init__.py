"""The benchmarks of the pipeline's speed and size goals (`make bench`, docs/results/benchmarks.md). Run each from the repository root as a module:
`python -m bench.run_all --out bench/results`, `python -m bench.bench_step --help`. `bench.common` holds what the
scripts share; `bench.reference_step` and `bench.tiny` hold the reference step and the tiny real inputs that the
benchmarks and the tests both use (tests import from bench, never the other way)."""
