"""The import stage: nn.Module + example args -> KilnGraph (core ATen, symbolic dims).

torch.export captures the model; decompositions lower it to core ATen, except
`scaled_dot_product_attention`, which stays whole so attention can become one
region. Parameters and buffers stay named placeholders (never inlined).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import operator
import os
import re
import sys
import traceback
import warnings

import sympy
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._decomp import decomposition_table

from kiln.errors import (
    AffinityError,
    ExportError,
    KilnError,
    KilnWarning,
    ShapeError,
    UnsupportedOpError,
    library_frame,
    user_frame,
)
from kiln.frontend.decompositions import DECOMPOSE, FALLBACKS, OVERRIDES
from kiln.frontend.dim_names import dim_names
from kiln.frontend.int_args import captured_guards, declared_bounds, int_dims, size_checks
from kiln.frontend.lifted_buffers import export_with_state
from kiln.frontend.local_decompose import ShapesSpecialised, decompose_locally
from kiln.frontend.module_moves import noop_module_moves
from kiln.frontend.named_kwargs import kwargs_by_name
from kiln.frontend.none_outputs import drop_none_outputs
from kiln.frontend.raised_by_model import model_frame, raised_by_model
from kiln.frontend.reduction_shapes import fix_reduction_shapes
from kiln.frontend.scalar_index import select_by_tensor_as_index
from kiln.frontend.strided_views import in_order_as_strided_as_views
from kiln.frontend.tensor_index import TensorPositions
from kiln.frontend.train_mode import check_inference_mode
from kiln.frontend.unproven_guards import export_if_guards_hold, refused_for_a_guard
from kiln.ir import treespec
from kiln.ir.graph import GraphInput, GraphOutput, KilnGraph, where
from kiln.ir.ops import ASSERT_OPS, fallback_problem, is_known, op_name
from kiln.ir.symbolic import Bounds
from kiln.progress import phase

log = logging.getLogger("kiln.frontend")

# Ops kept whole instead of decomposed: LLM building blocks kiln fuses as a unit.
# Recurrent layers stay one op too: cuDNN / oneDNN run a whole sequence fused, and the
# per-step ops export would decompose them into were 7-12x slower than eager on an H100.
KEEP_WHOLE = [torch.ops.aten.scaled_dot_product_attention.default,
              torch.ops.aten.lstm.input, torch.ops.aten.gru.input,
              torch.ops.aten.rnn_tanh.input, torch.ops.aten.rnn_relu.input]


def export_model(model: torch.nn.Module, args: tuple, kwargs=None, dynamic_shapes=None):
    """torch.export with kiln's error messages."""
    with kwargs_by_name(model, kwargs or {}, dynamic_shapes) as shapes:
        return _export(model, args, kwargs, shapes)


def _export(model: torch.nn.Module, args: tuple, kwargs, dynamic_shapes):
    _check_dim_axes(model, args, kwargs or {}, dynamic_shapes)
    dynamic_shapes, _ = int_dims(model, args, kwargs or {}, dynamic_shapes)
    args, kwargs = _distinct_inputs(tuple(args), kwargs or {})
    registered: set[str] = set()

    def export(deferred: bool = False, positions: bool = False):
        with warnings.catch_warnings(), _quiet_failure(), noop_module_moves(), \
                (TensorPositions() if positions else contextlib.nullcontext()):
            warnings.simplefilter("ignore", FutureWarning)  # torch-internal deprecations
            return export_with_state(lambda: torch.export.export(
                model, tuple(args), kwargs=kwargs or {}, dynamic_shapes=dynamic_shapes,
                strict=False, prefer_deferred_runtime_asserts_over_guards=deferred,
            ), model)

    while True:
        try:
            return export()
        except KilnError:
            raise
        except Exception as e:  # torch raises many types; all mean "could not capture"
            if refused_for_a_guard(str(e)):
                ep = export_if_guards_hold(lambda: export(deferred=True))
                if ep is not None:
                    return ep
            if _guarded_on_data(e):
                ep = _with_positions(lambda: export(positions=True))
                if ep is not None:
                    return ep
            cls = _unknown_dataclass(str(e)) or _unhashable_output(e)
            if cls is None or cls in registered:
                raise _export_error(e) from None
            registered.add(cls)  # a dataclass of tensors: a pytree node, then try again


