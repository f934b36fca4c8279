"""Benchmarks of the training step: `fastddpm bench throughput` (and later benchmarks built on bench.timing).

- bench/timing.py      shared helpers: CUDA-event timing, the matmul peak, FLOP counting, the environment record
- bench/throughput.py  images/s, compile time, MFU, memory, recompiles and input wait per preset x batch size
- bench/cli.py         the `bench` sub-command: add_bench_parser(subparsers) and run_bench(args)

The top-level CLI wires it with `from fastddpm.bench.cli import add_bench_parser, run_bench`.
"""
