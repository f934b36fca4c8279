"""Benchmarks: `fastddpm bench throughput`, `ladder`, `samplers` and `quality`, timed with fastddpm.measure.

- bench/store.py              result files written atomically after every item, and the resume that reuses them
- bench/throughput.py         images/s, compile time, MFU, memory, recompiles and input wait per preset x batch size
  bench/throughput_report.py  its progress lines, markdown table and report
- bench/ladder.py             the optimisation ladder (rungs in bench/ladder_rungs.py, the MLP ladder in bench/mlp.py)
- bench/samplers.py           FID against network calls per image, for every sampler
- bench/quality.py            time to quality: wall time to a target FID
- bench/cli.py                the `bench` sub-command: add_bench_parser(subparsers) and run_bench(args)

The top-level CLI wires it with `from fastddpm.bench.cli import add_bench_parser, run_bench`.
"""