def _distinct_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The example inputs with every tensor that shares memory with an earlier one
    (`(x, x)`, a common way to write a test) replaced by a copy. torch.export traces
    such inputs as one value, so `forward(x, y): x + y` exported from `(x, x)` became
    `y + y` and ignored its first argument on every later call."""
    seen: set[int] = set()

    def distinct(t):
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_meta:
            return t
        key = t.untyped_storage().data_ptr()
        if key in seen and t.numel():
            return t.clone()
        seen.add(key)
        return t

    return pytree.tree_map(distinct, (args, kwargs))


def _unknown_dataclass(text: str) -> str | None:
    """The dataclass torch.export found in the inputs or outputs and did not know, now
    registered as a pytree node (treespec.register_dataclass); else None."""
    found = re.search(r"Found <class '([\w.<>]+)'> in (?:output|input)", text)
    if not found:
        return None
    module, _, name = found.group(1).rpartition(".")
    cls = getattr(sys.modules.get(module), name, None)
    path = f"{module}:{name}"
    return path if treespec.register_dataclass(cls, path) else None


def _guarded_on_data(e: BaseException) -> bool:
    return "data-dependent" in str(e) or type(e).__name__.startswith("GuardOnDataDependent")


def _with_positions(export):
    """The program exported again with subscripts by 0-d tensors as index ops
    (tensor_index.py: torch 2.11 guards inside its own subscript), or None if that
    fails too: then the first error stands, naming the model's line (the mode's own
    frame would be the line torch names)."""
    try:
        return export()
    except KilnError:
        raise
    except Exception:  # torch raises many types; the first failure says it better
        return None


def _unhashable_output(e: BaseException) -> str | None:
    """The same for torch 2.11, which fails before saying "Found <class>": it asks
    whether each output leaf is an opaque type by hashing the leaf itself, and a
    dataclass with eq (the default) is unhashable, so export raised a TypeError from
    torch's code. The leaf is found in that frame of the traceback."""
    if not isinstance(e, TypeError) or "unhashable" not in str(e):
        return None
    tb = e.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "is_opaque_type" and "torch" in frame.f_code.co_filename:
            cls = type(frame.f_locals.get("cls"))
            path = f"{cls.__module__}:{cls.__qualname__}"
            return path if treespec.register_dataclass(cls, path) else None
        tb = tb.tb_next
    return None


@contextlib.contextmanager
def _quiet_failure():
    """On a failed export torch logs a warning and prints the partial graph to stderr,
    and its fake tensors log the failing op's whole traceback (an op whose shapes do
    not fit); kiln's error (with torch's explanation) says it better, so on failure that
    output is dropped. On success whatever torch printed is passed through."""
    quiet = {"torch.fx.experimental.symbolic_shapes": logging.ERROR,
             "torch._subclasses.fake_tensor": logging.CRITICAL}
    loggers = {logging.getLogger(name): level for name, level in quiet.items()}
    old_levels = {lg: lg.level for lg in loggers}
    real_stderr, captured = sys.stderr, io.StringIO()
    for lg, level in loggers.items():
        lg.setLevel(level)
    try:
        with contextlib.redirect_stderr(captured):
            yield
    finally:
        for lg, level in old_levels.items():
            lg.setLevel(level)
    real_stderr.write(captured.getvalue())


# torch.export's words when a dynamic dim came out a constant 0 or 1 (its examples of 0
# and 1 are taken as fixed sizes): almost always an example of that size
_SMALL_EXAMPLE = re.compile(r"You marked (\w+) as dynamic but your code specialized it to "
                            r"be a constant \(([01])\)")


def _caused_by(text: str) -> str | None:
    """The library line torch names as the guard's cause ('Caused by: (file:line in fn)'),
    where no frame is the user's own (a transformers model's mask helper, say)."""
    found = re.search(r"Caused by: \(([^()]*)\)", text)
    if found is None or _in_torch(found.group(1)):  # torch's own line says nothing
        return None
    return f"{found.group(1)} (library code the model calls)"


def _in_torch(path: str) -> bool:
    """Whether a path as torch's messages give it ('_refs/__init__.py:4264 in unbind',
    relative to torch's package) is torch's own code."""
    first = path.split("/")[0]
    return "/" in path and os.path.isdir(os.path.join(os.path.dirname(torch.__file__), first))


