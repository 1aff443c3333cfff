"""Compile cache hits before export (frontend/module_identity.py): a model built only from
kiln's and torch.nn's modules is found by its module tree, so a second compile skips
torch.export; anything that could change its program is a miss or no identity at all."""

import pytest
import torch

import kiln
from kiln.frontend.module_identity import module_identity
from kiln.models.hf import build_model
from kiln.models.llama import PRESETS

pytestmark = pytest.mark.compile_cache


def _mlp(slope=0.1):
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LeakyReLU(slope),
                               torch.nn.Linear(32, 16)).eval()


def _compile(model, x):
    T = kiln.Dim("tokens", min=1, max=64)
    return kiln.compile(model, (x,), dynamic_shapes=({0: T},))


def _exported(exe) -> bool:
    return "import/export/capture" in exe.compile_timings


def _check(exe, model, x):
    want = model(x)
    assert ((exe(x) - want).norm() / want.norm()).item() < 1e-5


def test_second_compile_skips_export_and_reads_the_new_weights():
    x = torch.randn(6, 16)
    a = _compile(_mlp(), x)
    assert _exported(a)
    other = _mlp()  # same modules, other weights
    b = _compile(other, x)
    assert not _exported(b) and "compile_cache" in b.compile_timings
    _check(b, other, x)
    x = torch.randn(11, 16)  # another size within the dynamic dim's bounds
    _check(b, other, x)


def test_a_changed_attribute_is_another_program():
    x = torch.randn(6, 16)
    _compile(_mlp(0.1), x)
    steeper = _mlp(0.5)
    b = _compile(steeper, x)
    assert _exported(b)
    _check(b, steeper, x)


def test_hooks_replaced_methods_and_foreign_modules_have_no_identity():
    x = torch.randn(6, 16)
    _compile(_mlp(), x)
    hooked = _mlp()
    hooked[1].register_forward_hook(lambda m, i, o: o * 3)
    assert module_identity(hooked) is None
    b = _compile(hooked, x)
    assert _exported(b)
    _check(b, hooked, x)
    patched = _mlp()
    patched[1].forward = lambda h: h * 2
    assert module_identity(patched) is None

    class Doubled(torch.nn.Module):  # a user's class: its code is not kiln's or torch's
        def forward(self, h):
            return h * 2

    assert module_identity(torch.nn.Sequential(torch.nn.Linear(4, 4), Doubled())) is None


def test_identity_follows_weights_layout_dtype_and_mode():
    base = module_identity(_mlp())
    assert base is not None and module_identity(_mlp()) == base
    assert module_identity(_mlp().half()) != base
    assert module_identity(_mlp().train()) != base
    tied = _mlp()
    tied[2].weight = torch.nn.Parameter(tied[0].weight.detach().t().contiguous())
    assert module_identity(tied) == base  # a new tensor of the same layout
    tied[2].weight = torch.nn.Parameter(tied[0].weight.t())  # now a view of another weight
    assert module_identity(tied) != base


def test_kiln_models_have_an_identity_their_config_decides():
    cfg = PRESETS["tiny"]
    a = module_identity(build_model(cfg))
    assert a is not None and a == module_identity(build_model(cfg))
    assert module_identity(build_model(cfg.with_(rope_theta=cfg.rope_theta * 2))) != a


def test_workers_start_on_a_miss_only(monkeypatch):
    """A compile that will build kernels starts the tuner's workers before export; one
    the cache answers starts none (tuner.start_workers, gated by target in its tests)."""
    import kiln.api

    calls = []
    monkeypatch.setattr(kiln.api, "start_workers", lambda tgt, options: calls.append(tgt))
    x = torch.randn(6, 16)
    _compile(_mlp(), x)
    assert calls  # before export, and again (a no-op there) before the passes
    calls.clear()
    assert not _exported(_compile(_mlp(), x)) and calls == []
