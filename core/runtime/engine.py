"""The engine: chunked prefill, KV cache, greedy decode — all through the Program's graphs.

Host steps (embedding, rope tables, masks, KV appends, routing, dispatch, combine,
residuals, sampling) run here; every static graph runs on the executor its placement
names. Nothing here calls transformers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import numpy as np
import torch

from npumoe.core.backend import Executor
from npumoe.core.graphs import experts_graph
from npumoe.core.interpreter import TorchGraphExecutor
from npumoe.core.program import Program, build_program
from npumoe.core.rope import cos_sin, short_context
from npumoe.core.runtime.kvcache import KVCache, attention_mask
from npumoe.core.runtime.metrics import Metrics
from npumoe.core.runtime.moe import MoELayer
from npumoe.core.spec import MoESpec
from npumoe.errors import InputError, NumericError
from npumoe.luts.torch_op import torch_on_one_thread

DEFAULT_CHUNK = 64
DEFAULT_MAX_CONTEXT = 512
CACHE_BUCKET = 256  # CPU attention reads the cache in steps of this many slots


class Engine:
    """Run a loaded model: ``forward(ids)`` → logits, ``generate(ids, n)`` → new ids."""

    def __init__(self, model, plan=None, backend: str = "cpu", artifacts=None,
                 chunk: int | None = None, max_context: int | None = None, on_route=None,
                 backend_options: dict | None = None):
        """``on_route(layer, experts[S,k], weights[S,k], attn_out[S,H])`` observes every routing
        decision (calibration and tests use it); it must not modify its arguments.
        ``backend_options`` go to the backend's constructor (e.g. ``profile_dir`` for the HTP)."""
        self.model = model
        self.backend_options = dict(backend_options or {})
        self.on_route = on_route
        self.spec = model.spec
        if artifacts is not None:
            from npumoe.core.artifacts import check_built_for, read_manifest
            from npumoe.core.plan import Plan
            from npumoe.core.targets import target_directory

            artifacts = target_directory(artifacts, backend)  # a multi-target build: this backend's part
            manifest = read_manifest(artifacts, verify=False)  # files are verified when loaded
            check_built_for(manifest, artifacts, model)  # before its plan's check, so the message names the artifacts
            chunk, max_context = manifest["chunk"], manifest["max_context"]
            plan = plan if plan is not None else Plan.from_json(manifest["plan"])
        elif backend != "cpu":
            raise InputError(f"backend {backend!r} runs built artifacts: run npumoe build --target {backend} "
                             "first and pass artifacts=OUT.")
        chunk = plan.chunk if plan is not None else (chunk or DEFAULT_CHUNK)
        max_context = max_context or min(self.spec.max_position, DEFAULT_MAX_CONTEXT)
        if plan is not None:
            plan.check_model(model)
        self.program: Program = build_program(self.spec, chunk=chunk, max_context=max_context, plan=plan)
        self.executors: dict[str, Executor] = self._load_executors(backend, artifacts)
        self.cache = KVCache(self.program)
        self.metrics_ = Metrics()
        self.moe_layers = self._moe_layers()
        self.embedding = model.weights["embed.weight"]  # once: in fp32 from a bf16 file, a converted copy
        self._rope_tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.rope_limit = min(filter(None, (short_context(ls.attention.rope) for ls in self.spec.layers)), default=None)

    # -- set-up ---------------------------------------------------------------------------
    def _load_executors(self, backend: str, artifacts) -> dict[str, Executor]:
        weights = self.model.weights
        execs: dict[str, Executor] = {
            name: TorchGraphExecutor(g, weights) for name, g in self.program.graphs.items() if g.placement == "cpu"
        }
        npu = [g for g in self.program.graphs.values() if g.placement == "npu"]
        if npu and backend == "cpu":
            execs.update({g.name: TorchGraphExecutor(g, weights) for g in npu})
        elif npu:
            from npumoe.core.artifacts import load_executors
            from npumoe.core.backend import get_backend

            execs.update(load_executors(get_backend(backend, **self.backend_options), artifacts, npu, weights,
                                        self.model))
        return execs

    def _moe_layers(self) -> dict[tuple[int, int], MoELayer]:
        """Per MoE layer and sequence length, the host runtime with its any-size CPU experts
        (the path for spilled tokens and CPU-resident experts)."""
        out = {}
        for i, step in enumerate(self.program.layers):
            if step.moe is None:
                continue
            moe: MoESpec = self.spec.layers[i].ffn
            cpu_experts = {
                e: TorchGraphExecutor(experts_graph(self.spec, i, (e,), 1, f"L{i}.cpu.e{e}"), self.model.weights)
                for e in range(moe.num_experts)
            }
            for s in self.program.seqs:
                out[(i, s)] = MoELayer(i, moe, self.model.weights, step.moe.groups[s], cpu_experts, step.moe.overflow)
        return out

    @property
    def metrics(self) -> dict:
        return self.metrics_.as_dict()

    # -- public API -----------------------------------------------------------------------
    def forward(self, ids) -> np.ndarray:
        """Logits [T, vocab] (fp32) for a fresh sequence of token ids."""
        ids = self._check_ids(ids)
        self.cache.reset()
        return self._prefill(ids).numpy()

    def route(self, ids) -> None:
        """Prefill a fresh sequence only for what it routes (``on_route`` sees every layer), without the
        LM head: calibration needs no logits, which for a 2048-token window of a 152k vocabulary are
        1.2 GB."""
        self.cache.reset()
        self._prefill(self._check_ids(ids), keep="none")

    def generate(self, ids, max_new_tokens: int = 32, return_logits: bool = False):
        """Greedy decoding from ``ids``; returns only the new tokens, stopping after an EOS.

        With ``return_logits`` also the logits [n, vocab] each new token was picked from."""
        ids = self._check_ids(ids)
        if self.cache.capacity < len(ids) + max_new_tokens:
            raise InputError(
                f"prompt ({len(ids)} tokens) plus {max_new_tokens} new tokens exceeds the KV cache "
                f"length {self.cache.capacity}; shorten the prompt or build with a larger max_context."
            )
        self._check_rope_range(len(ids) + max_new_tokens)
        self.cache.reset()
        with self.metrics_.time("prefill"):
            logits = self._prefill(ids, keep="last")[-1]
        new: list[int] = []
        seen: list[torch.Tensor] = []
        eos = set(self.spec.eos_token_ids)
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

    def decode(self, token: int) -> np.ndarray:
        """One decode step after :meth:`generate` or :meth:`forward`: ``token`` appended to the sequence in
        the cache, the logits [vocab] (fp32) of the next position."""
        return self._decode(int(token)).numpy()

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
        """Logits of ``keep``: "all" positions, the "last" chunk's, or "none" (the LM head is skipped)."""
        chunk, rows = self.program.chunk, []
        for start in range(0, len(ids), chunk):
            piece = ids[start:start + chunk]
            valid = len(piece)
            padded = torch.cat([piece, piece.new_zeros(chunk - valid)]) if valid < chunk else piece
            wanted = keep == "all" or (keep == "last" and start + chunk >= len(ids))
            logits = self._step(padded, valid, lm_head=wanted)
            if wanted:
                rows.append(logits[:valid])
        return torch.cat(rows) if rows else None

    def _run(self, name: str, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        placement = self.program.graphs[name].placement
        self.metrics_.add("npu_launches" if placement == "npu" else "cpu_launches")
        with self.metrics_.running([name]):
            return self.executors[name](inputs)

    def _rope_rows(self, att, start: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin rows for positions start..start+seq-1, sliced from tables of every position a run can
        reach (computed once per rope: the same values cos_sin gives for those positions)."""
        head_dim = att.qk_rope_head_dim if att.kind == "mla" else att.head_dim
        key = (att.rope, head_dim)
        if key not in self._rope_tables:
            cos, sin = cos_sin(att.rope, head_dim, np.arange(self.cache.capacity + self.program.chunk))
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

    def _step(self, ids: torch.Tensor, valid: int, lm_head: bool = True) -> torch.Tensor | None:
        """One static-shape pass over ``len(ids)`` positions, the first ``valid`` real; their logits
        unless ``lm_head`` is off."""
        seq, start, spec, m = len(ids), self.cache.length, self.spec, self.metrics_
        with m.time("embed"):
            x = self.embedding[ids].float() * spec.embedding_scale
        self._check_finite(x, valid, seq, "embedding")
        masks: dict[tuple, torch.Tensor] = {}  # layers alike in window and cache slots share one mask
        position = torch.tensor([start], dtype=torch.int32)
        for i, step in enumerate(self.program.layers):
            att = spec.layers[i].attention
            slots = self._cache_slots(step.attention[seq], start)
            with m.time("rope_mask"):
                cos, sin = self._rope_rows(att, start, seq)
                key = (att.sliding_window, slots)
                if key not in masks:
                    masks[key] = attention_mask(att, start, seq, valid, slots)
            with m.time("attention"):
                feed = {"x": x, "cos": cos, "sin": sin, "mask": masks[key], "position": position}
                if not self.executors[step.attention[seq]].keeps_state:
                    feed |= {"k_cache": self.cache.k[i][:, :slots], "v_cache": self.cache.v[i][:, :slots]}
                out = self._run(step.attention[seq], feed)
            self.cache.append(i, out["k_new"], out["v_new"], valid)
            h, z = out["h"], out["z"]
            if step.moe is not None:
                y = self.moe_layers[(i, seq)](z, h - x, valid, self._run, m, self.on_route)
                if step.moe.shared is not None:
                    with m.time("shared_ffn"):
                        y = y + self._run(step.moe.shared[seq], {"z": z})["y"]
            else:
                with m.time("ffn"):
                    y = self._run(step.dense[seq], {"z": z})["y"]
            with m.time("residual"):
                x = h + y
            if not self._finite(x, valid):  # one check a layer; h (the attention's output) says which part
                self._check_finite(h, valid, seq, "attention", i)
                self._check_finite(x, valid, seq, "ffn", i)
        self.cache.length += valid
        if not lm_head:
            return None
        with m.time("lm_head"):
            logits = self._run(self.program.lm_head[seq], {"x": x})["logits"]
        self._check_finite(logits, valid, seq, "lm_head")
        return logits

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
        return bool(torch.isfinite(x[:valid]).all())

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
        graphs = [g.graph for g in step.moe.groups[seq]] + ([step.moe.shared[seq]] if step.moe.shared else [])
        more = f" and {len(graphs) - 3} more" if len(graphs) > 3 else ""
        return f"layer {layer}'s MoE feed-forward (router and graphs {', '.join(graphs[:3])}{more})"
