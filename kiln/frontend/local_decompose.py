"""Decomposition node by node, each distinct (op, argument shapes) traced once.

Why: `ExportedProgram.run_decompositions` re-traces the whole program through
functionalization and fake tensors with symbolic shapes, twice (metadata, then the
graph): ~1 s a layer of a Llama-3-8B over its prefill and decode modules on a CPU,
half of a cold compile, although most nodes are core ATen already and a model's
layers repeat the same few ops at the same sizes. Here only the nodes whose op the
table decomposes are traced (make_fx over their own fake arguments, with the same
table and in the re-trace's dispatch state, Python dispatcher included, so
decompositions nest and end where torch's do); the trace of one (op, argument
shapes and constants, which arguments are one value) is spliced in wherever that
signature recurs; the only in-place ops export leaves (writes into a buffer, as a KV
cache's `index_put_`) become their functional form with the buffer's new value an
output, as torch's functionalization makes them; and the nodes are named and their
arguments put as torch's tracer records them (kiln's passes and tests read both).

Anything outside that (higher-order ops, in-place ops on views or user inputs, a
view of a buffer read after the buffer is written, a decomposition that makes
tensor constants) returns None, and the caller runs torch's re-trace.
"""

from __future__ import annotations

import contextlib
import logging
import operator

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._dispatch.python import enable_python_dispatcher
from torch._export.utils import _compiling_state_context, _special_op_to_preserve_cia
from torch._export.verifier import Verifier
from torch._guards import detect_fake_mode
from torch.export._trace import _ignore_backend_decomps
from torch.export.exported_program import (
    ExportedProgram,
    _override_composite_implicit_decomp,
    _split_decomp_table_to_cia_and_python_decomp,
)
from torch.export.graph_signature import (
    ExportGraphSignature,
    OutputKind,
    OutputSpec,
    TensorArgument,
)
from torch.fx.experimental.proxy_tensor import make_fx

from kiln.frontend.traced_form import as_traced, keep_name
from kiln.settings import local_decompose

log = logging.getLogger("kiln.frontend")

_META_KEPT = ("stack_trace", "nn_module_stack", "torch_fn", "custom", "source_fn_stack")


_TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


class ShapesSpecialised(Exception):
    """The pass narrowed a dynamic input size in the program's shape environment (a
    trace guarded on it): the captured program itself is no longer dynamic there, so
    neither this pass's result nor torch's re-trace of it may be used; capture again."""


def decompose_locally(ep: ExportedProgram, table: dict) -> ExportedProgram | None:
    """`ep` lowered with `table` as run_decompositions would, or None when this pass
    cannot be sure of giving the same program (the caller then re-traces).

    The default (KILN_DECOMPOSE=local; =retrace turns it off) on torch >= 2.11, where
    it gives the re-trace's program: the same ops, arguments, sizes and signature
    (tests/frontend/test_decompose_parity.py), names by the same scheme; but a view of
    a written buffer is taken once where the re-trace's functionalization takes it
    again for each use (DeepSeek-V3's latent cache: the same values, which kiln's CSE
    merges in the re-trace's program). Under torch 2.11 the traces first ran outside the
    Python dispatcher, where C++ linear read sizes as numbers and narrowed the captured
    program's shape environment (an LLM's decode batch fixed at the example's 2); they
    run under it now, the parity tests pass on torch 2.11 (GPU image, 2026-11-28) and an
    8B LLM compiled node by node there. Older torch is untried: it gets the re-trace.
    A pass that narrows an input size raises ShapesSpecialised: the caller captures
    again, since the program itself is no longer dynamic there."""
    if not local_decompose() or _TORCH < (2, 11):
        return None
    shape_env, before = _input_symbols(ep)
    try:
        local = _decompose(ep, table)
    except Exception as e:  # noqa: BLE001 - torch's re-trace is always there to fall back on
        log.info("node-by-node decomposition failed (%s: %s)", type(e).__name__, e)
        local = None
    if shape_env is not None and _symbol_state(shape_env, before) != before:
        raise ShapesSpecialised("a decomposition traced node by node guarded on a "
                                "dynamic input size")
    return local


