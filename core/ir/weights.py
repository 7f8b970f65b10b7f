"""Canonical weight names and the shapes a spec implies for them.

Adapters translate each Hugging Face tensor name to one of these; graphs reference them.
Linear weights are ``[out, in]`` (torch's convention); every routed expert has its own
``layers.{i}.moe.experts.{e}.{gate,up,down}`` names whether the checkpoint stores experts
as separate modules or as stacked 3-D tensors.
"""

from __future__ import annotations

import hashlib
import math
import weakref
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import torch

from npumoe.core.base.errors import InputError, WeightError
from npumoe.core.base.machine import available_memory
from npumoe.core.ir import DTYPE_POLICIES
from npumoe.core.ir.spec import AttentionSpec, MLPSpec, ModelSpec, MoESpec, NormSpec
from npumoe.core.ir.tensorfile import FLOAT_DTYPES


def layer(i: int) -> str:
    return f"layers.{i}"


def expert(i: int, e: int) -> str:
    return f"layers.{i}.moe.experts.{e}"


def _norm_shapes(prefix: str, norm: NormSpec, dim: int) -> dict[str, tuple[int, ...]]:
    shapes = {f"{prefix}.weight": (dim,)}
    if norm.bias:
        shapes[f"{prefix}.bias"] = (dim,)
    return shapes


def _linear_shapes(prefix: str, out: int, inp: int, bias: bool) -> dict[str, tuple[int, ...]]:
    shapes = {f"{prefix}.weight": (out, inp)}
    if bias:
        shapes[f"{prefix}.bias"] = (out,)
    return shapes


def mlp_shapes(prefix: str, mlp: MLPSpec, hidden: int) -> dict[str, tuple[int, ...]]:
    shapes = _linear_shapes(f"{prefix}.gate", mlp.intermediate, hidden, mlp.bias)
    shapes |= _linear_shapes(f"{prefix}.up", mlp.intermediate, hidden, mlp.bias)
    shapes |= _linear_shapes(f"{prefix}.down", hidden, mlp.intermediate, mlp.bias)
    return shapes


def attention_shapes(prefix: str, att: AttentionSpec, hidden: int) -> dict[str, tuple[int, ...]]:
    hq, hkv = att.num_heads, att.num_kv_heads
    shapes: dict[str, tuple[int, ...]] = {}
    if att.kind == "mla":
        if att.q_lora_rank:
            shapes |= _linear_shapes(f"{prefix}.q_a", att.q_lora_rank, hidden, att.qkv_bias)
            shapes[f"{prefix}.q_a_norm.weight"] = (att.q_lora_rank,)
            shapes |= _linear_shapes(f"{prefix}.q_b", hq * att.head_dim, att.q_lora_rank, False)
        else:
            shapes |= _linear_shapes(f"{prefix}.q", hq * att.head_dim, hidden, False)
        shapes |= _linear_shapes(
            f"{prefix}.kv_a", att.kv_lora_rank + att.qk_rope_head_dim, hidden, att.qkv_bias
        )
        shapes[f"{prefix}.kv_a_norm.weight"] = (att.kv_lora_rank,)
        shapes |= _linear_shapes(
            f"{prefix}.kv_b", hq * (att.qk_nope_head_dim + att.v_head_dim), att.kv_lora_rank, False
        )
    else:
        shapes |= _linear_shapes(f"{prefix}.q", hq * att.head_dim, hidden, att.qkv_bias)
        shapes |= _linear_shapes(f"{prefix}.k", hkv * att.head_dim, hidden, att.qkv_bias)
        shapes |= _linear_shapes(f"{prefix}.v", hkv * att.v_head_dim, hidden, att.qkv_bias)
        if att.qk_norm == "head":
            shapes[f"{prefix}.q_norm.weight"] = (att.head_dim,)
            shapes[f"{prefix}.k_norm.weight"] = (att.head_dim,)
        elif att.qk_norm == "full":
            shapes[f"{prefix}.q_norm.weight"] = (hq * att.head_dim,)
            shapes[f"{prefix}.k_norm.weight"] = (hkv * att.head_dim,)
    shapes |= _linear_shapes(f"{prefix}.o", hidden, hq * att.v_head_dim, att.o_bias)
    if att.sinks:
        shapes[f"{prefix}.sinks"] = (hq,)
    return shapes


