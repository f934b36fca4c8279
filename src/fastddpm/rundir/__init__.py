"""Everything a run leaves on disk, with one owner: the layout of a run directory, atomic and verified files,
safetensors and state dicts, the two checkpoint formats (a verified .pt file; FSDP's sharded .dcp directory),
the Checkpointer that alone knows what a checkpoint holds, metrics.jsonl, and `locate`, which turns any path a
user passes (a run directory, a checkpoint, a .dcp folder, an ema.safetensors) into what it holds.

Ground floor: imports nothing of fastddpm but the config, so every package may import it.

    layout.py        RunDir: where each file of a run lives; the run a checkpoint or export belongs to
    files.py         CheckpointError, atomic writes (temp, fsync, rename), safetensors read and write
    state_dicts.py   model and optimizer state dicts that load across wrappers (compile, DDP, FSDP) and devices
    checkpoint.py    the .pt format: checkpoints/ckpt_<step>.pt + .sha256, verified on load
    sharded.py       the .dcp format of --parallel fsdp: one shard file per rank, resharded on load
    checkpointer.py  Checkpointer: what a save writes (model, EMA, optimizer, scaler, train state), and its load
    locate.py        locate(path) -> Checkpoint: step, config and weights of whatever a path points to
    metrics.py       metrics.jsonl (and eval.jsonl): one JSON record per line, one history across resumes
    lock.py          RunFolderLock: one trainer per run folder (an flock on RUN/.train.lock)
    flock.py         what fastddpm's file locks share (no torch: the dataset cache's build lock imports it)
"""