def _input_symbols(ep: ExportedProgram) -> tuple[object, dict]:
    """The shape environment and, per symbol of an input's size, what it knows of it
    (its replacement and range) before the pass."""
    symbols, shape_env = set(), None
    for node in ep.graph.nodes:
        val = node.meta.get("val") if node.op == "placeholder" else None
        for d in getattr(val, "shape", ()):
            if isinstance(d, torch.SymInt):
                shape_env = d.node.shape_env
                symbols |= d.node.expr.free_symbols
    state = dict.fromkeys(symbols)
    return shape_env, _symbol_state(shape_env, state) if shape_env is not None else state


def _symbol_state(shape_env, symbols: dict) -> dict:
    return {s: (str(shape_env.replacements.get(s)), str(shape_env.var_to_range.get(s)))
            for s in symbols}


def _decompose(ep: ExportedProgram, table: dict) -> ExportedProgram | None:
    if ep.verifiers and ep.verifiers[0].dialect != "TRAINING":
        return None
    gm = ep.graph_module
    if not _plain_graph(gm, ep):
        return None
    gm = _copy(gm)
    mutated = _functionalize_buffer_writes(gm, ep.graph_signature)
    if mutated is None:
        return None
    output = next(n for n in gm.graph.nodes if n.op == "output")
    user_outs = list(output.args[0])
    output.args = ((*mutated.values(), *user_outs),)  # as torch orders them
    fake_mode = detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes
                                  if n.op == "placeholder"])
    if fake_mode is None:
        return None
    # torch's split: CompositeImplicitAutograd ops go through the dispatcher, patched
    # to decompose as the table says (or to stay whole, those deleted from it)
    cia, python_table = _split_decomp_table_to_cia_and_python_decomp(dict(table))
    traces: dict = {}
    with _as_torchs_retrace(cia):
        for node in list(gm.graph.nodes):
            if node.op != "call_function":
                continue
            if node.target is torch.ops.aten.sym_numel.default:
                done = _numel_as_product(gm.graph, node)
            elif _decomposes(node.target, cia, python_table):
                done = _replace(gm.graph, node, python_table, traces, fake_mode)
            else:
                continue
            if not done:
                return None
    _share_sizes(gm.graph)
    _resymbolise_input_sizes(gm.graph)
    gm.graph.eliminate_dead_code(_impure)
    return _program(ep, as_traced(gm), mutated)


@contextlib.contextmanager
def _as_torchs_retrace(cia: dict):
    """The dispatch state torch's re-trace decomposes under (_export_to_aten_ir):
    without the Python dispatcher, ops' Python kernels on the Autograd and
    CompositeImplicitAutograd keys are skipped (native_batch_norm's sends eval
    BatchNorm to _native_batch_norm_legit_no_training, which kiln's table turns into
    a per-channel affine map); no_grad and the backend flags pick the same branches
    of the C++ composites."""
    with _override_composite_implicit_decomp(cia), _ignore_backend_decomps(), \
            _compiling_state_context(), torch.no_grad(), enable_python_dispatcher():
        yield


def _decomposes(op, cia: dict, python_table: dict) -> bool:
    """Whether torch's re-trace would replace `op`: an entry of the table, or an op
    with a CompositeImplicitAutograd kernel not marked to stay whole."""
    if not isinstance(op, torch._ops.OpOverload):
        return False
    if op in python_table:
        return True
    if op in cia:
        return cia[op] is not _special_op_to_preserve_cia
    return torch._C._dispatch_has_kernel_for_dispatch_key(
        op.name(), torch._C.DispatchKey.CompositeImplicitAutograd)


