"""The rules on hand-made step records: which numbers fire which finding, and which never make a verdict."""

from __future__ import annotations

from fastddpm.doctor.rules import evaluate, verdict


def steps(n=20, host=10.0, wait=0.2, **over):
    out = [{"index": i, "host_ms": host, "data_wait_ms": wait, "data_cpu_ms": 0.0, "epoch_start": False,
            "gpu_ms": None, "recompiles": 0} for i in range(n)]
    for i, fields in over.items():
        out[int(i[1:])].update(fields)
    return out


def run(step_list, **m):
    meas = {"device": "cpu", "steps": step_list, "trace": None, "step_stats": {}, **m}
    found, unavailable = evaluate(meas)
    return verdict(found, meas), {f.id: f for f in found}, unavailable


def test_epoch_start_stall_spent_waiting_for_data_is_an_epoch_spike():
    v, found, _ = run(steps(s5={"epoch_start": True, "host_ms": 200.0, "data_wait_ms": 190.0},
                            s15={"epoch_start": True, "host_ms": 180.0, "data_wait_ms": 170.0}))
    assert v["id"] == "epoch-spikes"
    assert "2 of 2 epoch-start steps" in found["epoch-spikes"].evidence[0]


def test_a_slow_epoch_start_step_that_computed_is_noise_not_an_epoch_spike():
    v, found, _ = run(steps(s5={"epoch_start": True, "host_ms": 200.0, "data_wait_ms": 0.2}))
    assert "epoch-spikes" not in found
    assert v["healthy"]


def test_data_wait_under_threshold_is_healthy_and_over_it_is_data_bound():
    assert run(steps(wait=0.5))[0]["healthy"]  # 5%
    v, found, _ = run(steps(wait=3.0))  # 30%
    assert v["id"] == "data-bound" and abs(v["cost"] - 0.3) < 1e-9


def test_fastddpm_context_fixes_are_trainer_flags():
    _, found, _ = run(steps(wait=5.0))
    assert any(f.fastddpm and f.fastddpm.startswith("--data-placement device") for f in found["data-bound"].fixes)


def test_memory_headroom_is_an_opportunity_never_the_verdict():
    v, found, _ = run(steps(), device="cuda:0",
                      memory={"peak_allocated_bytes": 2**30, "total_bytes": 80 * 2**30, "free_bytes": 0,
                              "peak_share": 1 / 80})
    assert found["memory-headroom"].kind == "opportunity"
    assert v["healthy"]


def test_drift_with_falling_clocks_is_called_throttling():
    ss = {"first_fifth_median_ms": 10.0, "last_fifth_median_ms": 12.0}
    t0 = {"sm_clock_mhz": 1980.0, "temperature_c": 60.0, "power_w": 600.0, "source": "nvml"}
    t1 = {"sm_clock_mhz": 1500.0, "temperature_c": 87.0, "power_w": 600.0, "source": "nvml"}
    _, found, _ = run(steps(), device="cuda:0", step_stats=ss, telemetry_start=t0, telemetry_end=t1)
    assert "throttling" in found["drift"].cause and found["drift"].kind == "note"
    _, found, unavailable = run(steps(), step_stats=ss)
    assert "cannot tell throttling" in found["drift"].cause
    assert "15 (clocks)" in unavailable


def test_recompiles_after_warmup_name_the_step():
    v, found, _ = run(steps(s7={"recompiles": 1, "host_ms": 400.0}),
                      compile={"recompiles_after_warmup": 1, "graph_breaks_after_warmup": 0, "cudagraph_skips": 0})
    assert v["id"] == "recompiles"
    assert "step(s) 7 (400 ms" in found["recompiles"].evidence[1]
