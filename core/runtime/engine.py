"""The engine: chunked prefill, KV cache, greedy decode — all through the Program's graphs.

Host steps (embedding, rope tables, masks, KV appends, routing, dispatch, combine,
residuals, sampling) run here; every static graph runs on the executor its placement
names. Nothing here calls transformers.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from npumoe.core.base.errors import InputError, NumericError, whole_number
from npumoe.core.compiler.interpreter import TorchGraphExecutor
from npumoe.core.compiler.program import Program, build_program
from npumoe.core.ir.backend import Executor
from npumoe.core.ir.rope import cos_sin, short_context
from npumoe.core.ir.spec import MoESpec
from npumoe.core.ir.weights import compute_bytes
from npumoe.core.runtime import DEFAULT_CHUNK
from npumoe.core.runtime.allocator import keep_freed_blocks
from npumoe.core.runtime.cpu_experts import CpuExperts
from npumoe.core.runtime.device_step import DeviceStep, StepRequest, decode_graphs
from npumoe.core.runtime.fused import attention_block
from npumoe.core.runtime.handoff import KVHandoff
from npumoe.core.runtime.kvcache import DecodeMasks, KVCache, attention_mask
from npumoe.core.runtime.metrics import Metrics
from npumoe.core.runtime.moe import MoELayer
from npumoe.core.runtime.residency import ResidentExecutors
from npumoe.luts.decode import AttentionBlock, DecodeStep
from npumoe.luts.torch_op import kernels_take_bf16_prompts, torch_on_one_thread

DEFAULT_MAX_CONTEXT = 512
CACHE_BUCKET = 32  # CPU attention reads the filled cache slots rounded up to this (masks change per bucket)


def _chunk_by_chunk(observe, sizes: list[int], layer: int, experts, weights, attn_out) -> None:
    """A buffered prompt's routing shown to an ``on_route`` observer a chunk at a time, as unbuffered runs show it
    (calibration counts expert loads per chunk)."""
    for parts in zip(experts.split(sizes), weights.split(sizes), attn_out.split(sizes)):
        observe(layer, *parts)


_UNBUILT = object()  # a fused decode step not yet asked for

# Every public run is in torch's inference mode: no autograd or version-counter bookkeeping on any op. A decode
# step is a few hundred small ops, so that bookkeeping is a visible share of it (docs/performance.md).
_inference = torch.inference_mode()


class Engine:
    """Run a loaded model: ``forward(ids)`` → logits, ``generate(ids, n)`` → new ids."""

    def __init__(self, model, plan=None, backend: str = "cpu", artifacts=None,
                 chunk: int | None = None, max_context: int | None = None, on_route=None,
                 backend_options: dict | None = None, max_resident_bytes: int | None = None, predictor=None,
                 preload: int | None = None, overlap: bool | None = None, buffering: bool = True):
        """``on_route(layer, experts[S,k], weights[S,k], attn_out[S,H])`` observes every routing
        decision (calibration and tests use it); it must not modify its arguments.
        ``backend_options`` go to the backend's constructor (e.g. ``profile_dir`` for the HTP).
        ``max_resident_bytes`` bounds the graphs loaded at once (:mod:`npumoe.core.runtime.residency`);
        None loads every graph at start. At decode, a ``predictor`` (:class:`~npumoe.core.runtime.predictor.
        RoutingPredictor`) names before each MoE layer's attention the ``preload`` experts (default: top-k) it
        expects; their groups' graphs are prefetched, and ``predicted_hits`` / ``routed_experts`` count how often
        it was right.
        ``overlap`` runs a MoE layer's NPU launches on a worker thread while its CPU experts run; by default only
        where they run on a device (``backend`` not cpu): here, NPU-placed graphs computed by the CPU would only
        compete with the CPU experts for its cores. ``buffering``: a prompt longer than a chunk runs layer by layer
        (under spill only): each layer's routed tokens wait per expert for full NPU launches, and each CPU expert
        reads its weights once for all of its tokens.
        The first Engine of a process raises glibc's mmap and trim thresholds for it (32 MB, 256 MB: see
        :mod:`npumoe.core.runtime.allocator`); set ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` to keep
        your own."""
        for name, value in (("chunk", chunk), ("max_context", max_context)):
            if value is not None:
                whole_number(value, name, 1)
        keep_freed_blocks()
        self.model = model
        self.backend_options = dict(backend_options or {})
        self.on_route = on_route
        self.predictor, self._predicted, self._routed = predictor, {}, {}
        moe_layers = list(model.spec.moe_layers)
        self._previous_moe = dict(zip(moe_layers[1:], moe_layers))  # whose routing the predictor may read
        self.spec = model.spec
        if artifacts is not None:
            from npumoe.core.compiler.artifacts import check_built_for, read_manifest, target_directory
            from npumoe.core.planning.plan import artifacts_plan

            artifacts = target_directory(artifacts, backend)  # a multi-target build: this backend's part
            manifest = read_manifest(artifacts, verify=False)  # files are verified when loaded
            if manifest.get("target") != backend:  # a CPU run would otherwise ignore them and look like theirs
                raise InputError(f"{artifacts} holds a build for {manifest.get('target')!r}, not {backend!r}; pass "
                                 f"--target {manifest.get('target')} (backend={manifest.get('target')!r}) to run it.")
            check_built_for(manifest, artifacts, model)  # before its plan's check, so the message names the artifacts
            chunk, max_context = manifest["chunk"], manifest["max_context"]
            plan = artifacts_plan(manifest, artifacts, plan)  # theirs: another would run their graphs wrongly
        elif backend != "cpu":
            raise InputError(f"backend {backend!r} runs built artifacts: run npumoe build --target {backend} "
                             "first and pass artifacts=OUT.")
        chunk = plan.chunk if plan is not None else (chunk or DEFAULT_CHUNK)
        max_context = max_context or min(self.spec.max_position, DEFAULT_MAX_CONTEXT)
        if plan is not None:
            plan.check_model(model)
        self.program: Program = build_program(self.spec, chunk=chunk, max_context=max_context, plan=plan)
        npu_experts = any(g.kind == "experts" and g.placement == "npu" for g in self.program.graphs.values())
        overlap = backend != "cpu" if overlap is None else overlap
        self.device = ThreadPoolExecutor(1, thread_name_prefix="npumoe-npu") if overlap and npu_experts else None
        self.metrics_ = Metrics(threaded=self.device is not None)
        self.executors = self._executors(backend, artifacts, max_resident_bytes)
        self.cache = KVCache(self.program)
        self.preload = preload or max((ls.ffn.top_k for ls in self.spec.layers if isinstance(ls.ffn, MoESpec)),
                                      default=0)
        self.moe_layers = self._moe_layers()
        self.buffering = buffering and any(
            step.moe is not None and step.moe.overflow == "spill" for step in self.program.layers)
        self.embedding = model.weights["embed.weight"]  # once: in fp32 from a bf16 file, a converted copy
        self._rope_tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._decode_masks = DecodeMasks()
        self._fused_attention_blocks: dict[int, AttentionBlock | None] = {}
        self._step_call: DecodeStep | None | object = _UNBUILT
        self._device_call: DeviceStep | None | object = _UNBUILT
        self._device_graphs: tuple[list[str], list[dict[int, str]]] = ([], [])  # (fixed, per MoE layer e → graph)
        ropes = [(ls.attention.rope, ls.attention.qk_rope_head_dim if ls.attention.kind == "mla"
                  else ls.attention.head_dim) for ls in self.spec.layers]  # (rope, rotated dims) per layer
        self._ropes = dict(enumerate(ropes))
        self._rope_keys = [ropes.index(rope) for rope in ropes]  # per layer, the first layer alike in rope
        self._start_position: tuple[int, torch.Tensor] = (-1, torch.zeros(1, dtype=torch.int32))
        self.rope_limit = min(filter(None, (short_context(ls.attention.rope) for ls in self.spec.layers)), default=None)

    # -- set-up ---------------------------------------------------------------------------
    def _executors(self, backend: str, artifacts, budget: int | None) -> ResidentExecutors:
        weights, graphs = self.model.weights, self.program.graphs
        on_cpu = [g for g in graphs.values() if g.placement == "cpu" or backend == "cpu"]
        loaders = {g.name: functools.partial(TorchGraphExecutor, g, weights) for g in on_cpu}
        sizes = {g.name: compute_bytes(weights, g.weight_names()) for g in on_cpu}
        if npu := [g for g in graphs.values() if g.name not in loaders]:
            from npumoe.core.compiler.artifacts import executor_loaders
            from npumoe.core.ir.backend import get_backend

            npu_loaders, npu_sizes = executor_loaders(get_backend(backend, **self.backend_options), artifacts, npu,
                                                      weights, self.model)
            loaders |= npu_loaders
            sizes |= npu_sizes
        executors = ResidentExecutors(loaders, sizes, budget, self.metrics_)
        if budget is None:
            executors.load_all()
        return executors

    def _moe_layers(self) -> dict[tuple[int, int], MoELayer]:
        """Per MoE layer and sequence length, the host runtime, sharing the layer's any-size CPU experts (the path for
        spilled tokens and CPU-resident experts)."""
        out = {}
        for i, step in enumerate(self.program.layers):
            if step.moe is None:
                continue
            cpu = CpuExperts.of(self.spec, i, self.model.weights)
            for s in self.program.seqs:
                out[(i, s)] = MoELayer(i, self.spec.layers[i].ffn, self.model.weights, step.moe.groups[s], cpu,
                                       step.moe.overflow, self.device)
        return out

    @property
    def metrics(self) -> dict:
        return self.metrics_.as_dict()

    def record_spans(self) -> None:
        """Record a timeline of host steps from now on (``--trace``)."""
        self.metrics_.spans = []

    # -- public API -----------------------------------------------------------------------
    @_inference
    def forward(self, ids) -> np.ndarray:
        """Logits [T, vocab] (fp32) for a fresh sequence of token ids."""
        return self._prefill(self._check_ids(ids)).numpy()

    @_inference
    def route(self, ids) -> None:
        """Prefill a fresh sequence only for what it routes (``on_route`` sees every layer), without the
        LM head: calibration needs no logits, which for a 2048-token window of a 152k vocabulary are
        1.2 GB."""
        self._prefill(self._check_ids(ids), keep="none")

    @_inference
    def generate(self, ids, max_new_tokens: int = 32, return_logits: bool = False):
        """Greedy decoding from ``ids``; returns only the new tokens, stopping after an EOS.

        With ``return_logits`` also the logits [n, vocab] each new token was picked from."""
        max_new_tokens = whole_number(max_new_tokens, "max_new_tokens", 0)
        logits = self.prefill_prompt(self.check_generation(ids, max_new_tokens))
        return self.continue_greedy(logits, max_new_tokens, return_logits)

    def check_generation(self, ids, max_new_tokens: int) -> torch.Tensor:
        """``ids`` as a tensor, refused unless they and ``max_new_tokens`` more fit this engine's cache and rope."""
        ids = self._check_ids(ids)
        if self.cache.capacity < len(ids) + max_new_tokens:
            raise InputError(
                f"prompt ({len(ids)} tokens) plus {max_new_tokens} new tokens exceeds the KV cache "
                f"length {self.cache.capacity}; shorten the prompt or build with a larger max_context."
            )
        self._check_rope_range(len(ids) + max_new_tokens)
        return ids

    @_inference
    def prefill_prompt(self, ids: torch.Tensor) -> torch.Tensor:
        """A checked prompt (:meth:`check_generation`) into the emptied cache; the logits [vocab] of its last
        position."""
        with self.metrics_.time("prefill"):
            return self._prefill(ids, keep="last")[-1]

    @_inference
    def continue_greedy(self, logits: torch.Tensor, max_new_tokens: int, return_logits: bool = False):
        """:meth:`generate`'s greedy loop from the sequence in the cache, whose last position gave ``logits``."""
        new: list[int] = []
        seen: list[torch.Tensor] = []
        eos = set(self.spec.eos_token_ids)
        if max_new_tokens > 1:
            self._prepare_decode()
        while len(new) < max_new_tokens:
            seen.append(logits)
            with self.metrics_.time("sample"):
                token = int(torch.argmax(logits))
            new.append(token)
            if token in eos or len(new) == max_new_tokens:
                break
            logits = self._decode(token)
        tokens = np.asarray(new, dtype=np.int64)
        return (tokens, torch.stack(seen).numpy()) if return_logits else tokens

    def export_kv(self) -> KVHandoff:
        """The sequence in the cache, for another engine to decode from (:meth:`import_kv`): read once from where
        its keys and values live (an executor that keeps them on its device is asked for them), in fp32."""
        if self.cache.length == 0:
            raise InputError("there is no KV cache to hand over: prefill a prompt first.")
        k, v, sources = [], [], set()
        self.cache.on_host()
        for i, step in enumerate(self.program.layers):
            executor = self.executors[step.attention[self.program.chunk]]
            if executor.keeps_state:
                k.append(executor.read_cache("k_cache", self.cache.length))
                v.append(executor.read_cache("v_cache", self.cache.length))
                sources.add(f"{type(executor).__name__} state")
            else:
                k.append(self.cache.k[i][:, :self.cache.length].clone())
                v.append(self.cache.v[i][:, :self.cache.length].clone())
                sources.add("host cache")
        return KVHandoff(self.spec.fingerprint(), self.model.name, self.cache.length, k, v, ", ".join(sorted(sources)))

    def import_kv(self, handoff: KVHandoff) -> None:
        """Continue from another engine's sequence (:meth:`export_kv`): its cache written into this one's, once;
        decode then runs here."""
        if handoff.model != self.spec.fingerprint():
            raise InputError(f"the KV cache handed over was filled by {handoff.model_name} (config {handoff.model}), "
                             f"but this engine runs {self.model.name} (config {self.spec.fingerprint()}); prefill "
                             "and decode must load the same checkpoint.")
        if handoff.length > self.cache.capacity:
            raise InputError(f"the KV cache handed over holds {handoff.length} tokens, but this engine's holds "
                             f"{self.cache.capacity}; build the decode target with a larger max_context.")
        self.check_takes_kv()
        self.cache.reset()
        for i, (k, v) in enumerate(zip(handoff.k, handoff.v)):
            self.cache.write(i, k, v, 0, handoff.length)
        self.cache.length = handoff.length

    def check_takes_kv(self) -> None:
        """Refuse to decode from a handed-over cache where the decode graphs keep theirs on the device."""
        for step in self.program.layers:
            if self.executors[step.attention[1]].keeps_state:
                raise InputError(f"graph {step.attention[1]} keeps its KV cache on its device, where a handed-over "
                                 "cache is not written; decode on a target whose attention takes the cache as "
                                 "inputs (mlx, cpu).")

    @_inference
    def decode(self, token: int) -> np.ndarray:
        """One decode step after :meth:`generate` or :meth:`forward`: ``token`` appended to the sequence in
        the cache, the logits [vocab] (fp32) of the next position."""
        if self.cache.length == 0:
            raise InputError("decode continues a sequence, and none has started: run forward or generate on a "
                             "prompt first.")
        return self._decode(whole_number(token, "a token id", 0)).numpy()

    def _decode(self, token: int) -> torch.Tensor:
        if self.cache.length >= self.cache.capacity:
            raise InputError(f"the KV cache is full ({self.cache.capacity} tokens); raise max_context.")
        if not 0 <= token < self.spec.vocab_size:
            raise InputError(f"token id {token} is outside the vocabulary [0, {self.spec.vocab_size}).")
        self._check_rope_range(self.cache.length + 1)
        with self.metrics_.time("decode"), self._decode_threads():
            return self._step(torch.tensor([token]), valid=1)[0]

    # -- internals ------------------------------------------------------------------------
    def _decode_threads(self):
        """Where the LUT or bf16 kernels read a decode step's matrices, torch keeps one thread for the rest
        (see torch_on_one_thread); fp32 matrices are torch's own GEMVs and keep its threads."""
        weights = self.model.weights
        kernels_read = weights.dtype == torch.bfloat16 or bool(getattr(weights, "packed", None))
        return torch_on_one_thread() if kernels_read else contextlib.nullcontext()

    def _check_ids(self, ids) -> torch.Tensor:
        arr = np.asarray(ids)
        if arr.ndim != 1 or arr.size == 0:
            raise InputError("the prompt is empty (or not a 1-D list of token ids); give at least one token.")
        if not np.issubdtype(arr.dtype, np.integer):
            raise InputError(f"token ids must be integers, got dtype {arr.dtype}.")
        bad = arr[(arr < 0) | (arr >= self.spec.vocab_size)]
        if bad.size:
            raise InputError(
                f"token id {int(bad[0])} is outside the vocabulary [0, {self.spec.vocab_size}); "
                "was the prompt tokenized for another model?"
            )
        if arr.size > self.cache.capacity:
            raise InputError(
                f"the prompt has {arr.size} tokens but the KV cache holds {self.cache.capacity}; "
                "shorten it or raise max_context."
            )
        self._check_rope_range(arr.size)
        return torch.from_numpy(arr.astype(np.int64))

    def _check_rope_range(self, length: int) -> None:
        if self.rope_limit is not None and length > self.rope_limit:
            raise InputError(
                f"{length} tokens pass this model's longrope short context of {self.rope_limit}, beyond which every "
                "cached key would need re-rotating with the long factors; keep prompt plus new tokens within it."
            )

    def _prefill(self, ids: torch.Tensor, keep: str = "all") -> torch.Tensor | None:
        """A fresh sequence into the emptied cache; logits of ``keep``: "all" positions, the "last" one's (what
        generating needs), or "none" (the LM head is skipped). The cache is emptied on the prompt's threads:
        zeroed on all of torch's, their OpenMP workers spin on into the first kernel call and slow it."""
        with self._prompt_threads():
            self.cache.reset()
            return self._prefill_chunks(ids, keep)

    def _prompt_threads(self):
        """Where the kernels take a prompt's matrix products too (bf16 matrices on the dot-product or the widening
        GEMM), torch keeps one thread, as in decode, and the attention splits its queries across the kernels'
        threads; otherwise all its threads."""
        kernels_take = self.model.weights.dtype == torch.bfloat16 and kernels_take_bf16_prompts()
        return torch_on_one_thread() if kernels_take else contextlib.nullcontext()

    def _prefill_chunks(self, ids: torch.Tensor, keep: str) -> torch.Tensor | None:
        if self.buffering and len(ids) > self.program.chunk and self.cache.length == 0:
            return self._prefill_buffered(ids, keep)
        chunk, rows = self.program.chunk, []
        for start in range(0, len(ids), chunk):
            piece = ids[start:start + chunk]
            valid = len(piece)
            padded = torch.cat([piece, piece.new_zeros(chunk - valid)]) if valid < chunk else piece
            wanted = keep == "all" or (keep == "last" and start + chunk >= len(ids))
            logits = self._step(padded, valid, head=keep if wanted else "none")
            if wanted:
                rows.append(logits)
        return torch.cat(rows) if rows else None

    def _run(self, name: str, inputs: Mapping[str, torch.Tensor], executor: Executor | None = None
             ) -> dict[str, torch.Tensor]:
        """Graph ``name`` on ``inputs``, through ``executor`` when the caller already holds it."""
        self._count_launch(name)
        executor = executor or self.executors[name]
        with self.metrics_.running([name]):
            return executor(inputs)

    def _count_launch(self, name: str) -> None:
        placement = self.program.graphs[name].placement
        self.metrics_.add("npu_launches" if placement == "npu" else "cpu_launches")
        self.metrics_.add("weight_bytes", self.executors.sizes[name])

    def _rope_rows(self, key: int, start: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin rows of layer ``key``'s rope for positions start..start+seq-1, sliced from tables of every
        position a run can reach (computed once per rope: the same values cos_sin gives for them)."""
        if key not in self._rope_tables:
            cos, sin = cos_sin(*self._ropes[key], np.arange(self.cache.capacity + self.program.chunk))
            self._rope_tables[key] = torch.from_numpy(cos), torch.from_numpy(sin)
        cos, sin = self._rope_tables[key]
        return cos[start:start + seq], sin[start:start + seq]

    def _cache_slots(self, attention: str, start: int) -> int:
        """Cache slots the attention graph reads. An NPU graph's shapes are static: all of them. The CPU
        executor takes any length, so it gets the filled slots rounded up to CACHE_BUCKET: the same
        result (the rest are masked out), without reading and concatenating a mostly empty cache for
        every token (at OLMoE-1B-7B's widths and a 2048-token window, 1 GB a decode step)."""
        if self.program.graphs[attention].placement == "npu":
            return self.cache.capacity
        return min(self.cache.capacity, -(-max(start, 1) // CACHE_BUCKET) * CACHE_BUCKET)

    def _step(self, ids: torch.Tensor, valid: int, head: str = "all") -> torch.Tensor | None:
        """One static-shape pass over ``len(ids)`` positions, the first ``valid`` real; the logits ``head`` asks
        for (:meth:`_head`)."""
        start = self.cache.length
        if valid == ids.shape[0] == 1 and head != "none" and (logits := self._fused_step(int(ids[0]), start)) \
                is not None:
            self.cache.length += valid
            return logits
        self.cache.on_host()
        x = self._embed(ids, valid)
        shared: dict[tuple, object] = {}  # one step's rope rows and masks, for the layers alike in them
        for i, step in enumerate(self.program.layers):
            h, z = self._attention(i, x, start, valid, shared)
            y = self._feed_forward(i, z, h - x, valid)
            x = self._residual(i, x, h, y, valid)
        self.cache.length += valid
        return self._head(x, valid, head)

    def _prefill_buffered(self, ids: torch.Tensor, keep: str) -> torch.Tensor | None:
        """A multi-chunk prompt layer by layer: every chunk's attention, then the layer's MoE on all of the
        prompt's tokens at once, so that each expert's tokens wait for a full launch (expert-wise token
        buffering, :meth:`MoELayer._buffered_layout`) instead of padding every chunk, and a CPU expert's weights
        are read once for the prompt, not once a chunk. Exact: attention at a layer reads only that layer's
        cache, which the earlier chunks have written by then."""
        chunk, m = self.program.chunk, self.metrics_
        starts = list(range(0, len(ids), chunk))
        valid = [min(chunk, len(ids) - s) for s in starts]
        xs = [self._embed(torch.cat([ids[s:s + v], ids.new_zeros(chunk - v)]), v) for s, v in zip(starts, valid)]
        shared: list[dict] = [{} for _ in starts]
        for i, step in enumerate(self.program.layers):
            hz = [self._attention(i, x, s, v, mk) for x, s, v, mk in zip(xs, starts, valid, shared)]
            if step.moe is None:
                ys = [self._feed_forward(i, z, h - x, v) for (h, z), x, v in zip(hz, xs, valid)]
            else:
                real = lambda parts: torch.cat([p[:v] for p, v in zip(parts, valid)])  # noqa: E731
                observer = self._route_observer()
                y = self.moe_layers[(i, chunk)](real([z for _, z in hz]), real([h - x for (h, _), x in zip(hz, xs)]),
                                                len(ids), self._run, m, observer and functools.partial(
                                                    _chunk_by_chunk, observer, valid), len(starts))
                ys = [torch.cat([part, part.new_zeros(chunk - len(part), part.shape[1])])
                      for part in torch.split(y, valid)]
                if step.moe.shared is not None:
                    with m.time("shared_ffn"):
                        ys = [y + self._run(step.moe.shared[chunk], {"z": z})["y"] for y, (_, z) in zip(ys, hz)]
            xs = [self._residual(i, x, h, y, v) for x, (h, _), y, v in zip(xs, hz, ys, valid)]
        self.cache.length = len(ids)
        wanted = range(len(xs)) if keep == "all" else range(len(xs) - 1, len(xs)) if keep == "last" else ()
        rows = [self._head(xs[c], valid[c], keep) for c in wanted]
        return torch.cat(rows) if rows else None

    def _embed(self, ids: torch.Tensor, valid: int) -> torch.Tensor:
        with self.metrics_.time("embed"):
            x = self.embedding[ids].float() * self.spec.embedding_scale
        self._check_finite(x, valid, ids.shape[0], "embedding")
        return x

    def _attention(self, i: int, x: torch.Tensor, start: int, valid: int,
                   shared: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s attention graph on ``x`` (positions start..), its new keys and values written to the
        cache; h (the residual after attention) and z (its normalised input to the feed-forward)."""
        seq, m, step, att = x.shape[0], self.metrics_, self.program.layers[i], self.spec.layers[i].attention
        name = step.attention[seq]
        with m.time("rope_mask"):
            rope = self._rope_keys[i]  # (the first layer with this layer's rope: a cheap key)
            if rope not in shared:
                shared[rope] = self._rope_rows(rope, start, seq)
            cos, sin = shared[rope]
        if step.moe is not None and self.predictor is not None and seq == 1:
            self._prefetch(i, x, step.moe.groups[seq])
        if seq == 1 and (block := self._fused_attention(i, name)) is not None:
            with m.time("attention"):
                self._count_launch(name)
                with m.running([name]):
                    out = block(x, cos, sin, start, self.cache.k[i], self.cache.v[i])
            if out is not None:  # (its key and value are in the cache)
                return out
        slots = self._cache_slots(name, start)
        with m.time("rope_mask"):
            key = ("mask", att.sliding_window, slots)
            if key not in shared:
                shared[key] = self._decode_masks.get(att, start, slots) if seq == 1 else attention_mask(
                    att, start, seq, valid, slots)
        with m.time("attention"):
            executor = self.executors[name]
            feed = {"x": x, "cos": cos, "sin": sin, "mask": shared[key], "position": self._position(start)}
            if not executor.keeps_state:
                feed |= {"k_cache": self.cache.k[i][:, :slots], "v_cache": self.cache.v[i][:, :slots]}
            out = self._run(name, feed, executor)
        self.cache.write(i, out["k_new"], out["v_new"], start, valid)
        return out["h"], out["z"]

    def _prepare_decode(self) -> None:
        """Build the whole-step decode call (:meth:`_fused_step`'s) before the first token, timed as
        ``decode_setup``: a one-time cost (a record per matrix) that would otherwise land in the first token's
        time, and in every per-token rate over a short generation."""
        with self.metrics_.time("decode_setup"):
            if self._device_step() is None:
                self._decode_step()

    def _fused_step(self, token: int, start: int) -> torch.Tensor | None:
        """A decode token's logits [1, vocab] from one call, the backend's (:meth:`_device_step`) or the CPU
        kernels' (:meth:`_decode_step`), with the metrics the layer-by-layer path keeps; None where the call does
        not apply, or where its logits are not finite (the layer-by-layer path then runs the step again, writing
        the same cache slots, and names the graph)."""
        if (device := self._device_step()) is not None:
            return self._on_device(device, token, start)
        step = self._decode_step()
        if step is None:
            return None
        m, begin = self.metrics_, time.perf_counter()
        out = step(token, start)
        if out is None:
            return None
        end = time.perf_counter()
        logits, experts, _, routing = out
        m.record("layers", begin, end)
        m.record("router", begin, begin + routing)
        m.record("executor", begin + routing, end)
        for i, picked in enumerate(experts.tolist()):
            attention = self.program.layers[i].attention[1]
            m.count_runs([attention])
            self._count_launch(attention)
            self.moe_layers[(i, 1)].count_decode(picked, m)
        m.count_runs([self.program.lm_head[1]])
        self._count_launch(self.program.lm_head[1])
        return logits if self._finite(logits, 1) else None

    def _on_device(self, step: DeviceStep, token: int, start: int) -> torch.Tensor | None:
        """:meth:`_fused_step` through the backend's whole step, the host cache loaded onto its device first where
        the host wrote it last; None, with the cache back on the host, where the logits are not finite."""
        m, begin = self.metrics_, time.perf_counter()
        x = self._embed(torch.tensor([token]), 1)
        if self.cache.held_by is not step:
            self.cache.on_host()
            step.load(self.cache.k, self.cache.v, start)
            self.cache.held_by = step
        logits, experts = step(x, start)
        m.record("layers", begin, time.perf_counter())
        m.record("executor", begin, time.perf_counter())
        fixed, expert_graphs = self._device_graphs
        ran = fixed + sorted({graphs[e] for graphs, picked in zip(expert_graphs, experts) for e in picked})
        m.count_runs(ran)
        for name in ran:
            self._count_launch(name)
        m.add("routed", sum(map(len, experts)))
        if self._finite(logits, 1):
            return logits
        self.cache.on_host()
        return None

    def _device_step(self) -> DeviceStep | None:
        """The backend's whole decode step (:mod:`npumoe.core.runtime.device_step`), where every graph of a decode
        step is loaded (no memory budget) on executors of one type that offers one, and nothing watches the layers
        (no ``on_route``, no predictor); built at first use."""
        if self._device_call is _UNBUILT:
            self._device_call = None
            names = decode_graphs(self.program) if self.on_route is None and self.predictor is None \
                and self.executors.budget is None else None
            executors = {name: self.executors[name] for name in names or ()}
            kinds = {type(e) for e in executors.values()}
            build = getattr(kinds.pop(), "decode_step", None) if len(kinds) == 1 else None
            if build is None:
                return None
            rope = []
            for i in range(self.spec.num_layers):
                self._rope_rows(self._rope_keys[i], 0, 1)  # (its table of every position, built once)
                rope.append(self._rope_tables[self._rope_keys[i]])
            decode = {i: layer for (i, s), layer in self.moe_layers.items() if s == 1}
            routers = {i: (layer.moe.router, layer.router_weight, layer.router_bias, layer.correction)
                       for i, layer in decode.items()}
            others = {name: self.executors[name] for name in self.program.graphs if name not in executors}
            self._device_call = build(StepRequest(self.program, executors, rope, routers, others))
            expert_graphs = [{e: shape.graph for g in layer.static for shape in g.shapes
                              for e, c in zip(g.experts, shape.capacities) if c} for layer in decode.values()]
            self._device_graphs = [n for n in names if self.program.graphs[n].kind != "experts"], expert_graphs
        return self._device_call

    def _decode_step(self) -> DecodeStep | None:
        """The whole decode step as one kernel call, where every layer is an attention block and a CPU MoE layer
        the fused calls cover, the final norm is RMS, the LM head has no bias, and nothing watches the layers (no
        ``on_route``, no predictor); built at first use."""
        if self._step_call is _UNBUILT:
            self._step_call = None
            layers, program, spec, weights = [], self.program, self.spec, self.model.weights
            if self.on_route is not None or self.predictor is not None or 1 not in program.seqs or spec.lm_head_bias \
                    or spec.norm.kind != "rms" or type(self.executors[program.lm_head[1]]) is not TorchGraphExecutor:
                return None
            for i, step in enumerate(program.layers):
                attention = self._fused_attention(i, step.attention[1])
                moe = self.moe_layers[(i, 1)].fused_layer() if step.moe is not None and not step.moe.shared \
                    and not self.moe_layers[(i, 1)].static else None
                if attention is None or moe is None:
                    return None
                key = self._rope_keys[i]
                self._rope_rows(key, 0, 1)  # (its table of every position, built once)
                layers.append((attention, moe, self.cache.k[i], self.cache.v[i], *self._rope_tables[key]))
            packed = getattr(weights, "packed", {})
            head = packed["lm_head.weight"] if "lm_head.weight" in packed else weights["lm_head.weight"]
            self._step_call = DecodeStep.of(layers, embedding=self.embedding, embedding_scale=spec.embedding_scale,
                                            norm=weights["norm.weight"], norm_eps=spec.norm.eps, head=head)
        return self._step_call

    def _fused_attention(self, i: int, name: str) -> AttentionBlock | None:
        """Layer ``i``'s attention block as one kernel call for a decode token, where the interpreter runs graph
        ``name`` (not a device) and the fused call covers its form (:mod:`npumoe.core.runtime.fused`); built at
        first use."""
        if i not in self._fused_attention_blocks:
            self._fused_attention_blocks[i] = (attention_block(self.spec, i, self.model.weights)
                                               if type(self.executors[name]) is TorchGraphExecutor else None)
        return self._fused_attention_blocks[i]

    def _position(self, start: int) -> torch.Tensor:
        """The attention graphs' ``position`` input: one tensor per step, shared by its layers."""
        if self._start_position[0] != start:
            self._start_position = start, torch.tensor([start], dtype=torch.int32)
        return self._start_position[1]

    def _feed_forward(self, i: int, z: torch.Tensor, attn_out: torch.Tensor, valid: int) -> torch.Tensor:
        seq, m, step = z.shape[0], self.metrics_, self.program.layers[i]
        if step.moe is None:
            with m.time("ffn"):
                return self._run(step.dense[seq], {"z": z})["y"]
        y = self.moe_layers[(i, seq)](z, attn_out, valid, self._run, m, self._route_observer())
        if step.moe.shared is not None:
            with m.time("shared_ffn"):
                y = y + self._run(step.moe.shared[seq], {"z": z})["y"]
        return y

    def _route_observer(self):
        return self._observe_route if self.predictor is not None else self.on_route

    def _residual(self, i: int, x: torch.Tensor, h: torch.Tensor, y: torch.Tensor, valid: int) -> torch.Tensor:
        with self.metrics_.time("residual"):
            out = h + y
        if not self._finite(out, valid):  # one check a layer; h (the attention's output) says which part
            self._check_finite(h, valid, x.shape[0], "attention", i)
            self._check_finite(out, valid, x.shape[0], "ffn", i)
        return out

    def _head(self, x: torch.Tensor, valid: int, keep: str) -> torch.Tensor | None:
        """The logits of ``keep`` among chunk x's ``valid`` real positions: "all" [valid, vocab], the "last" one's
        [1, vocab], or "none" (None). The last position goes through the one-row head where the program has it, as
        decode runs it: generating needs no other position's logits (llama.cpp computes the same one)."""
        if keep == "none":
            return None
        if keep == "last" and 1 in self.program.lm_head:
            return self._lm_head(x[valid - 1:valid], 1)
        logits = self._lm_head(x, valid)
        return logits[valid - 1:valid] if keep == "last" else logits[:valid]

    def _lm_head(self, x: torch.Tensor, valid: int) -> torch.Tensor:
        with self.metrics_.time("lm_head"):
            logits = self._run(self.program.lm_head[x.shape[0]], {"x": x})["logits"]
        self._check_finite(logits, valid, x.shape[0], "lm_head")
        return logits

    def _prefetch(self, layer: int, x: torch.Tensor, groups) -> None:
        """Before the layer's attention: the predictor's experts, and their groups' graphs loaded now (on a
        device, while the attention runs)."""
        with self.metrics_.time("predict"):
            previous = self._routed.get(self._previous_moe.get(layer))
            experts = self.predictor.top(layer, x, self.preload, previous)
        self._predicted[layer] = set(experts)
        wanted = [shape.graph for g in groups if not self._predicted[layer].isdisjoint(g.experts) for shape in g.shapes]
        self.executors.prefetch(wanted)

    def _observe_route(self, layer, experts, weights, attn_out) -> None:
        if layer in self._predicted:
            routed = set(experts.reshape(-1).tolist())
            self.metrics_.add("routed_experts", len(routed))
            self.metrics_.add("predicted_hits", len(routed & self._predicted.pop(layer)))
        self._routed[layer] = experts
        if self.on_route is not None:
            self.on_route(layer, experts, weights, attn_out)

    def _check_finite(self, x: torch.Tensor, valid: int, seq: int, part: str, layer: int | None = None) -> None:
        """Stop at the first graph whose output holds NaN or Inf, naming it: otherwise a non-finite weight
        spreads through every later layer and decodes as blank text, with no sign of where it came from.
        One reduction per output checked, over the real positions only (a layer checks its output, and only
        when that fails its attention's, to say which part)."""
        if not self._finite(x, valid):
            raise NumericError(
                f"{self._graph_description(part, layer, seq)} produced NaN or Inf, so the run stops; the checkpoint "
                f"may hold non-finite weights (npumoe inspect --check-values {self.model.path} names them) or its "
                "values overflow the compute dtype (try --dtype float32)."
            )

    @staticmethod
    def _finite(x: torch.Tensor, valid: int) -> bool:
        """Every value finite? A finite sum says so in one vectorised pass (a NaN or an infinity makes the sum
        one), far cheaper than isfinite().all(); only a sum that is not, which finite values can also give by
        overflowing, is checked value by value."""
        x = x if valid == x.shape[0] else x[:valid]
        return math.isfinite(float(x.sum())) or bool(torch.isfinite(x).all())

    def _graph_description(self, part: str, layer: int | None, seq: int) -> str:
        """Which graph ``part`` of ``layer`` is, in words, for :meth:`_check_finite`'s message."""
        if part == "embedding":
            return "the embedding (embed.weight)"
        if part == "lm_head":
            return f"the LM head (graph {self.program.lm_head[seq]})"
        step = self.program.layers[layer]
        if part == "attention":
            return f"layer {layer}'s attention (graph {step.attention[seq]})"
        if step.moe is None:
            return f"layer {layer}'s feed-forward (graph {step.dense[seq]})"
        groups = step.moe.groups[seq]
        graphs = [shape.graph for g in groups for shape in g.shapes] + [g.name for g in groups if not g.shapes] + (
            [step.moe.shared[seq]] if step.moe.shared else [])
        more = f" and {len(graphs) - 3} more" if len(graphs) > 3 else ""
        return f"layer {layer}'s MoE feed-forward (router and graphs {', '.join(graphs[:3])}{more})"