def _export_error(e: Exception) -> KilnError:
    """The kiln error for a torch.export failure: what kind of problem, the user's line."""
    text = str(e).strip()
    name = type(e).__name__
    said = " torch said:\n" + _tail(text)
    if _guarded_on_data(e):
        # torch's message quotes the user's frame when it can; the traceback always has it.
        where = user_frame(text) or user_frame("".join(traceback.format_tb(e.__traceback__)))
        return ExportError(
            "the model branches on, or sizes a tensor by, the value of a tensor "
            "(data-dependent), which torch.export cannot capture",
            where=where or _caused_by(text) or library_frame(
                "".join(traceback.format_tb(e.__traceback__))) or _first_line(text),
            hint="compute with tensors instead of Python decisions on them (torch.where or "
            "masks; torch.cond for real branches) and avoid .item()/.tolist()/int(tensor) in "
            "forward." + said,
        )
    unbacked = _unbacked_mismatch(text)
    if unbacked is not None:
        tb = "".join(traceback.format_tb(e.__traceback__))
        data_size, other = unbacked
        return ExportError(
            f"the model sizes a tensor by the value of a tensor (data-dependent: torch "
            f"calls that size {data_size}) and an op needs it to equal another size "
            f"({other}), which torch.export cannot show",
            where=user_frame(tb) or library_frame(tb) or model_frame(e) or _first_line(text),
            hint="compute sizes and slice bounds from shapes (x.shape[i], Python ints), not "
            "from a tensor's value: a length kept in a tensor (a counter; transformers' "
            "static cache's get_seq_length(), as MPT's ALiBi slice uses it), .item(), or a "
            "slice bounded by a tensor. Where library code does it, export with a fixed "
            "sequence length (a one-token decode step, no dynamic dim on it)." + said,
        )
    # torch 2.11 words it "Unhandled FakeTensor Device Propagation for aten.add.Tensor,
    # found two different devices cpu, meta"
    if name == "FakeTensorDeviceMismatchError" or "found at least two devices" in text \
            or "found two different devices" in text:
        where = user_frame("".join(traceback.format_tb(e.__traceback__)))
        last = text.splitlines()[-1]
        found = (re.search(r"devices?, (\S+) and (\S+?)!?$", last)
                 or re.search(r"two different devices (\S+), (\S+?)$", last))
        devices = f"{found.group(1)} and {found.group(2)}" if found else "two devices"
        return AffinityError(
            f"one op reads tensors pinned to {devices}: the model's own placements "
            "contradict each other",
            where=where or _first_line(text),
            hint="move one operand with .to(...) before the op, or create both on one "
            "device; kiln transfers a value only where the model says so." + said,
        )
    if "structure of `inputs` and `dynamic_shapes`" in text or \
            "expected dynamic_shape to be" in text:
        return ShapeError(
            "dynamic_shapes does not match the model's arguments", where=_first_line(text),
            hint="give one entry per argument (a tuple in argument order or a dict by argument "
            "name), None for an argument with no dynamic dims." + said,
        )
    if name == "ConstraintViolationError" and "not in range" in text:
        return ShapeError(
            "an example argument's size is outside the bounds declared in dynamic_shapes: "
            + _first_line(text),
            hint="make every example size lie inside its Dim(min=, max=)",
        )
    small = _SMALL_EXAMPLE.search(text)
    if small:
        dim, size = small.group(1), small.group(2)
        return ShapeError(
            f"the dynamic dim {dim} was fixed to {size}: torch.export fixes a dim whose "
            "example size is 0 or 1", where=_first_line(text),
            hint=f"give an example argument whose {dim} is at least 2 (the compiled module "
            "still takes every size its Dim allows, 1 included); if the example is 2 or more "
            "already, the model's code fixes the dim (a view or an assert).\n" + _tail(text))
    if "Constraints violated" in text or "specializ" in text or name == "UserError":
        return ShapeError(
            "the dynamic dims declared in dynamic_shapes do not hold for this model",
            where=_violated_dims(text) or _first_line(text),
            hint="torch.export's suggestion follows; adjust Dim(min=, max=) or mark the "
            "dim static:\n" + _tail(text),
        )
    unknown = re.search(r"Found <class '([\w.]+)'> in (output|input)", text)
    if unknown and "cache_utils" in unknown.group(1):
        cache = unknown.group(1).rpartition(".")[2]
        return ExportError(
            f"the model {'returns' if unknown.group(2) == 'output' else 'takes'} a "
            f"transformers {cache}, which a compiled module cannot carry",
            where=user_frame("".join(traceback.format_tb(e.__traceback__))),
            hint="pass use_cache=False (kiln.compile(model, args, kwargs={'use_cache': "
            "False}), or set model.config.use_cache = False) to compile the forward pass "
            "without it; for generation with a KV cache use kiln.models.load(checkpoint) "
            "(Llama, Mistral, Qwen2/3, Qwen3-Next, DeepSeek-V3) or compile transformers' "
            "static-cache export recipe (transformers.integrations.executorch."
            "TorchExportableModuleWithStaticCache; README, 'Models kiln does not know')")
    if unknown:
        return ExportError(
            f"the model's {unknown.group(2)} holds a {unknown.group(1)}, a type torch.export "
            "cannot take apart",
            where=user_frame("".join(traceback.format_tb(e.__traceback__))),
            hint="return tensors, or tuples, lists, dicts, namedtuples or dataclasses of "
            "them; or register the type with torch.utils._pytree.register_pytree_node")
    if "Couldn't swap" in text:  # Module.to / .half() / .cuda() inside forward
        return ExportError(
            "the model's forward converts one of its own modules (Module.to, .half(), "
            ".cuda() inside forward), which torch.export cannot trace",
            where=model_frame(e) or _first_line(text),
            hint="convert the model before compiling (model.to(dtype or device)), or call "
            "it once eagerly so its forward has made the conversion (SwitchTransformers' "
            "router in bf16): a module's .to(...) in forward that then changes nothing is "
            "left alone." + said)
    if name == "RuntimeError" and _SHAPE_MISMATCH.search(text):
        return ExportError(
            f"an op in the model's forward got operands whose shapes do not fit: "
            f"{_first_line(text)}",
            where=model_frame(e) or _first_line(text),
            hint="the sizes are the example's: if model(*args, **kwargs) fails the same way, "
            "a config whose sizes disagree (a head dim and a rotary dim, hidden size and "
            "heads) or example arguments of the wrong shape; kiln compiles a forward that "
            "runs. If it runs eagerly, the model's code takes another path while "
            "torch.export traces it (transformers builds an attention mask it skips in "
            "eager mode: Nystromformer's landmark attention then fails as it does eagerly "
            "with a padding mask): that path is the one that fails.")
    raised = raised_by_model(e)
    if raised is not None:
        return ExportError(
            f"the model's own code raised {name} while torch.export ran its forward on the "
            f"example arguments: {_first_line(text)}",
            where=raised,
            hint="this is the model's code, not a limit of torch.export or kiln: run the "
            "model eagerly on the same arguments (model(*args, **kwargs)); if it fails the "
            "same way, fix the arguments or the model's config. If it runs eagerly, the "
            "model takes another path while traced: transformers fills in some arguments "
            "only when not compiling (SwitchTransformers' and LongT5's attention_mask), so "
            "pass them explicitly.")
    return ExportError(
        f"torch.export could not capture the model ({name})",
        where=user_frame("".join(traceback.format_tb(e.__traceback__))) or model_frame(e)
        or _first_line(text),
        hint="kiln compiles what torch.export can capture: avoid data-dependent Python "
        "control flow and unsupported Python constructs. If model(*args, **kwargs) raises "
        "the same error eagerly, the model or its example arguments fail (an op with no "
        "kernel for this dtype: Autoformer's FFT in bf16), not the capture." + said,
    )


