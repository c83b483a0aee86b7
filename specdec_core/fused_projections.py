"""One matrix product where a decoder layer makes several of the same input: the attention's
query, key and value projections, and the MLP's gate and up projections.

At batch 1 a decode step multiplies one row by every weight of the model, so each projection is a
pass over its weight, and a small weight is a short pass that never reaches the memory bandwidth.
Measured on an NVIDIA H100 (benchmarks/results/gpu_breakdown.md; Llama-3.2-1B's shape, bf16, CUDA
graphs on, compile off): the key and value projections (2 MB each) took 5.3 us apiece, about 12% of
the bandwidth, 168 us of a 2.54 ms step for 4% of the weights; the query and output projections
(8 MB) reached 41%, the MLP's (32 MB) about 70%. Multiplied together, the query, key and value
weights make one 12 MB pass, and gate and up one 64 MB pass: 48 matrix products fewer per step of a
16-layer model.

transformers' attention and MLP modules call their projections one after the other on the same
hidden states (q, k, v; gate, up), so `fuse_projections(model)` keeps them as modules and changes
their class in place (FusedProjection, an nn.Linear):

- the group's weights (and biases) are copied once into one tensor, and each module's `weight`
  (`bias`) becomes a Parameter that is a view of its rows: parameters, state dict and every reader
  of `q_proj.weight` see the same values, and the model holds no second copy;
- the group's first module multiplies the input by the whole tensor and keeps the product on the
  group (ProjectionGroup); the others return their columns of it when
  they are called with the same input tensor, and multiply by their own rows otherwise (another
  input, another order: the same numbers, just not fused); the last one drops the product. The
  group is a submodule of each of its projections (`q_proj.group`; modules() lists it once);
- under autograd (a forward that records gradients for the weights or the input) every module is
  nn.Linear as before, so training is unaffected;
- the fused tensor is the group's buffer (not saved in the state dict), so torch.compile sees it
  as an input of the layer and one compiled layer still serves every layer (compile scope "layer").

The products are the same numbers as the separate ones up to the order a kernel sums in (one
wider GEMM may split its reduction differently): greedy tokens are compared in the tests.
Copying into a weight (`weight.copy_`, load_state_dict, an optimizer's step) writes into the fused
tensor. A deep copy, a move or a cast (`.to`), or a new Parameter assigned to `q_proj.weight`,
leaves the fused tensor apart from the Parameters; the group's first projection sees that in its
next eager forward (`ProjectionGroup.linked`, a pointer comparison) and copies them into one tensor
again. Compiled and captured forwards do not check (a pointer is no traced value): the engine's
prefills run eagerly before them.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# (parent attribute, projections called in this order on the same input)
GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))
_MARK = "_specdec_fused_projections"


class ProjectionGroup(torch.nn.Module):
    """The fused weight (and bias) of a parent's projections, and the last product while its
    projections are being called. Buffers, not parameters: the projections' own Parameters are
    views of them, and the state dict keeps the projections' keys only."""

    def __init__(self, members: list[torch.nn.Linear]):
        super().__init__()
        self.sizes = [m.out_features for m in members]
        self.register_buffer("weight", None, persistent=False)
        self.register_buffer("bias", None, persistent=False)
        # a plain list: the projections are not this module's children (they hold it as theirs)
        self.__dict__["members"] = list(members)
        self.input: torch.Tensor | None = None
        self.output: torch.Tensor | None = None
        self.link()

    @torch.no_grad()
    def link(self) -> None:
        """Copy the projections' weights (biases) into one tensor and make each projection's
        Parameter a view of its rows again (`param.data`: the Parameter objects, and an
        optimizer's hold on them, stay). Run at fusing and whenever linked() turns false."""
        members = self.members
        self.weight = torch.cat([m.weight for m in members])
        self.bias = torch.cat([m.bias for m in members]) if members[0].bias is not None else None
        start = 0
        for member, size in zip(members, self.sizes):
            member.weight.data = self.weight[start:start + size]
            if self.bias is not None:
                member.bias.data = self.bias[start:start + size]
            start += size

    def linked(self) -> bool:
        """Whether every projection's weight (bias) still is its rows of the fused tensor: a copy
        (copy.deepcopy), a move or a cast (`.to`) gives each its own storage."""
        for member in self.members:
            start = member._specdec_start
            if member.weight.data_ptr() != self.weight[start].data_ptr() or (
                    self.bias is not None and member.bias.data_ptr() != self.bias[start].data_ptr()):
                return False
        return True


