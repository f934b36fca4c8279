"""Benchmarks of the training step: `fastddpm bench throughput`, `ladder` and `quality`, built on bench.timing.

- bench/timing.py      shared helpers: CUDA-event timing, the matmul peak, FLOP counting, the environment record
- bench/store.py       result files written atomically after every item, and the resume that reuses them
- bench/throughput.py  images/s, compile time, MFU, memory, recompiles and input wait per preset x batch size
- bench/ladder.py      the optimisation ladder (rungs in bench/ladder_rungs.py, the MLP ladder in bench/mlp.py)
- bench/quality.py     time to quality: wall time to a target FID
- bench/cli.py         the `bench` sub-command: add_bench_parser(subparsers) and run_bench(args)

The top-level CLI wires it with `from fastddpm.bench.cli import add_bench_parser, run_bench`.
"""