def _numel_as_product(graph: fx.Graph, node: fx.Node) -> bool:
    """`x.numel()` as the re-trace writes it: the product of x's sizes in order, as C++
    multiplies them (numbers folded, factors of 1 dropped), symbolic ones read by
    sym_size; torch's functionalization answers numel from the sizes, never as an
    aten.sym_numel node. False for a numel that is a number (a capture never has one)."""
    x = node.args[0]
    shape = getattr(x.meta.get("val"), "shape", None) if isinstance(x, fx.Node) else None
    if shape is None:
        return False
    product: int | fx.Node = 1
    with graph.inserting_before(node):
        for i, size in enumerate(shape):
            factor: int | fx.Node = size
            if isinstance(size, torch.SymInt):
                factor = graph.call_function(torch.ops.aten.sym_size.int, (x, i))
                factor.meta["val"] = size
            if isinstance(factor, int) and isinstance(product, int):
                product *= factor
            elif isinstance(factor, int) and factor == 1:
                continue
            elif isinstance(product, int) and product == 1:
                product = factor
            else:
                value = _value(product) * _value(factor)
                product = graph.call_function(operator.mul, (product, factor))
                product.meta["val"] = value
    if isinstance(product, int):
        return False
    node.replace_all_uses_with(product)
    graph.erase_node(node)
    return True


def _value(v):
    return v.meta["val"] if isinstance(v, fx.Node) else v


def _share_sizes(graph: fx.Graph) -> None:
    """One node per size expression: each spliced decomposition reads the sizes it
    needs itself (sym_size, products of them); torch's single trace reads each once.
    Two size nodes with one expression are one value (the same symbols)."""
    first: dict[tuple, fx.Node] = {}
    for node in list(graph.nodes):
        val = node.meta.get("val")
        if node.op != "call_function" or not isinstance(val, torch.SymInt) or not (
                node.target is torch.ops.aten.sym_size.int
                or getattr(node.target, "__module__", None) == "_operator"):
            continue
        key = (type(val).__name__, str(val.node.expr))
        if key in first:
            node.replace_all_uses_with(first[key])
        else:
            first[key] = node


def _resymbolise_input_sizes(graph: fx.Graph) -> None:
    """A size read of an input whose recorded value is a number while the input's own
    (fake) shape holds a symbol there takes the symbol, as torch's re-trace finds it
    (torch 2.11's capture recorded 2, the example's size, for a dynamic batch dim;
    kiln's import reads a size read that is a number as data-dependent). Any other
    such read is left, and export.decompose hands the program to the re-trace."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.sym_size.int:
            continue
        src, val = node.args[0], node.meta.get("val")
        expr = getattr(getattr(val, "node", None), "expr", val)
        if not (isinstance(src, fx.Node) and src.op == "placeholder"
                and (isinstance(expr, int) or getattr(expr, "is_Integer", False))):
            continue
        shape = getattr(src.meta.get("val"), "shape", None)
        dim = node.args[1]
        if shape is None or not isinstance(dim, int):
            continue  # left for the check in export.decompose: the re-trace then runs
        real = shape[dim]
        if isinstance(real, torch.SymInt) and not isinstance(
                getattr(real.node, "maybe_as_int", lambda: None)(), int):
            node.meta["val"] = real


def _plain_graph(gm: fx.GraphModule, ep: ExportedProgram) -> bool:
    """Only ATen ops, getitem and size arithmetic; no submodules or attributes."""
    if ep.graph_signature.input_tokens or ep.graph_signature.output_tokens:
        return False
    for node in gm.graph.nodes:
        if node.op == "get_attr" or node.op == "call_module" or node.op == "call_method":
            return False
        if _unbacked(node.meta.get("val")):
            return False  # data-dependent sizes: torch's re-trace renames and checks them
        if node.op != "call_function":
            continue
        t = node.target
        if isinstance(t, torch._ops.OpOverload):
            continue
        if t is operator.getitem or getattr(t, "__module__", None) in ("_operator", "math") \
                or t in (torch.sym_float, torch.sym_int, torch.sym_max, torch.sym_min,
                         torch.sym_not, torch.sym_sqrt):
            continue
        return False  # a higher-order op, an OpOverloadPacket, a Python function
    return True


def _unbacked(val) -> bool:
    if isinstance(val, list | tuple):
        return any(_unbacked(v) for v in val)
    if isinstance(val, torch.Tensor):
        return any(_unbacked(d) for d in val.shape)
    expr = getattr(getattr(val, "node", None), "expr", None)
    return expr is not None and any(str(s).startswith("u") for s in expr.free_symbols)


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A new graph module over a copy of the graph (the captured program stays as it
    was: its fingerprint is the compile cache's key)."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    for old, new in zip(gm.graph.nodes, graph.nodes, strict=True):
        new.meta = dict(old.meta)
        if new.op == "placeholder":
            keep_name(new, old.name)
    return fx.GraphModule(gm, graph)


def _is_inplace(node: fx.Node) -> bool:
    t = node.target
    return isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable


def _functional_of(op: torch._ops.OpOverload):
    """`index_put_.default` -> `index_put.default`, if the schemas agree but the alias."""
    name = op._schema.name.split("::")[-1]
    if not name.endswith("_") or op._schema.arguments[0].alias_info is None \
            or not op._schema.arguments[0].alias_info.is_write:
        return None
    if any(a.alias_info is not None and a.alias_info.is_write
           for a in op._schema.arguments[1:]):
        return None
    packet = getattr(torch.ops.aten, name[:-1], None)
    functional = getattr(packet, op._overloadname, None) if packet is not None else None
    if functional is None or functional._schema.is_mutable:
        return None
    return functional


def _aliases(node: fx.Node) -> bool:
    """Whether the op's output may share memory with an input (a view)."""
    t = node.target
    if not isinstance(t, torch._ops.OpOverload):
        return t is operator.getitem
    return any(r.alias_info is not None for r in t._schema.returns)


