"""GPU check of the Python layer on the CUDA kernels (run by benchmarks/gpu_check.sh, stage
`models`): the MHA drop-in against torch.nn.MultiheadAttention, KV-cache generation against
no-cache generation, and a Transformer training step, on CUDA tensors. Prints one line per
check and exits non-zero on a failure."""
import sys

import torch

import attention_ext as ae
from attention_ext.models import LanguageModel, LMConfig
from attention_ext.nn import MultiheadAttention

dev = "cuda"
fails = 0


def report(name, ok, detail=""):
    global fails
    fails += 0 if ok else 1
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}")


assert ae.softmax.ops.has_kernel(torch.device(dev)), "no CUDA kernel registered"
torch.manual_seed(0)
for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 3e-2)):
    ref = torch.nn.MultiheadAttention(256, 8, batch_first=True).to(dev, dtype)
    ours = MultiheadAttention(256, 8, batch_first=True).to(dev, dtype)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(4, 100, 256, device=dev, dtype=dtype)
    pad = torch.zeros(4, 100, dtype=torch.bool, device=dev)
    pad[1, 70:] = True
    o1, w1 = ref(x, x, x, key_padding_mask=pad)
    o2, w2 = ours(x, x, x, key_padding_mask=pad)
    err = ((o1.float() - o2.float()).abs().max() / o1.float().abs().max()).item()
    werr = (w1.float() - w2.float()).abs().max().item()
    report(f"MultiheadAttention {dtype}", err < tol and werr < tol, f"out err {err:.2e}, weights err {werr:.2e}")

cfg = LMConfig(vocab_size=64, block_size=64, n_layers=2, n_heads=4, n_kv_heads=2, d_model=64)
lm = LanguageModel(cfg).to(dev).eval()
prompt = torch.randint(0, 64, (2, 5), device=dev)
with torch.no_grad():
    a = lm.generate(prompt, 40, greedy=True, use_cache=True)
    b = lm.generate(prompt, 40, greedy=True, use_cache=False)
report("LM greedy generation, KV cache == no cache", torch.equal(a, b))

lm.train()
opt = torch.optim.AdamW(lm.parameters(), lr=1e-3)
idx = torch.randint(0, 64, (8, 64), device=dev)
losses = []
for _ in range(30):
    _, loss = lm(idx[:, :-1], idx[:, 1:])
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
report("LM training steps on CUDA", losses[-1] < losses[0] and all(map(lambda v: v == v, losses)),
       f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
sys.exit(1 if fails else 0)
