"""The ranges the doctor records in every profiled step, by name: session.py opens them with
torch.autograd.profiler.record_function, trace.py finds the steps and data waits by them in the exported trace."""

STEP_MARK = "fastddpm::step"
DATA_MARK = "fastddpm::data_wait"

# Our record_function ranges as the host thread wrote them. On a CUDA trace Kineto also writes each range a
# second time, as cat "gpu_user_annotation" on the GPU timeline (spanning the kernels launched inside it):
# counting that copy would count every range twice.
HOST_MARK_CATS = ("user_annotation", "cpu_op", None)