def _functionalize_buffer_writes(gm: fx.GraphModule, sig: ExportGraphSignature
                                 ) -> dict[str, fx.Node] | None:
    """Every in-place op writing a buffer placeholder rewritten to its functional op;
    later reads of the buffer read the new value. {buffer name: its final value}, or
    None for any other in-place op, or a view of a buffer taken before a write and
    read (itself or through views of it) at or after the write. A view read only
    before the write stays as it is: it shows the old value, as the functional program
    computes (Qwen3-Next's linear-attention state, read, then written per row).

    An in-place op's result is the buffer itself, and so is a `to` that changes
    nothing: in-place ops on those write the buffer too, and their later reads read
    its value then (transformers' StaticCache: `counter.copy_(pos[0])` then
    `counter.to(device).add_(T)`, which had sent every recipe model to torch's
    re-trace, and Phi-3.5's longrope there to an assertion inside torch)."""
    buffers = {p: b for p, b in sig.inputs_to_buffers.items()}
    current: dict[fx.Node, fx.Node] = {}  # buffer placeholder -> its value now
    alias_of: dict[fx.Node, fx.Node] = {}  # a node that is a buffer -> its placeholder
    written: dict[str, fx.Node] = {}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}

    def now(a):
        if not isinstance(a, fx.Node):
            return a
        return current.get(alias_of.get(a, a), a)

    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if _is_inplace(node):
            target = node.args[0] if node.args else None
            functional = _functional_of(node.target)
            buf = alias_of.get(target) if isinstance(target, fx.Node) else None
            if buf is None and isinstance(target, fx.Node) and target.op == "placeholder" \
                    and target.name in buffers:
                buf = target
            if functional is None or buf is None:
                return None
            if any(user is not node and user not in alias_of and _aliases(user)
                   and order[user] < order[node] and _read_from(user, node, order)
                   for user in buf.users):
                return None  # a view taken before the write, read at or after it
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(functional, (current.get(buf, buf),
                                                          *pytree.tree_map(now, node.args[1:])),
                                             pytree.tree_map(now, dict(node.kwargs)))
            new.meta = dict(node.meta)
            order[new] = order[node]
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            current[buf] = new
            alias_of[new] = buf
            written[buffers[buf.name]] = new
            continue
        if current or alias_of:
            node.args = pytree.tree_map(now, node.args)
            node.kwargs = pytree.tree_map(now, node.kwargs)
        src = node.args[0] if node.args else None
        if isinstance(src, fx.Node) and _same_tensor(node, src):
            buf = alias_of.get(src) or (src if src.op == "placeholder"
                                        and src.name in buffers else None)
            if buf is not None:
                alias_of[node] = buf
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for a in pytree.tree_leaves(output.args):
        if isinstance(a, fx.Node) and (a in alias_of or (a.op == "placeholder"
                                                         and a in current)):
            return None  # a written buffer returned as such
    inputs = [s.target for s in sig.input_specs]
    return dict(sorted(written.items(), key=lambda kv: inputs.index(kv[0])))


