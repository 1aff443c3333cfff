"""Make a region's kernel fit the target; split the region when no config can.

For a GPU target, the generator's configs are filtered by the resource model
(`resources.estimate`), so the tuner never spends a compile on a config that cannot
fit. When the model leaves nothing, or leaves only configs close to the limit, the
smallest config is compiled (compile-only) and its real figures decide. If even the
smallest config is over the limit and the region has prologue ops fused into its
anchor (RoPE into attention), one prologue at a time is split off into a region of
its own (kiln.dispatch.split) and the region is generated again. Codegen may call
dispatch: it is the earlier stage.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from kiln.codegen.triton import resources
from kiln.codegen.triton.compiler import compile_binary
from kiln.codegen.triton.spec import KernelSpec
from kiln.dispatch import split
from kiln.ir.plan import DispatchPlan, Region
from kiln.target import Target

log = logging.getLogger("kiln.codegen")

# Estimates below this share of the limit are trusted without a confirming compile.
TRUSTED_SHARE = 0.75
# Which prologue comes out first: operands read in the key loop cost once per stage.
_SPLIT_ORDER = {"key": 0, "value": 1, "attn_mask": 2, "query": 3}

Generator = Callable[[Region, DispatchPlan, Target], KernelSpec | None]


def fitted_spec(region: Region, plan: DispatchPlan, target: Target,
                generate: Generator) -> KernelSpec | None:
    """`generate`'s spec for `region`, keeping only configs that can fit `target`.

    May split `region` (adding regions to `plan` before it). None when no kernel of
    this template fits or applies; `region.notes` then says why.
    """
    while True:
        spec = generate(region, plan, target)
        if spec is None or not target.is_gpu:
            return spec
        spec, why = _fit(spec, target)
        if spec is not None:
            return spec
        operand = _next_split(region)
        if operand is None:
            region.notes.append(f"extern: {why}")
            return None
        split.split_prologue(plan, region, operand, why)


def _next_split(region: Region) -> str | None:
    operands = split.splittable_operands(region)
    if not operands:
        return None
    anchor = region.anchor()
    return min(operands, key=lambda o: _SPLIT_ORDER.get(split.operand_role(anchor, o), 9))


def _fit(spec: KernelSpec, target: Target) -> tuple[KernelSpec | None, str]:
    fit = resources.fitting_configs(spec, target)
    limit = target.shared_mem_per_block
    trusted = [c for c in fit.configs
               if resources.estimate(spec, c, target).shared <= TRUSTED_SHARE * limit]
    if trusted:
        return _keep(spec, fit.configs), ""
    config = fit.smallest
    try:
        real = compile_binary(spec, config, target).resources
    except Exception as e:  # a compiler failure is the tuner's to record, not a size verdict
        log.info("could not confirm %s [%s]: %s", spec.name, config, e)
        return (_keep(spec, fit.configs), "") if fit.configs else (None, f"[{config}]: {e}")
    log.info("%s [%s]: %s", spec.name, config, resources.compare(fit.smallest_estimate, real))
    over = resources.violations(real, target)
    if not over:
        return _keep(spec, [config] + [c for c in fit.configs if c != config]), ""
    why = (f"on {target} the smallest config of its {spec.template} kernel [{config}] needs "
           + "; ".join(over))
    return None, why


def _keep(spec: KernelSpec, configs) -> KernelSpec:
    default = spec.default if spec.default in configs else configs[0]
    return dataclasses.replace(spec, configs=list(configs), default=default)