# torch's broadcast check between two sizes; one that names an unbacked symbol (u0, u1:
# a size torch read from a tensor's value) could not be compared, not a misfit
_SIZES_MUST_MATCH = re.compile(r"size of tensor a \(([^()]*)\) must match the size of "
                               r"tensor b \(([^()]*)\)")
_UNBACKED = re.compile(r"\bu\d+\b")


def _unbacked_mismatch(text: str) -> tuple[str, str] | None:
    """(the data-dependent size, the other) where torch could not show two sizes equal
    because one came from a tensor's value (MPT's ALiBi slice under a dynamic length)."""
    found = _SIZES_MUST_MATCH.search(text)
    if not found:
        return None
    a, b = found.groups()
    if _UNBACKED.search(a):
        return a, b
    if _UNBACKED.search(b):
        return b, a
    return None


# torch's messages for ops whose operands' sizes (numbers: the example's, not symbols of
# dynamic dims) do not fit: broadcasting, matmul, view / reshape
_SHAPE_MISMATCH = re.compile(
    r"size of tensor a \(\d+\) must match the size of tensor b \(\d+\)"
    r"|mat1 and mat2 shapes cannot be multiplied \(\d+x\d+ and \d+x\d+\)"
    r"|shape '\[[\d, -]+\]' is invalid for input of size \d+"
    # the same under export's fake tensors
    r"|Attempting to broadcast a dimension of length \d+"
    r"|a and b must have same reduction dim, but got \[[\d, ]+\] X \[[\d, ]+\]"
    r"|Sizes of tensors must match except in dimension \d+")  # cat


def _check_dim_axes(model, args: tuple, kwargs: dict, dynamic_shapes) -> None:
    """A Dim on an axis the tensor lacks (torch only says 'list index out of range')."""
    if isinstance(dynamic_shapes, dict):
        try:
            bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
        except (TypeError, ValueError):
            return  # torch reports a mismatched signature itself
        pairs = [(k, v, dynamic_shapes.get(k)) for k, v in bound.items()]
    elif isinstance(dynamic_shapes, (list, tuple)):
        values = [*args, *kwargs.values()]
        pairs = [(f"argument {i}", v, s) for i, (v, s) in enumerate(zip(values, dynamic_shapes))]
    else:
        return
    for who, value, spec in pairs:
        if isinstance(value, (bool, int, float, str, type(None))) and \
                isinstance(spec, (dict, list, tuple)):
            raise ShapeError(
                f"dynamic_shapes gives {who} ({type(value).__name__} {value!r}) dims "
                f"{spec!r}, but only a tensor has dims",
                hint="give None for it; a tuple lists the positional arguments, then the "
                "keyword arguments in the order given (a dict by argument name is clearer)")
        if isinstance(value, float) and spec is not None:
            raise _dynamic_scalar(who, "float")  # a Dim, Dim.DYNAMIC or AUTO
        if not isinstance(value, torch.Tensor) or not isinstance(spec, dict):
            continue
        for axis in spec:
            if isinstance(axis, int) and not -value.dim() <= axis < value.dim():
                raise ShapeError(
                    f"dynamic_shapes marks dim {axis} of {who}, which has {value.dim()} dims "
                    f"{list(value.shape)}",
                    hint=f"dims are numbered 0..{value.dim() - 1}",
                )