_NO_OP_TO = {torch.ops.aten.to.dtype_layout, torch.ops.aten.to.dtype, torch.ops.aten.to.device,
             torch.ops.aten.alias.default}


def _same_tensor(node: fx.Node, src: fx.Node) -> bool:
    """Is `node` a `to` (or alias) that returns `src` itself: the same dtype, device and
    layout, no copy asked for?"""
    if node.target not in _NO_OP_TO or node.kwargs.get("copy", False):
        return False
    a, b = node.meta.get("val"), src.meta.get("val")
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
            and a.device == b.device and a.layout == b.layout and a.shape == b.shape)


def _read_from(view: fx.Node, write: fx.Node, order: dict[fx.Node, int]) -> bool:
    """Whether `view` (of the buffer `write` writes) or a view of it is read at or after
    the write. If every read comes before, the view only ever shows the buffer's old
    value, as in the functional program; a later read would see the write."""
    stack = [view]
    while stack:
        for user in stack.pop().users:
            if order[user] >= order[write]:
                return True
            if _aliases(user):  # a view of the view (a slice's getitem, a reshape)
                stack.append(user)
    return False


def _signature(value) -> tuple:
    if isinstance(value, torch.Tensor):
        return ("T", tuple(str(d) for d in value.shape), tuple(str(s) for s in value.stride()),
                str(value.dtype), str(value.device), value.layout, value.requires_grad)
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return ("S", type(value).__name__, str(value.node.expr))
    return ("?", type(value).__name__)


def _replace(graph: fx.Graph, node: fx.Node, table: dict, traces: dict, fake_mode) -> bool:
    """Splice the decomposition of `node` in its place; False when it cannot be."""
    leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
    inputs = [a for a in leaves if isinstance(a, fx.Node)]
    vals = _distinct_values(inputs, fake_mode)
    if vals is None:
        return False
    first: dict[fx.Node, int] = {}  # which inputs are one value: stack([x, x]) != ([x, y])
    key = (node.target, str(spec), tuple(first.setdefault(a, len(first)) for a in inputs),
           tuple(_signature(a.meta["val"]) if isinstance(a, fx.Node) else ("c", repr(a))
                 for a in leaves))
    trace = traces.get(key)
    if trace is None:
        trace = traces[key] = _trace(node.target, leaves, spec, vals, table, fake_mode)
    if trace is False:
        return False
    env: dict[fx.Node, object] = {}
    placeholders = iter(inputs)
    result = None
    with graph.inserting_before(node):
        for t in trace.graph.nodes:
            if t.op == "placeholder":
                env[t] = next(placeholders)
            elif t.op == "call_function":
                new = graph.call_function(t.target, *pytree.tree_map(
                    lambda a: env[a] if isinstance(a, fx.Node) else a, (t.args, t.kwargs)))
                new.meta = {k: v for k, v in node.meta.items() if k in _META_KEPT}
                new.meta["val"] = t.meta.get("val")
                env[t] = new
            elif t.op == "output":
                result = pytree.tree_map(lambda a: env[a] if isinstance(a, fx.Node) else a,
                                         t.args[0])
            else:
                return False
    if isinstance(result, fx.Node):
        node.replace_all_uses_with(result)
    elif isinstance(result, list | tuple):
        for user in list(node.users):
            if user.target is not operator.getitem or not isinstance(result[user.args[1]],
                                                                      fx.Node):
                return False
            user.replace_all_uses_with(result[user.args[1]])
            graph.erase_node(user)
    else:
        return False
    graph.erase_node(node)
    return True


