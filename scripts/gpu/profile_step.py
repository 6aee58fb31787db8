"""Where a DataParallel step's time goes on one GPU (1 rank): torch.profiler
tables of ResNet-18 (CIFAR, batch 128) training steps, local vs mpidp blocking
vs non-blocking, each on the default path (buckets summed on the device by
NCCL) and, suffixed "-staged", through host buffers (MPIDP_DP_DEVICE_COMM=staging).
The rows to read are aten::copy_ and cudaStreamSynchronize (staging: device ->
pinned host -> device), ncclDevKernel (the device path's sums) and
AccumulateGrad's self time (mpidp's gradient hooks run inside it).

    PYTHONPATH=python python3 scripts/gpu/profile_step.py   # after scripts/gpu_check.sh --only build
"""
import os, sys, time, torch, torch.nn.functional as F
sys.path.insert(0, "benchmarks")
import mpidp
from models import ResNet18
from torch.profiler import profile, ProfilerActivity
dev = torch.device("cuda", 0)
torch.manual_seed(0)
x = torch.randn(128, 3, 32, 32, device=dev); y = torch.randint(0, 10, (128,), device=dev)
def make(mode):
    m = ResNet18().to(dev)
    if mode == "local":
        o = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9); return m, o
    o = mpidp.DataParallelOptimizer(torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9))
    os.environ["MPIDP_DP_DEVICE_COMM"] = "staging" if mode.endswith("-staged") else "auto"
    return mpidp.DataParallel(m, optimizer=o, blocking_parameter_updates=mode.startswith("block")), o
for mode in ("local", "block", "nb", "block-staged", "nb-staged"):
    net, opt = make(mode)
    def step():
        opt.zero_grad(); F.cross_entropy(net(x), y).backward(); opt.step()
    for _ in range(5): step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20): step()
    torch.cuda.synchronize()
    path = ("device" if net._reducer.device_resident else "staged") if mode != "local" else "-"
    print(f"{mode}: {1e3*(time.perf_counter()-t0)/20:.2f} ms/step, path {path}")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5): step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=14, max_name_column_width=40))
