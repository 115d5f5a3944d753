# mypy: disable-error-code="misc"
"""Mixture-of-experts feed-forward: a router picks ``top_k`` experts per token,
the chosen SwiGLU experts run on their tokens, and their outputs are summed with
the routing weights; optional shared experts run on every token.

Routing (``select_experts``, a pure function):
- softmax (Mixtral, Qwen2-MoE, DeepSeek-V2): softmax over all experts, top-k (V2: within
  the best groups, a group scored by its best expert), optionally renormalised, scaled by
  ``routed_scaling_factor``;
- sigmoid (DeepSeek-V3, GLM-4.5): sigmoid scores plus a per-expert correction bias
  *choose* the experts (within the best ``topk_groups`` groups), the unbiased
  scores *weight* them, renormalised and scaled by ``routed_scaling_factor``.

In a worker group the layer owns the experts its rank holds in the group's
``ExpertMap`` (``worker/parallel/expert_map.py``), and every rank holds every token:
- tensor parallel: each rank runs its experts on the tokens routed to them and the
  ranks' partial sums are all-reduced (every token is already on every rank);
- expert parallel: each rank takes its share of the tokens, sends each (token,
  expert) pair to the rank of the expert (all-to-all), runs what it receives, sends
  the results back (all-to-all) and weights them, and the ranks' shares are gathered.
Every rank routes every token (a small matmul), so each one counts the whole
batch. Quantized (``--quantization``), each local expert's two matrices become
``QuantizedWeight``s after loading (``quantize``); the router stays in float32. Every layer adds the
(token, expert) pairs routed to each expert to ``routed_tokens`` (cumulative; the
model gives all its MoE layers one such tensor) for the worker's load report."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from worker.config import MoeConfig
from worker.layers.fused import silu_and_mul
from worker.layers.linear import check_shape, copy_checked
from worker.layers.mlp import Loader, SwiGLU
from worker.layers.packing import PackedLinear, PackKind, brgemm_fits, pack_as, pack_invariant, packed_linear
from worker.parallel import all_reduce, get_parallel_state
from worker.parallel.expert_map import ExpertMap
from worker.parallel.state import all_gather_rows, all_to_all_rows, split_points
from worker.quant.matmul import quant_linear
from worker.quant.method import QuantMethod
from worker.quant.weight import QuantizedWeight, cat_rows


def select_experts(logits: torch.Tensor, cfg: MoeConfig,
                   correction_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [num_tokens, num_experts] float32 -> (weights, ids), each [num_tokens, top_k]."""
    scores = logits.softmax(dim=-1) if cfg.scoring == "softmax" else logits.sigmoid()
    choice = scores + correction_bias if correction_bias is not None else scores
    if cfg.num_groups > 1:
        grouped = choice.view(-1, cfg.num_groups, cfg.num_experts // cfg.num_groups)
        if cfg.group_score == "max":
            group_scores = grouped.max(dim=-1).values  # [num_tokens, num_groups]
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(cfg.topk_groups, dim=-1).indices, 1)
        choice = choice.masked_fill(~keep.bool().repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
    ids = choice.topk(cfg.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


class SparseMoe(nn.Module):
    # per local expert: (gate/up, down) in low precision, in place of w13 and w2
    expert_quants: list[tuple[QuantizedWeight, QuantizedWeight]] | None = None
    # on the CPU (``pack``): per local expert (gate/up, down) in a batch-invariant layout, in place of w13
    # and w2, and the router's and the shared expert's gates (an expert's rows vary with the batch)
    expert_packs: list[tuple[PackedLinear, PackedLinear]] | None = None
    packed_gate: PackedLinear | None = None
    packed_shared_gate: PackedLinear | None = None
    # the local experts in one native call (``fused``), and the expert weights it was made for
    _fused: Callable[..., torch.Tensor] | None = None
    _fused_source: list | None = None  # the expert_quants or expert_packs list it was made for

    def __init__(self, hidden_size: int, cfg: MoeConfig, dtype: torch.dtype, names: tuple[str, str, str]):
        super().__init__()
        self.cfg = cfg
        self.names = names  # the checkpoint's names of an expert's gate, up and down
        ps = get_parallel_state()
        self.expert_map = ExpertMap.contiguous(cfg.num_experts, ps.width)
        self.dispatch = ps.ep_size > 1  # tokens travel to their experts' ranks (else: all-reduce)
        local = self.expert_map.local(ps.stage_rank)
        self.num_local_experts = len(local)
        self.local_slot = {e: k for k, e in enumerate(local)}
        # expert id -> its local slot here; another rank's experts get the slot past the last
        # (made on the model's device: the model is built under torch.device)
        self.slot_of = torch.full((cfg.num_experts,), self.num_local_experts, dtype=torch.long)
        self.slot_of[local] = torch.arange(self.num_local_experts)
        self.rank_of = torch.tensor(self.expert_map.ranks, dtype=torch.long)
        self.routed_tokens = torch.zeros(cfg.num_experts, dtype=torch.long)
        inter = cfg.intermediate_size
        self.gate = nn.Parameter(torch.empty(cfg.num_experts, hidden_size, dtype=dtype), requires_grad=False)
        self.correction_bias = (nn.Parameter(torch.zeros(cfg.num_experts), requires_grad=False)
                                if cfg.has_correction_bias else None)
        # [local_experts, 2 * intermediate, hidden] and [local_experts, hidden, intermediate]
        self.w13 = nn.Parameter(torch.empty(self.num_local_experts, 2 * inter, hidden_size, dtype=dtype),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, inter, dtype=dtype),
                               requires_grad=False)
        self.shared = SwiGLU(hidden_size, cfg.shared_intermediate_size, dtype) if cfg.shared_intermediate_size else None
        self.shared_gate = (nn.Parameter(torch.empty(1, hidden_size, dtype=dtype), requires_grad=False)
                            if cfg.has_shared_expert_gate and self.shared else None)

    def loaders(self, prefix: str, shared_name: str) -> dict[str, Loader]:
        out: dict[str, Loader] = {f"{prefix}gate.weight": self._copier(self.gate)}
        if self.correction_bias is not None:
            out[f"{prefix}gate.e_score_correction_bias"] = self._copier(self.correction_bias)
        for e in range(self.cfg.num_experts):
            gate, up, down = (f"{prefix}experts.{e}.{n}.weight" for n in self.names)
            local = self.local_slot.get(e)
            if local is None:  # another rank's expert
                out.update({gate: _skip, up: _skip, down: _skip})
                continue
            out.update({name: self._expert_loader(local, part) for part, name in enumerate((gate, up, down))})
        if self.shared is not None:
            out.update(self.shared.loaders(f"{prefix}{shared_name}."))
        if self.shared_gate is not None:
            out[f"{prefix}shared_expert_gate.weight"] = self._copier(self.shared_gate)
        return out

    @staticmethod
    def _copier(param: nn.Parameter) -> Loader:
        return lambda tensor: copy_checked(param.data, tensor)

    def _expert_loader(self, local: int, part: int) -> Loader:
        """Local expert ``local``'s gate (part 0), up (1) or down (2) projection: a float tensor
        copied into w13 / w2, or GGUF's quantized blocks, kept as they are (``expert_quants``)."""
        inter, hidden = self.cfg.intermediate_size, self.gate.shape[1]

        def load(tensor) -> None:
            check_shape(tensor, (inter, hidden) if part < 2 else (hidden, inter))
            value = tensor[:]  # all of a checkpoint tensor, or a QuantizedWeight (GGUF's blocks)
            if isinstance(value, QuantizedWeight):
                self._take_quantized(local, part, value)
            elif self.w13 is None:
                raise ValueError("the experts mix float and quantized tensors")
            else:
                target = self.w2.data[local] if part == 2 else self.w13.data[local][part * inter:(part + 1) * inter]
                target.copy_(value)
                self._has_float_experts = True
        return load

    def _take_quantized(self, local: int, part: int, quant: QuantizedWeight) -> None:
        if getattr(self, "_has_float_experts", False):
            raise ValueError("the experts mix float and quantized tensors")
        self._parts = getattr(self, "_parts", {})
        self._parts[local, part] = quant
        self.register_parameter("w13", None)
        self.register_parameter("w2", None)
        if len(self._parts) == 3 * self.num_local_experts:  # every local expert is in
            p = self._parts
            self.expert_quants = [(cat_rows([p[e, 0], p[e, 1]]), p[e, 2]) for e in range(self.num_local_experts)]
            del self._parts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden], the same on every rank of a group
        logits = self._linear(x.float(), self.packed_gate or self.gate.float())
        weights, ids = select_experts(logits, self.cfg, self.correction_bias)
        self.routed_tokens += torch.bincount(ids.flatten(), minlength=self.cfg.num_experts)  # no sync on CUDA
        out = self._dispatched(x, weights, ids) if self.dispatch else self._all_reduced(x, weights, ids)
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self._linear(x, self.packed_shared_gate or self.shared_gate)) * shared
            out = out + shared
        return out

    def _all_reduced(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's experts on the tokens routed to them, summed over the ranks."""
        slots = self.slot_of[ids.flatten()]  # [num_tokens * top_k]; other ranks' experts sort last
        tokens = torch.arange(len(x), device=x.device).repeat_interleave(self.cfg.top_k)
        if (fused := self.fused()) is not None:
            return all_reduce(fused(x.contiguous(), tokens, slots, weights.flatten().float()))
        out = torch.zeros_like(x)
        for local, sel in self._by_slot(slots):  # flat (token, k) indices of this expert
            y = self._expert(local, x[tokens[sel]])
            out.index_add_(0, tokens[sel], y * weights.flatten()[sel, None].to(y.dtype))
        return all_reduce(out)

    def _dispatched(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's share of the tokens through their experts, wherever those live."""
        ps, k = get_parallel_state(), self.cfg.top_k
        points = split_points(len(x), ps.width)
        lo, hi = points[ps.stage_rank], points[ps.stage_rank + 1]
        expert = ids[lo:hi].flatten()
        order = expert.argsort(stable=True)  # by expert, so by its rank (the map is contiguous)
        send_counts = torch.bincount(self.rank_of[expert], minlength=ps.width).tolist()
        bound = (points[1] - points[0]) * k * ps.width  # rows a rank can receive at most
        recv_expert, counts = all_to_all_rows(expert[order], send_counts, bound)
        recv_x, _ = all_to_all_rows(x[lo:hi][order // k], send_counts, bound)
        recv_slots = self.slot_of[recv_expert]
        if (fused := self.fused()) is not None:
            y = fused(recv_x.contiguous(), torch.arange(len(recv_x)), recv_slots, None)
        else:
            y = torch.empty_like(recv_x)
            for local, sel in self._by_slot(recv_slots):
                y[sel] = self._expert(local, recv_x[sel])
        back, _ = all_to_all_rows(y, counts, bound)  # in the order this rank sent them
        out = torch.zeros_like(x[lo:hi])
        out.index_add_(0, order // k, back * weights[lo:hi].flatten()[order, None].to(back.dtype))
        return all_gather_rows(out, points[1] - points[0])

    def _by_slot(self, slots: torch.Tensor):
        """(local expert, indices of ``slots`` that name it), for each local expert used."""
        order = slots.argsort(stable=True)
        start = 0
        for local, count in enumerate(torch.bincount(slots, minlength=self.num_local_experts + 1).tolist()):
            if local < self.num_local_experts and count:
                yield local, order[start:start + count]
            start += count

    def _expert(self, local: int, x: torch.Tensor) -> torch.Tensor:
        w13: torch.Tensor | PackedLinear | QuantizedWeight
        w2: torch.Tensor | PackedLinear | QuantizedWeight
        if self.expert_quants is not None:
            w13, w2 = self.expert_quants[local]
        elif self.expert_packs is not None:
            w13, w2 = self.expert_packs[local]
        else:
            w13, w2 = self.w13[local], self.w2[local]
        return self._linear(silu_and_mul(self._linear(x, w13)), w2)

    @staticmethod
    def _linear(x: torch.Tensor, weight: torch.Tensor | PackedLinear | QuantizedWeight) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight):
            return quant_linear(x, weight)
        if isinstance(weight, PackedLinear):
            return packed_linear(x, None, weight, None)
        return packed_linear(x, weight, None, None)

    def quantize(self, method: QuantMethod) -> int:
        """Each local expert's matrices in ``method``'s codes (experts are whole on their
        rank, so a group's quantization is one process's); returns how many matrices."""
        if self.expert_quants is not None or any(w.shape[-1] % method.block for w in (self.w13, self.w2)):
            return 0
        self.expert_quants = [(method.quantize(self.w13[e]), method.quantize(self.w2[e]))
                              for e in range(self.num_local_experts)]
        self.register_parameter("w13", None)
        self.register_parameter("w2", None)
        return 2 * self.num_local_experts

    def pack(self) -> None:
        """The routers' and the float experts' matrices in batch-invariant layouts
        (``packing.pack_invariant``; the native CPU kernels must be loaded): a token's experts
        then give it the same bits whatever other tokens they serve in the step. The experts
        then run in one native call a layer (``worker/kernels/moe_experts.h``)."""
        self.packed_gate = pack_invariant(self.gate.float())
        if self.shared_gate is not None:
            self.packed_shared_gate = pack_invariant(self.shared_gate.data)
        if self.expert_quants is None:
            kind = PackKind.BRGEMM if all(brgemm_fits(w[0]) for w in (self.w13, self.w2)) else PackKind.INVARIANT
            self.expert_packs = [(pack_as(kind, self.w13[e]), pack_as(kind, self.w2[e]))
                                 for e in range(self.num_local_experts)]
            self.register_parameter("w13", None)
            self.register_parameter("w2", None)

    def fused(self) -> Callable[..., torch.Tensor] | None:
        """The local experts as one native call, (x, tokens, slots, weights or None) -> out
        (``worker/kernels/moe_experts.h``), where their weights are packed for one: the float
        experts (``pack``) and quantized ones with the int8-activation layout (the kernel
        choice, after loading). Made once per set of weights."""
        source = self.expert_quants if self.expert_quants is not None else self.expert_packs
        if source is not self._fused_source:  # new weights (the kernel choice sets a new list)
            self._fused_source, self._fused = source, _fused_experts(source, self.cfg.intermediate_size)
        return self._fused

    def is_batch_invariant(self) -> bool:
        return self.packed_gate is not None and (self.expert_quants is not None or self.expert_packs is not None)


def _skip(tensor: torch.Tensor) -> None:
    pass


def _fused_experts(experts: list | None, inter: int) -> Callable[..., torch.Tensor] | None:
    """The native call for these (gate/up, down) pairs, or None where they are not packed alike."""
    if not experts:
        return None
    w13, w2 = [pair[0] for pair in experts], [pair[1] for pair in experts]
    if isinstance(w13[0], PackedLinear):
        kinds = {p.kind for p in w13 + w2}
        if kinds == {PackKind.BRGEMM}:
            op = torch.ops.kervan.moe_experts_brgemm
        elif kinds == {PackKind.INVARIANT}:
            op = torch.ops.kervan.moe_experts_invariant
        else:
            return None
        d13, d2 = [p.data for p in w13], [p.data for p in w2]
        return lambda x, tokens, slots, weights: op(x, tokens, slots, weights, d13, d2, inter)
    formats = [{_int8_format(w) for w in ws} for ws in (w13, w2)]
    if any(len(f) != 1 or None in f for f in formats):
        return None
    d13, d2 = [w.int8.data for w in w13], [w.int8.data for w in w2]
    f13, f2 = ([v for v in f.pop() or ()] for f in formats)
    return lambda x, tokens, slots, weights: torch.ops.kervan.moe_experts_i8(x, tokens, slots, weights, d13, d2,
                                                                            inter, f13, f2)


def _int8_format(w: QuantizedWeight) -> tuple[int, ...] | None:
    """What ``moe_experts_i8`` needs to know of a weight's int8 layout (None: it has none)."""
    if w.int8 is None:
        return None
    return (w.group, int(w.int8.four_bit), int(w.int8.signed_codes), int(w.int8.half_params), w.int8.terms)

