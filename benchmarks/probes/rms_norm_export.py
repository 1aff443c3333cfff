"""Which ops nn.RMSNorm exports to on this device, before and after kiln's decompose."""
import torch

from kiln.frontend.export import decompose

m = torch.nn.RMSNorm(64).cuda().half()
ep = torch.export.export(m, (torch.randn(2, 64, device="cuda", dtype=torch.half),))
print("exported:", [str(n.target) for n in ep.graph.nodes if n.op == "call_function"])
print("decomposed:", [str(n.target) for n in decompose(ep).graph.nodes
                      if n.op == "call_function"])