def moe_shapes(i: int, moe: MoESpec, hidden: int) -> dict[str, tuple[int, ...]]:
    prefix = f"{layer(i)}.moe"
    shapes = _linear_shapes(f"{prefix}.router", moe.num_experts, hidden, moe.router.bias)
    if moe.router.correction_bias:
        shapes[f"{prefix}.router.correction_bias"] = (moe.num_experts,)
    for e in range(moe.num_experts):
        shapes |= mlp_shapes(expert(i, e), moe.expert, hidden)
    if moe.shared is not None:
        shapes |= mlp_shapes(f"{prefix}.shared", moe.shared, hidden)
        if moe.shared_gate:
            shapes[f"{prefix}.shared_gate.weight"] = (1, hidden)
    return shapes


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor the spec needs, with its shape."""
    h = spec.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (spec.vocab_size, h)}
    for i, ls in enumerate(spec.layers):
        shapes |= _norm_shapes(f"{layer(i)}.attn_norm", ls.norm, h)
        shapes |= attention_shapes(f"{layer(i)}.attn", ls.attention, h)
        shapes |= _norm_shapes(f"{layer(i)}.ffn_norm", ls.norm, h)
        if isinstance(ls.ffn, MoESpec):
            shapes |= moe_shapes(i, ls.ffn, h)
        else:
            shapes |= mlp_shapes(f"{layer(i)}.mlp", ls.ffn, h)
    shapes |= _norm_shapes("norm", spec.norm, h)
    if not spec.tie_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    if spec.lm_head_bias:
        shapes["lm_head.bias"] = (spec.vocab_size,)
    return shapes


@dataclass(frozen=True)
class TensorSource:
    """One canonical tensor before it is read: its stored shape and dtype, and how to read it
    (for a mapped checkpoint, a view of the file: no copy)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    read: Callable[[], torch.Tensor]

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSource:
        return cls(tuple(tensor.shape), tensor.dtype, lambda: tensor)


FP32_SHARE_OF_AVAILABLE = 0.5  # ``auto`` computes in fp32 when an fp32 copy takes at most this share of free memory


def fp32_sensitive(name: str, shape: tuple[int, ...]) -> bool:
    """Tensors kept in fp32 whatever the compute dtype: norms, biases, sinks (1-D, small) and the
    router, whose scores pick the experts (a bf16 router flips near-tied top-k choices)."""
    return len(shape) < 2 or ".moe.router." in name


def resolve_dtype(policy: str, sources: Mapping[str, TensorSource], spec: ModelSpec,
                  fast_dtypes: Callable[[], Collection[torch.dtype]] | None = None) -> torch.dtype:
    """The compute dtype of low-precision-tolerant matrices under a dtype policy.

    ``auto``: the stored dtype of the largest matrices where the CPU kernels compute from it faster than from
    fp32 (``fast_dtypes()``, asked only then: the loader knows the kernels, this layer does not), at every model
    size; else fp32 when an fp32 copy of the model fits comfortably in free memory, else that stored dtype (so a
    7 B checkpoint runs from its mapped bytes). Norms and the router stay fp32 either way (:func:`fp32_sensitive`)."""
    if policy not in DTYPE_POLICIES:
        raise InputError(f"dtype {policy!r} is not a compute dtype policy; use one of {', '.join(DTYPE_POLICIES)}.")
    if policy != "auto":
        return getattr(torch, policy)
    stored = [s.dtype for s in sources.values() if s.dtype in (torch.bfloat16, torch.float16)]
    largest = max(set(stored), key=stored.count) if stored else torch.float32
    if largest != torch.float32 and fast_dtypes is not None and largest in fast_dtypes():
        return largest
    params = sum(math.prod(shape) for shape in expected_shapes(spec).values())
    available = available_memory()
    if not available or params * 4 <= FP32_SHARE_OF_AVAILABLE * available:
        return torch.float32
    return largest