# torch's line per violated Dim: "Not all values of seq = L['input_ids'].size()[1] in ..."
_VIOLATED = re.compile(r"Not all values of (\w+) = L\['(\w+)'\]((?:\[\w+\])*)"
                       r"\.size\(\)\[(\d+)\]")


def _violated_dims(text: str) -> str | None:
    """The dims torch's constraint check refused, as 'dim 1 of input_ids (Dim "seq")'."""
    found = dict.fromkeys(f'dim {m.group(4)} of {m.group(2)}{m.group(3)} (Dim "{m.group(1)}")'
                          for m in _VIOLATED.finditer(text))
    return "; ".join(found) or None


def _first_line(text: str, limit: int = 300) -> str:
    """torch's first line, cut at a word boundary when longer than `limit`."""
    line = text.splitlines()[0] if text else ""
    if len(line) <= limit:
        return line
    return line[:limit].rpartition(" ")[0] + " ..."


def _tail(text: str, n: int = 25) -> str:
    return "\n".join(text.splitlines()[:n])


def decompose(ep: torch.export.ExportedProgram, recapture=None
              ) -> torch.export.ExportedProgram:
    """Lower to core ATen, and further where kiln knows better (decompositions.py):
    its own decompositions of what some torch versions leave whole (nn.RMSNorm on a GPU
    with torch 2.11), and torch's for ops kiln would otherwise run unfused (eval
    BatchNorm, bilinear upsampling), so they fuse with their neighbours."""
    table = kiln_table()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        try:
            local = decompose_locally(ep, table)
        except ShapesSpecialised as e:
            if recapture is None:
                raise
            log.info("capturing again: %s", e)
            ep, local = recapture(), None
        # a size the splice pinned to an int reads as data-dependent downstream
        # (_check_no_unbacked): such a program is not the re-trace's, so re-trace
        if local is not None and _pinned_sizes(local) == 0:
            return local
        log.info("decomposing by torch's re-trace (the program is not plain enough to "
                 "decompose node by node)")
        return ep.run_decompositions(table)


def kiln_table() -> dict:
    """torch's core ATen table with kiln's own entries, less the ops kept whole."""
    table = _plain(torch.export.default_decompositions()) | OVERRIDES
    # up front, not only when the exported graph shows them: some ops appear only
    # while decomposing (batch_norm -> _native_batch_norm_legit_no_training)
    for op in set(FALLBACKS) | DECOMPOSE:
        if table.get(op) is None:
            known = decomposition_table.get(op) or FALLBACKS.get(op)
            if known is not None:
                table[op] = known
    for op in KEEP_WHOLE:
        if op in table:
            del table[op]
    return table


def _plain(table) -> dict:
    """export's table as a plain dict: its CustomDecompTable keeps entries set through
    dict methods it does not override (setdefault) out of what it hands to export."""
    materialize = getattr(table, "materialize", None)
    return dict(materialize() if materialize else table)


def _drop_asserts(gm: fx.GraphModule, value_checks_only: bool = False) -> None:
    """Runtime asserts go, and what only they read: a model's check on a tensor's value
    (Llava's `n_image_tokens * D == features.numel()`: an all-true reduction, an item(),
    comparisons of the unbacked int) would otherwise be ops kiln has no kernel for.
    `value_checks_only`: only asserts on an item() (before decomposing: an assert that
    pins a data-dependent size, `x[x > 0].reshape(2, 3)`, must stay, or the re-trace
    takes the example's size for every call)."""
    fed: list[fx.Node] = []
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and op_name(node.target) in ASSERT_OPS and not node.users:
            if value_checks_only and not _reads_an_item(node):
                continue
            fed += node.all_input_nodes
            gm.graph.erase_node(node)
    while fed:  # the asserts' inputs that nothing else reads, and theirs (pure ops only)
        node = fed.pop()
        if node.op == "call_function" and not node.users and not node._erased \
                and not node.is_impure():
            fed += node.all_input_nodes
            gm.graph.erase_node(node)


def _reads_an_item(node: fx.Node) -> bool:
    """Whether `node` depends on a scalar read from a tensor's value (aten.item)."""
    seen, todo = set(), list(node.all_input_nodes)
    while todo:
        n = todo.pop()
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        if n.target is torch.ops.aten.item.default:
            return True
        todo += n.all_input_nodes
    return False