def _distinct_values(inputs: list[fx.Node], fake_mode) -> list | None:
    """The inputs' fake values, one tensor object per distinct node: make_fx knows a
    tensor by its identity, and a trace spliced twice leaves one value on both splices
    (two casts read by one stack traced as one cast read twice). None if one is missing."""
    owner: dict[int, fx.Node] = {}
    vals = []
    for a in inputs:
        v = a.meta.get("val")
        if v is None:
            return None
        if isinstance(v, torch.Tensor) and owner.setdefault(id(v), a) is not a:
            with fake_mode:
                v = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device,
                                        layout=v.layout, requires_grad=v.requires_grad)
        vals.append(v)
    return vals


def _trace(op, leaves: list, spec, vals: list, table: dict, fake_mode):
    """The decomposition of `op` at these arguments as a graph over its node inputs,
    or False when make_fx cannot give one kiln can splice."""
    positions = [i for i, a in enumerate(leaves) if isinstance(a, fx.Node)]

    def call(*inputs):
        filled = list(leaves)
        for i, v in zip(positions, inputs, strict=True):
            filled[i] = v
        args, kwargs = pytree.tree_unflatten(filled, spec)
        return op(*args, **kwargs)

    try:
        with fake_mode:
            gm = make_fx(call, decomposition_table=table, tracing_mode="real",
                         _allow_non_fake_inputs=False)(*vals)
    except Exception:  # noqa: BLE001 - any failure means: leave it to torch's re-trace
        return False
    for t in gm.graph.nodes:
        if t.op in ("get_attr", "call_module", "call_method"):
            return False  # a tensor constant or submodule the program would have to hold
        if t.op == "call_function" and (_is_inplace(t) or not callable(t.target)):
            return False
        if t.target is torch.ops.aten.sym_size.int and not isinstance(
                t.meta.get("val"), torch.SymInt):
            return False  # a size the trace pinned to a number: not valid at every size
    return gm


def _impure(node: fx.Node) -> bool:
    if node.op in ("placeholder", "output"):
        return True
    return node.is_impure()


def _program(ep: ExportedProgram, gm: fx.GraphModule, written: dict[str, fx.Node]
             ) -> ExportedProgram:
    """The ExportedProgram of the new graph, whose outputs are the buffers' new values
    (`written`, in that order), then the user's."""
    sig = ep.graph_signature
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(output.args[0])
    mutations, user_outs = outs[:len(written)], outs[len(written):]
    specs = [OutputSpec(OutputKind.BUFFER_MUTATION, TensorArgument(v.name), name)
             for name, v in zip(written, mutations, strict=True)]
    for s, node in zip(sig.output_specs, user_outs, strict=True):
        arg = type(s.arg)(name=node.name) if isinstance(node, fx.Node) else s.arg
        specs.append(OutputSpec(s.kind, arg, s.target))
    gm.graph.lint()
    gm.recompile()
    new_sig = ExportGraphSignature(input_specs=list(sig.input_specs), output_specs=specs)
    return ExportedProgram(
        root=gm, graph=gm.graph, graph_signature=new_sig, state_dict=ep.state_dict,
        range_constraints=ep.range_constraints, module_call_graph=ep.module_call_graph,
        example_inputs=ep.example_inputs, constants=ep.constants, verifiers=[Verifier])
