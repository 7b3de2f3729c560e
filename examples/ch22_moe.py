"""Chapter 22: a mixture of experts on the GPU - routing, grouping tokens by expert, one kernel.

Routes six tokens to two of four experts each, shows how the (token, slot) pairs are sorted
by expert and padded into blocks of four rows (one expert per block; the kernel itself uses
16, the least `tl.dot` takes on a GPU), then runs the fused Triton kernel and the reference
loop over experts and compares them. On a CPU the kernel
runs in Triton's interpreter; on a GPU it is compiled.
"""

import os

import torch

device = "cuda" if torch.cuda.is_available() else "cpu"
if device == "cpu":  # must be set before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

from minisgl.kernels.moe import fused_moe, group_by_expert  # noqa: E402
from minisgl.layers.moe import Experts  # noqa: E402
from minisgl.models.qwen3_moe import Qwen3MoeForCausalLM  # noqa: E402

torch.manual_seed(0)
tokens, num_experts, top_k, hidden, inter, block_m = 6, 4, 2, 32, 16, 4

# The router: softmax over the experts, keep the top k, renormalise (as MoEBlock does).
logits = torch.randn(tokens, num_experts)
logits[:, 3] -= 5.0  # make expert 3 unpopular: it will get no tokens
weights, ids = logits.softmax(dim=-1).topk(top_k, dim=-1)
weights = weights / weights.sum(dim=-1, keepdim=True)
for t in range(tokens):
    routes = ", ".join(f"expert {e} x {w:.2f}" for e, w in zip(ids[t].tolist(), weights[t]))
    print(f"token {t}: {routes}")

groups = group_by_expert(ids, num_experts, block_m)
counts = torch.bincount(ids.flatten(), minlength=num_experts)  # for printing only
print(f"\npairs per expert: {counts.tolist()}; blocks of {block_m} rows, 'token.slot' per row:")
num_pairs = ids.numel()
for b, expert in enumerate(groups.block_expert.tolist()):
    rows = groups.pair_of_row[b * block_m : (b + 1) * block_m].tolist()
    cells = [f"{p // top_k}.{p % top_k}" if p < num_pairs else "pad" for p in rows]
    owner = f"expert {expert}" if expert < num_experts else "idle    "
    print(f"  block {b} {owner}: {' '.join(f'{c:>4}' for c in cells)}")

experts = Experts(num_experts, hidden, inter).to(device)
torch.nn.init.normal_(experts.gate_up_proj, std=hidden**-0.5)
torch.nn.init.normal_(experts.down_proj, std=inter**-0.5)
x = torch.randn(tokens, hidden, device=device)
with torch.inference_mode():
    args = (x, ids.to(device), weights.to(device))
    fused = fused_moe(x, experts.gate_up_proj, experts.down_proj, *args[1:])
    reference = experts.forward_reference(*args)
error = (fused - reference).abs().max().item()
print(f"\nfused on {device}: max |fused - reference| = {error:.1e}")
print("fused == reference:", torch.allclose(fused, reference, rtol=1e-4, atol=1e-4))
print("Qwen3-MoE decode graphs blocked by:", Qwen3MoeForCausalLM.cuda_graph_blocker)
