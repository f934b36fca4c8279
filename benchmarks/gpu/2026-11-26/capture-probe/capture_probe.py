"""Which setting breaks whole-step CUDA graph capture: each variant trains a few steps in its own process and
prints the full exception chain (the CLI prints only the summary)."""
import os, subprocess, sys, time, traceback

DATA = os.environ.get("FASTDDPM_FMNIST_DIR", ".data/fashion-mnist")
BASE = ["--data", DATA, "--max-steps", "12", "--log-every", "4"]
CIFAR = ["--preset", "ddpm-cifar10", "--batch-size", "128", "--resize", "32", "--image-mode", "RGB"]
VARIANTS = {
    "cifar-compile-default": CIFAR,
    "cifar-compile-dropout0": CIFAR + ["--dropout", "0"],
    "cifar-eager-capture": CIFAR + ["--compile", "off", "--cuda-graphs", "capture"],
    "cifar-compile-nocudnnbench": CIFAR + ["--cudnn-benchmark", "off"],
    "cifar-compile-reduce-overhead": CIFAR + ["--cuda-graphs", "reduce-overhead"],
    "seed1-compile-default": ["--preset", "seed-1layer", "--batch-size", "1024"],
}

def child(name):
    import fastddpm.trainer.loop as loop
    real = loop.train
    def wrapped(*a, **k):
        try:
            return real(*a, **k)
        except BaseException:
            traceback.print_exc()
            raise
    loop.train = wrapped
    from fastddpm.cli import main
    sys.exit(main(["train", *BASE, *VARIANTS[name], "--out", f"/tmp/probe/{name}"]))

if __name__ == "__main__":
    if len(sys.argv) > 1:
        child(sys.argv[1])
    out = os.environ.get("OUT", "/tmp")
    procs = {}
    for name in VARIANTS:
        log = open(f"{out}/probe-{name}.log", "w")
        procs[name] = (subprocess.Popen([sys.executable, __file__, name], stdout=log, stderr=subprocess.STDOUT), time.time())
    for name, (p, t0) in procs.items():
        try:
            rc = p.wait(timeout=max(1, 330 - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            p.kill(); rc = "timeout"
        print(f"== {name}: rc {rc} after {time.time() - t0:.0f} s", flush=True)
