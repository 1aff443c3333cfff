"""The two seed errors of DESIGN.md failures 2 and 4 as a user sees them (Python's last
traceback lines), on the CPU, compile-only:

    PYTHONPATH=. python benchmarks/issue9_seed_errors.py

1. AffinityError: contradictory pins, in the model's own code (one op reads tensors
   created on cuda:0 and cuda:1) and through pins= (a tied embedding / LM head pinned to
   two pipeline stages).
2. DeviceError: the Llama-2-70B-shaped TP8 plan (80 layers, meta device, cuda:sm_90)
   with one device declared; and a model whose code pins tensors to cuda:0..7.
"""

from __future__ import annotations

import traceback

import torch

import kiln
from benchmarks.llama2_70b_plan import model as llama2_70b
from kiln.models.llama import example_inputs, tiny_llama


class MixesDevices(torch.nn.Module):
    def forward(self, x):
        a = torch.ones(4, device="cuda:0")
        b = torch.ones(4, device="cuda:1")
        return x + (a + b).to("cpu")  # one op reading tensors pinned to two devices


class PinsEightDevices(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lins = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(8))

    def forward(self, x):
        for i, lin in enumerate(self.lins):
            x = lin(x) + torch.ones(8, device=f"cuda:{i}").to("cpu")
        return x


def show(title: str, fn) -> None:
    print(f"### {title}\n")
    try:
        fn()
    except kiln.errors.KilnError as e:
        print("".join(traceback.format_exception_only(e)).rstrip())
    else:
        print("(no error: that is a bug)")
    print()


def tied_pins():
    model = tiny_llama(tie_word_embeddings=True)
    args, ds = example_inputs(model.cfg)
    kiln.compile(model, args, dynamic_shapes=ds, compile_to="parallel",
                 parallel={"pp": 2, "rank": 0},
                 pins={"model.embed_tokens.weight": 0, "lm_head.weight": 1})


if __name__ == "__main__":
    show("AffinityError: the model's code pins one op's operands to two devices",
         lambda: kiln.compile(MixesDevices(), (torch.randn(4),)))
    show("AffinityError: tied weights pinned to two devices (pins=, PP2)", tied_pins)
    model, args = llama2_70b()
    show("DeviceError: Llama-2-70B-shaped TP8 plan (80 layers, meta, cuda:sm_90), "
         "devices=1",
         lambda: kiln.compile(model, args, target="cuda:sm_90",
                              parallel={"tp": 8, "rank": 0}, devices=1))
    show("DeviceError: a model whose code pins tensors to cuda:0..cuda:7, one device",
         lambda: kiln.compile(PinsEightDevices(), (torch.randn(2, 8),)))
