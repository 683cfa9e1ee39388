"""Hand-written equivalent: import torch, build model/data/optimizer, one step."""

import time

import torch

from benchmarks.startup import workload

model = workload.model()
ds = workload.dataset()
loader = torch.utils.data.DataLoader(ds, batch_size=32, shuffle=True)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # corelooper's default kernel
x, y = next(iter(loader))
loss = torch.nn.functional.cross_entropy(model(x), y)
loss.backward()
opt.step()
print(f"FIRST_STEP {time.time():.6f}", flush=True)
