"""The ranges the doctor records in every profiled step, by name: session.py opens them with
torch.autograd.profiler.record_function, trace.py finds the steps and data waits by them in the exported trace."""

STEP_MARK = "fastddpm::step"
DATA_MARK = "fastddpm::data_wait"
# a closure passed to optimizer.step(closure) (Lightning's automatic optimization, LBFGS): the loop's own forward
# and backward, run inside torch.optim's `Optimizer.step#` range but not the optimizer's work
CLOSURE_MARK = "fastddpm::closure"

# Our record_function ranges as the host thread wrote them. On a CUDA trace Kineto also writes each range a
# second time, as cat "gpu_user_annotation" on the GPU timeline (spanning the kernels launched inside it):
# counting that copy would count every range twice.
HOST_MARK_CATS = ("user_annotation", "cpu_op", None)
