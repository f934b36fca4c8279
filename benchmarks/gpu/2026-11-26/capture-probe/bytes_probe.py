"""Which part of count_step_bytes breaks the later whole-step capture of ddpm-cifar10 (bench throughput)."""
import contextlib, copy, os, subprocess, sys, time, traceback

VARIANTS = ["deepcopy", "no-forkrng", "no-autocast", "no-hooks", "no-castcheck"]

def child(name):
    import torch
    import fastddpm.measure as me
    import fastddpm.bench.variant_timer as vt
    import fastddpm.bench.throughput as th
    real_failed = vt.failed_row
    def failed_row(v, e):
        traceback.print_exception(e)
        return real_failed(v, e)
    vt.failed_row = th.failed_row = failed_row
    if name == "no-castcheck":
        me._is_cast_of_leaf = lambda t: False
    def count_step_bytes(model, image_shape, *, images_per_step, device, autocast_dtype):
        device = torch.device(device)
        if name == "deepcopy":
            model = copy.deepcopy(model)
        saved = []
        for probe in (1, 2):
            gen = torch.Generator(device=device).manual_seed(0)
            x = torch.randn(probe, *image_shape, device=device, generator=gen)
            t = torch.zeros(probe, dtype=torch.long, device=device)
            ctx = torch.autocast(device.type, dtype=autocast_dtype) if name != "no-autocast" else contextlib.nullcontext()
            rng = torch.random.fork_rng(devices=[device]) if name != "no-forkrng" else contextlib.nullcontext()
            hooks = me.SavedTensors() if name != "no-hooks" else contextlib.nullcontext()
            with rng, hooks as counted, ctx:
                loss = model(x, t).float().square().mean()
            del loss
            saved.append(counted.total_bytes() if counted is not None else 0)
        a = max(0, saved[1] - saved[0])
        return {"activation_bytes_per_image": a, "update_bytes_per_step": 1e8, "bytes_per_image": 2 * a + 1e6}
    vt.count_step_bytes = count_step_bytes
    from fastddpm.cli import main
    sys.exit(main(["bench", "throughput", "--presets", "ddpm-cifar10", "--batch-sizes", "128", "--choices",
                   "auto-compile", "--steps", "10", "--repeats", "2", "--out", f"/tmp/yprobe/{name}"]))

if __name__ == "__main__":
    if len(sys.argv) > 1:
        child(sys.argv[1])
    out = os.environ.get("OUT", "/tmp")
    procs = {}
    for name in VARIANTS:
        log = open(f"{out}/yprobe-{name}.log", "w")
        procs[name] = (subprocess.Popen([sys.executable, __file__, name], stdout=log, stderr=subprocess.STDOUT), time.time())
    for name, (p, t0) in procs.items():
        try:
            rc = p.wait(timeout=max(1, 230 - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            p.kill(); rc = "timeout"
        print(f"== {name}: rc {rc} after {time.time() - t0:.0f} s", flush=True)