class Weights(Mapping):
    """Canonical name → tensor, checked against the spec at construction without reading data.

    ``weights[name]`` reads the tensor when asked (a mapped view where the checkpoint is mapped)
    and returns it in the compute dtype: matrices in ``dtype``, :func:`fp32_sensitive` tensors in
    fp32. A converted copy is shared by every holder while one is alive, never cached beyond."""

    def __init__(self, tensors: Mapping[str, TensorSource | torch.Tensor], spec: ModelSpec, source: str = "",
                 dtype: str | torch.dtype = "float32", fast_dtypes: Callable[[], Collection[torch.dtype]] | None = None):
        sources = {n: t if isinstance(t, TensorSource) else TensorSource.of(t) for n, t in tensors.items()}
        want = expected_shapes(spec)
        missing = [n for n in want if n not in sources]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise WeightError(
                f"{source or 'checkpoint'} is missing tensor {missing[0]!r}{more}; "
                "is this checkpoint complete and of the model type its config.json names?"
            )
        for name, shape in want.items():
            got = sources[name].shape
            if got != shape:
                raise WeightError(
                    f"tensor {name!r} in {source or 'checkpoint'} has shape {list(got)}, but its "
                    f"config.json implies {list(shape)}; the weights and the config do not match."
                )
            if sources[name].dtype not in FLOAT_DTYPES:
                raise WeightError(
                    f"tensor {name!r} in {source or 'checkpoint'} is stored as {sources[name].dtype}, where a "
                    "floating-point weight belongs; the checkpoint is damaged or in a format npumoe does not read."
                )
        self._sources = {n: sources[n] for n in want}
        self.spec = spec
        self.dtype = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype, self._sources, spec,
                                                                                fast_dtypes)
        self._converted: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()
        self.origin: tuple[Callable, tuple] | None = None  # (function, args) reopening them elsewhere: the loader's

    def __reduce__(self):
        """Weights reach another process (a cluster's worker) as where to map them from, never as their bytes:
        a real model's are tens of GB, and every worker can map the same checkpoint."""
        if self.origin is None:
            raise InputError("these weights were made in memory, so no other process can reopen them; save them as "
                             "a checkpoint directory and load that (npumoe.load).")
        return self.origin

    def __getitem__(self, name: str) -> torch.Tensor:
        src = self.source(name)
        dtype = torch.float32 if fp32_sensitive(name, src.shape) else self.dtype
        if src.dtype == dtype:
            return src.read()
        tensor = self._converted.get(name)
        if tensor is None:
            tensor = self._converted[name] = src.read().to(dtype)
        return tensor

    def source(self, name: str) -> TensorSource:
        if name == "lm_head.weight" and self.spec.tie_embeddings:
            name = "embed.weight"
        return self._sources[name]

    def __iter__(self):
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)

    def digest(self, names) -> str:
        """A hash of the named tensors as stored (see :func:`weights_digest`)."""
        h = hashlib.blake2b(digest_size=16)
        for name in names:
            h.update(name.encode())
            tensor_digest(h, self.source(name).read())
        return h.hexdigest()

    @property
    def stored_dtypes(self) -> dict[torch.dtype, int]:
        """Parameters per stored dtype."""
        counts: dict[torch.dtype, int] = {}
        for s in self._sources.values():
            counts[s.dtype] = counts.get(s.dtype, 0) + math.prod(s.shape)
        return counts


def tensor_digest(h, tensor: torch.Tensor) -> None:
    """Feed a tensor's dtype, shape and bytes to the hash ``h``."""
    tensor = tensor.detach().contiguous()
    h.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    if tensor.numel():
        h.update(tensor.view(-1).view(torch.uint8).numpy())


def weights_digest(weights: Mapping[str, torch.Tensor], names) -> str:
    """A hash of the named weights' stored bytes (what a built artifact depends on): a :class:`Weights`
    answers from its stored tensors, so a mapped bf16 checkpoint is hashed without widening it."""
    if isinstance(weights, Weights):
        return weights.digest(names)
    h = hashlib.blake2b(digest_size=16)
    for name in names:
        h.update(name.encode())
        tensor_digest(h, weights[name])
    return h.hexdigest()


def weight_shape(weights: Mapping[str, torch.Tensor], name: str) -> tuple[int, ...]:
    """A weight's shape. Backends take any mapping; a :class:`Weights` answers without
    reading the tensor, which for a packed matrix would mean dequantising it."""
    return weights.source(name).shape if isinstance(weights, Weights) else tuple(weights[name].shape)


def compute_bytes(weights: Mapping[str, torch.Tensor], names) -> int:
    """Bytes the named weights occupy as a run holds them (the compute dtype, fp32 for the fp32-sensitive ones;
    a packed matrix's packed buffers), without reading any of them."""
    packed = getattr(weights, "packed", {})
    total = 0
    for name in names:
        if name in packed:
            total += sum(b.nbytes for b in packed[name].buffers())
            continue
        shape = weight_shape(weights, name)
        if isinstance(weights, Weights):
            itemsize = 4 if fp32_sensitive(name, shape) else weights.dtype.itemsize
        else:
            itemsize = weights[name].element_size()
        total += math.prod(shape) * itemsize
    return total
