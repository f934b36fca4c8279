"""The trainer: `fastddpm train`, and `fastddpm.train(...)` from Python (fastddpm.api.train).

One batch, from the cache to the loss: batches.py (the batch on the device) -> step.py (the TrainStep: loss,
backward, update, EMA) -> diffusion/objective.py (the loss). Around it:

    setup.py           prepare_run: everything settled before the first step, into one Run, each choice with its
                       reason (Choices -> the log and run.json)
    loop.py            train(): the loop, top to bottom, and what it calls (StepLog, health checks, OOM re-split)
    state.py           TrainState: step, images seen, micro-batch split, RNG (saved by the Checkpointer)
    build.py           the U-Net and its Optimization (EMA, AdamW, scaler, the TrainStep), shared with bench
    fast_path.py       compile, CUDA graphs, channels_last, cuDNN autotuning: what auto turns on, and why
    batch_finder.py    --batch-size auto: the throughput knee
    fsdp.py            --parallel fsdp: fully_shard per U-Net block
    ema.py, loggers.py, compile_counters.py
"""