class FusedProjection(torch.nn.Linear):
    """A projection of a ProjectionGroup (`group`): `_specdec_slot` (its place in the call order),
    `_specdec_start` (its first output column in the fused product). See the module's docstring."""

    _specdec_slot: int
    _specdec_start: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group: ProjectionGroup = self.group
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return F.linear(x, self.weight, self.bias)
        slot = self._specdec_slot
        if slot == 0:
            # eager calls only (a pointer is no traced value): prefills and first forwards run
            # eagerly before a cache's compiled or captured ones
            if not torch.compiler.is_compiling() and not group.linked():
                group.link()
            group.input = x
            group.output = F.linear(x, group.weight, group.bias)
        elif group.input is not x:      # not the group's input: this projection's own rows
            return F.linear(x, self.weight, self.bias)
        out = group.output.narrow(-1, self._specdec_start, self.out_features)
        if slot == len(group.sizes) - 1:
            group.input = group.output = None
        return out


def _fusable(modules: list) -> bool:
    """Whether the projections can share one product: plain nn.Linear, one input width, one
    device and dtype, all with a bias or none."""
    if not all(type(m) is torch.nn.Linear and "forward" not in m.__dict__ for m in modules):
        return False
    first = modules[0].weight
    return all(m.weight.shape[1] == first.shape[1] and m.weight.dtype == first.dtype
               and m.weight.device == first.device for m in modules) \
        and len({m.bias is None for m in modules}) == 1


def _fuse(parent: torch.nn.Module, names: tuple[str, ...]) -> bool:
    modules = [getattr(parent, name, None) for name in names]
    if not all(isinstance(m, torch.nn.Module) for m in modules) or not _fusable(modules):
        return False
    start = 0
    for slot, module in enumerate(modules):
        module._specdec_slot = slot
        module._specdec_start = start
        start += module.out_features
    group = ProjectionGroup(modules)
    for module in modules:
        # a submodule of each projection (modules() and buffers() list it once): torch.compile
        # then reads its tensors as the layer's inputs, the same body for every layer
        module.add_module("group", group)
        module.__class__ = FusedProjection
    return True


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a transformers causal LM (model.model.layers), or []."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    return list(layers) if isinstance(layers, torch.nn.ModuleList) else []


def fused_projections(model: torch.nn.Module) -> dict:
    """What fuse_projections did to `model`: {"attention": layers, "mlp": layers} (zeros if never)."""
    return dict(getattr(model, _MARK, None) or {"attention": 0, "mlp": 0})


def fuse_projections(model: torch.nn.Module) -> dict:
    """Fuse every decoder layer's q/k/v and gate/up projections of `model` in place (see the
    module's docstring); idempotent. Returns {"attention": layers fused, "mlp": layers fused}."""
    done = getattr(model, _MARK, None)
    if done is not None:
        return dict(done)
    applied = {"attention": 0, "mlp": 0}
    for layer in decoder_blocks(model):
        for (parent_name, names), key in zip(GROUPS, ("attention", "mlp")):
            parent = getattr(layer, parent_name, None)
            if isinstance(parent, torch.nn.Module) and _fuse(parent, names):
                applied[key] += 1
    setattr(model, _MARK, dict(applied))
    if applied["attention"] or applied["mlp"]:
        log.info("fused projections of %s: %d attention, %d MLP", type(model).__name__,
                 applied["attention"], applied["mlp"])
    return applied
