"""Why `bench throughput` fails to capture ddpm-cifar10's step when `train` captures it: each variant patches one
difference away in its own process and prints the full exception chain."""
import os, subprocess, sys, time, traceback

VARIANTS = ["as-is", "no-flops", "no-bytes", "no-counts", "no-dropout", "no-counts-no-dropout"]

def child(name):
    import torch
    import fastddpm.bench.variant_timer as vt
    real_failed = vt.failed_row
    def failed_row(v, e):
        traceback.print_exception(e)
        return real_failed(v, e)
    vt.failed_row = failed_row
    import fastddpm.bench.throughput as th
    th.failed_row = failed_row
    if "no-counts" in name or name == "no-flops":
        vt.count_step_flops = lambda *a, **k: 1.0e12
    if "no-counts" in name or name == "no-bytes":
        vt.count_step_bytes = lambda *a, **k: {"bytes_per_image": 1.0e6}
    if "no-dropout" in name:
        real_build = vt.build_model
        def build_model(*a, **k):
            model, schedule = real_build(*a, **k)
            for m in model.modules():
                if isinstance(m, torch.nn.Dropout):
                    m.p = 0.0
            return model, schedule
        vt.build_model = build_model
    from fastddpm.cli import main
    sys.exit(main(["bench", "throughput", "--presets", "ddpm-cifar10", "--batch-sizes", "128", "--choices",
                   "auto-compile", "--steps", "10", "--repeats", "2", "--out", f"/tmp/bprobe/{name}"]))

if __name__ == "__main__":
    if len(sys.argv) > 1:
        child(sys.argv[1])
    out = os.environ.get("OUT", "/tmp")
    procs = {}
    for name in VARIANTS:
        log = open(f"{out}/bprobe-{name}.log", "w")
        procs[name] = (subprocess.Popen([sys.executable, __file__, name], stdout=log, stderr=subprocess.STDOUT), time.time())
    for name, (p, t0) in procs.items():
        try:
            rc = p.wait(timeout=max(1, 300 - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            p.kill(); rc = "timeout"
        print(f"== {name}: rc {rc} after {time.time() - t0:.0f} s", flush=True)