def _without_asserts(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    _drop_asserts(ep.graph_module, value_checks_only=True)
    ep.graph_module.recompile()
    return ep


def _strided_copies_as_clones(gm: fx.GraphModule) -> None:
    """prims.copy_strided (left by some decompositions: lerp's) copies its input into
    a given memory layout; kiln's values have no strides, so it is a plain clone."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.prims.copy_strided.default:
            node.target, node.args = torch.ops.aten.clone.default, node.args[:1]
    gm.recompile()


FALLBACK_MODES = ("allow", "error")


def check_supported(gm: fx.GraphModule, fallback: str = "allow") -> dict[str, list[str]]:
    """Every op kiln does not know: {op: [where...]} of those that fall back to PyTorch's
    own op, or one UnsupportedOpError listing them all (`fallback="error"`, or ops that
    cannot run blindly: in-place, random, ...)."""
    fallen: dict[str, list[str]] = {}
    refused: list[str] = []
    size_floats = False
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = op_name(node.target)
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt | int) or name.startswith("aten.sym_"):
            continue  # size arithmetic: becomes a symbolic expression
        if isinstance(val, torch.SymFloat):
            size_floats = True
            refused.append(f"{name} (a float computed from a dynamic size) at "
                           f"{location(node)}")
            continue
        if is_known(name) or _is_symint_op(node):
            continue
        problem = fallback_problem(name)
        at = location(node)
        if problem is None and fallback != "error":
            fallen.setdefault(name, []).append(at)
        else:
            refused.append(f"{name} at {at}" + (f" ({problem})" if problem else ""))
    refused = list(dict.fromkeys(refused))
    if refused:
        many = len(refused) > 1
        raise UnsupportedOpError(
            f"kiln cannot compile {len(refused)} operation{'s' if many else ''}: "
            + "; ".join(refused),
            where=refused[0].partition(" at ")[2],
            hint=("kiln's dynamic sizes are integers: a float made from one (an "
                  "interpolation's scale following the input's size, as ViT's "
                  "interpolate_pos_encoding) cannot be compiled; make those dims static "
                  "(a module per size) or compute the float outside the model"
                  if size_floats else
                  "drop fallback=\"error\" to run the ops kiln has no kernel for as PyTorch's "
                  "own ops" if fallback == "error" else
                  "rewrite these lines with supported ops (elementwise math, reductions, "
                  "matmul, scaled_dot_product_attention, views, cat, index/embedding), "
                  "or run that part of the model outside kiln"))
    return fallen


def fallback_warning(fallen: dict[str, list[str]]) -> KilnWarning:
    """One warning naming each fallback op once, with where the model uses it."""
    return KilnWarning(
        "kiln generates no kernel for " + "; ".join(
            f"{op} (at {', '.join(dict.fromkeys(at))})" for op, at in fallen.items())
        + ": each runs as PyTorch's own op.",
        hint='Pass fallback="error" to refuse instead.',
        cli_hint="use --fallback error to refuse instead")


def location(node: fx.Node) -> str:
    """The user's source line of `node`, else transformers' line (library code), else
    the module it ran in (model.layers.3.mlp), else its graph name: models built from
    nn.Sequential have no source frame."""
    at = where(node) or library_frame(node.meta.get("stack_trace"))
    if at:
        return at
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path = list(stack.values())[-1][0]
        path = re.sub(r"^L\['self'\]\.?", "", path).replace("._modules['", ".") \
            .replace("']", "")
        return f"module model.{path}" if path else "the model's forward"
    return node.name


def _is_symint_op(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.SymInt)


def _check_no_unbacked(ep: torch.export.ExportedProgram) -> None:
    for node in ep.graph.nodes:
        if _pinned_data_size(node):
            _data_dependent(node.args[0])
        val = node.meta.get("val")
        shapes = val.shape if isinstance(val, torch.Tensor) else ()
        for d in shapes:
            expr = getattr(getattr(d, "node", None), "expr", None)
            if expr is not None and any(s.name.startswith("u") for s in expr.free_symbols):
                _data_dependent(node)


def _pinned_sizes(ep: torch.export.ExportedProgram) -> int:
    return sum(_pinned_data_size(n) for n in ep.graph.nodes)


def _pinned_data_size(node: fx.Node) -> bool:
    """A size read that export resolved to a plain int: the size was data-dependent (an
    unbacked symbol) until a later use pinned it (`x[x > 0].reshape(2, 3)` asserts 6
    elements at run time). A static dim has no size read; a dynamic one reads a SymInt."""
    if node.op != "call_function" or node.target is not torch.ops.aten.sym_size.int \
            or not isinstance(node.args[0], fx.Node):
        return False
    val = node.meta.get("val")
    expr = getattr(getattr(val, "node", None), "expr", val)  # a SymInt's, or the int
    return isinstance(expr, int) or getattr(expr, "is_Integer", False)


def _data_dependent(node: fx.Node):
    # an item of a tuple (torch.split by sizes read from data) is named by the op that
    # made it, and placed by the module it ran in where no user line made it (library
    # code: JetMoe's experts split by `expert_size.tolist()`)
    made_by = node.args[0] if node.target is operator.getitem and node.args else node
    shown = made_by if isinstance(made_by, fx.Node) else node
    raise UnsupportedOpError(
        f"{op_name(shown.target)} produces a tensor whose size depends on its data",
        where=where(node) or where(shown) or location(node),
        hint="kiln plans memory from sizes known at call time; use a fixed-size "
        "formulation (e.g. a mask with torch.where instead of nonzero/masked_select, "
        "a gather of a fixed top-k instead of a split by counts read with .tolist())",
    )


def _specialised(name: str, val):
    """The value export specialised a non-tensor argument on. A dynamic int is a size
    symbol (a "user_size" input, bound from the argument at call time); a float or
    bool made dynamic has no size to be."""
    if not isinstance(val, torch.SymInt | torch.SymFloat | torch.SymBool):
        return val
    expr = val.node.expr
    if expr.is_number:
        return {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[type(val)](expr)
    raise _dynamic_scalar(f"argument {name!r}", type(val).__name__[3:].lower())


def _size_symbol(val) -> str | None:
    """The size symbol a dynamic int argument is (torch's SymInt placeholder), if one."""
    expr = getattr(getattr(val, "node", None), "expr", None)
    return expr.name if isinstance(val, torch.SymInt) and isinstance(expr, sympy.Symbol) \
        else None


def _dynamic_scalar(who: str, kind: str) -> ShapeError:
    return ShapeError(
        f"dynamic_shapes makes {who} (a Python {kind}) dynamic; kiln takes dynamic sizes "
        "from tensor dims and Python ints only", where=who,
        hint="give None for it (the module then takes the example's value; calling with "
        "another is an error), or pass it as an int (a size) or a tensor")


def to_kiln_graph(ep: torch.export.ExportedProgram) -> KilnGraph:
    sig = ep.graph_signature
    kinds = {
        "USER_INPUT": "user", "PARAMETER": "param", "BUFFER": "buffer",
        "CONSTANT_TENSOR": "constant", "CUSTOM_OBJ": "constant", "TOKEN": "token",
    }
    inputs = []
    vals = {n.name: n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder"}
    for spec in sig.input_specs:
        kind = kinds[spec.kind.name]
        if kind == "token":
            raise UnsupportedOpError("the model uses side-effecting ops (effect tokens)")
        val = vals.get(spec.arg.name)
        if kind == "user" and _size_symbol(val) is not None:
            inputs.append(GraphInput(spec.arg.name, "user_size", None, _size_symbol(val)))
            continue
        if kind == "user" and not isinstance(val, torch.Tensor):
            inputs.append(GraphInput(spec.arg.name, "user_const", None,
                                     _specialised(spec.arg.name, val)))
            continue
        inputs.append(GraphInput(spec.arg.name, kind, spec.target))
    outputs = []
    mutable = set()
    specs, none_outputs = drop_none_outputs(ep.graph_module, list(sig.output_specs))
    for spec in specs:
        kind = spec.kind.name
        if kind == "USER_OUTPUT":
            outputs.append(GraphOutput(spec.arg.name, "user"))
        elif kind == "BUFFER_MUTATION":
            outputs.append(GraphOutput(spec.arg.name, "buffer_mutation", spec.target))
            mutable.add(spec.target)
        elif kind == "PARAMETER_MUTATION":
            raise _parameter_written(ep, specs)
        else:
            raise UnsupportedOpError(
                f"kiln does not support {kind.lower().replace('_', ' ')} outputs",
                hint="kiln compiles inference: only buffers may be updated in place",
            )
    state = dict(ep.state_dict)
    state.update(ep.constants)
    symbols = {}
    for sym, vr in ep.range_constraints.items():
        if str(sym).startswith("u"):
            continue  # unbacked: no shape uses one (_check_no_unbacked), so not a size
        hi = vr.upper
        symbols[str(sym)] = Bounds(int(vr.lower), int(hi) if hi.is_Integer else None)
    gm = ep.graph_module
    return KilnGraph(
        module=gm,
        inputs=inputs,
        outputs=outputs,
        symbols=symbols,
        in_spec=ep.call_spec.in_spec,
        out_spec=ep.call_spec.out_spec,
        state=state,
        mutable=mutable,
        none_outputs=none_outputs,
    )


def _parameter_written(ep: torch.export.ExportedProgram, specs) -> UnsupportedOpError:
    """Which parameters the forward writes, and where: RWKV rescales its weights in place
    on its first call in eval mode, and a module compiled from that call would write
    them again on every call."""
    nodes = {n.name: n for n in ep.graph.nodes}
    written = [(s.target, nodes.get(s.arg.name)) for s in specs
               if s.kind.name == "PARAMETER_MUTATION"]
    names = ", ".join(t for t, _ in written[:4]) + (", ..." if len(written) > 4 else "")
    node = next((n for _, n in written if n is not None), None)
    return UnsupportedOpError(
        f"the model's forward writes {len(written)} parameter(s) in place ({names}); "
        "kiln compiles inference, where only buffers may be updated",
        where=location(node) if node is not None else None,
        hint="if the model changes its weights once (RWKV rescales them on its first call "
        "in eval mode), call it once eagerly before kiln.compile; otherwise make the "
        "updated tensors buffers (register_buffer)",
    )


def _int_sizes(kg: KilnGraph, guards: list, model, args: tuple, kwargs: dict,
               dynamic_shapes) -> None:
    """The int arguments' symbols: the user's Dim names and bounds, and torch's guards
    over them that the bounds do not imply, checked on every call (int_args.py)."""
    _, dims = int_dims(model, args, kwargs, dynamic_shapes)
    user = [s for s in kg.inputs if s.kind in ("user", "user_const", "user_size")]
    sized = {}
    for i, spec in enumerate(user):
        if spec.kind == "user_const" and i in dims and dims[i] is not torch.export.Dim.AUTO:
            raise ShapeError(
                f"dynamic_shapes makes argument {spec.name!r} (a Python int) dynamic, but "
                f"torch.export fixed it to the example's {spec.value!r}",
                where=f"argument {spec.name!r}",
                hint="give an example value of at least 2 (torch.export fixes an int whose "
                "example is 0 or 1; the compiled module still takes every value its Dim "
                "allows, 0 and 1 included); if it is 2 or more already, the model's code "
                "fixes it (a branch or an assert on it)")
        if spec.kind != "user_size":
            continue
        sym, dim = spec.value, dims.get(i)
        sized[sym] = spec.name
        bounds = declared_bounds(dim, kg.symbols.get(sym))
        if bounds is not None:
            kg.symbols[sym] = bounds
        name = getattr(dim, "__name__", None)
        if isinstance(name, str) and name not in ("DYNAMIC", "AUTO", "STATIC"):
            kg.dim_names.setdefault(sym, name)
    kg.size_checks = size_checks(guards, set(sized), kg.symbols)


def import_model(model, args, kwargs=None, dynamic_shapes=None,
                 fallback: str = "allow", allow_train: bool = False) -> KilnGraph:
    """The whole import stage, as one pass of the pipeline."""
    ep = capture(model, args, kwargs, dynamic_shapes, allow_train)
    return import_exported(ep, model, args, kwargs, dynamic_shapes, fallback)


def capture(model, args, kwargs=None, dynamic_shapes=None,
            allow_train: bool = False) -> torch.export.ExportedProgram:
    """The model as torch.export captures it (before any decomposition)."""
    if not isinstance(model, torch.nn.Module):
        raise ExportError(
            f"kiln.compile takes a torch.nn.Module, got {type(model).__name__}",
            hint="wrap a plain function in an nn.Module whose forward calls it",
        )
    check_inference_mode(model, allow_train)
    with phase("capture"):
        return export_model(model, args, kwargs, dynamic_shapes)


def import_exported(ep: torch.export.ExportedProgram, model, args, kwargs=None,
                    dynamic_shapes=None, fallback: str = "allow") -> KilnGraph:
    """The KilnGraph of a captured program: decomposed, checked and converted."""
    guards = captured_guards(ep)
    with phase("decompose"):
        # value checks go first: torch 2.11's re-trace fails on the unbacked int of a
        # check on a tensor's value (a GPU run of PlaceImages, 2026-11-30)
        ep = decompose(_without_asserts(ep), recapture=lambda: _without_asserts(
            export_model(model, args, kwargs, dynamic_shapes)))
    _check_no_unbacked(ep)
    _drop_asserts(ep.graph_module)
    select_by_tensor_as_index(ep.graph_module)
    _strided_copies_as_clones(ep.graph_module)
    in_order_as_strided_as_views(ep.graph_module)
    fix_reduction_shapes(ep.graph_module)
    fallen = check_supported(ep.graph_module, fallback)
    kg = to_kiln_graph(ep)
    kg.fallback_ops = fallen
    kg.dim_names = dim_names(ep, model, tuple(args), kwargs or {}, dynamic_shapes)
    _int_sizes(kg, guards, model, tuple(args), kwargs or {}, dynamic_shapes)
    kg.recompile()
    log.info("imported %d nodes, symbols %s", len(kg.graph.nodes), kg.symbols)
    return kg
